"""The trainer's GPU path on CUDA (skipped without a GPU; run on one with tests/gpu/run_on_device.sh).

- megatron GPTModel log-probs on CUDA match transformers on CUDA (fp32), as they do on CPU;
- PolicyTrainer(device="cuda") trains GRPO steps whose losses and weights follow the CPU trainer on the same
  batches (fp32 tightly, bf16 loosely), and its weights load back into transformers;
- the in-process launcher builds a CUDA trainer from `--device cuda`.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint

    path = resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    return path, load_tokenizer(path)


def batches(tok, steps: int, n: int = 8):
    from sluiceway.tasks.train.samples import TrainSample

    rng = random.Random(0)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(n):
            prompt = tok.encode(f"What is {rng.randint(1, 9)} + {rng.randint(1, 9)}?")
            resp = [rng.randrange(5, 200) for _ in range(rng.randint(2, 12))]
            rows.append(TrainSample(prompt, resp, [1] * len(resp), rng.uniform(-1, 1), [-3.0] * len(resp)))
        out.append(rows)
    return out


def make_trainer(path, tok, device: str, bf16: bool):
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.tasks.train.trainer import PolicyTrainer

    training = TrainingConfig(global_batch_size=8, micro_batch_size=4, lr=1e-3, bf16=bf16, hf_checkpoint=str(path))
    return PolicyTrainer(path, training, AlgorithmConfig(), temperature=1.0, pad_token_id=tok.pad_token_id,
                         device=device)  # fmt: skip


def test_megatron_logprobs_match_transformers_on_cuda(tiny):
    from sluiceway.models.megatron_logprobs import token_logprobs
    from sluiceway.models.zoo import load_hf_model
    from sluiceway.tasks.train.collation import collate

    path, tok = tiny
    trainer = make_trainer(path, tok, "cuda", bf16=False)
    hf = load_hf_model(path).cuda().eval()
    mb = collate(batches(tok, 1)[0], tok.pad_token_id).to(torch.device("cuda"))
    with torch.no_grad():
        ours = token_logprobs(trainer.model, mb.input_ids)
        logits = hf(input_ids=mb.input_ids).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    valid = mb.loss_mask.bool()
    assert ours.device.type == "cuda"
    assert (ours - ref)[valid].abs().max().item() < 1e-4


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_cuda_trainer_follows_the_cpu_trainer(tiny, bf16, tmp_path):
    path, tok = tiny
    data = batches(tok, 3)
    cpu, gpu = make_trainer(path, tok, "cpu", bf16), make_trainer(path, tok, "cuda", bf16)
    assert next(gpu.model.parameters()).device.type == "cuda"
    for k, rows in enumerate(data):
        mc, mg = cpu.train_rollout(rows, k), gpu.train_rollout(rows, k)
        tol = 2e-2 if bf16 else 1e-4
        assert abs(mc["loss"] - mg["loss"]) <= tol * max(1.0, abs(mc["loss"])), (k, mc["loss"], mg["loss"])
        assert abs(mc["grad_norm"] - mg["grad_norm"]) <= 10 * tol * max(1.0, mc["grad_norm"]), k
    sc, sg = cpu.hf_state_dict(), gpu.hf_state_dict()
    s0 = make_trainer(path, tok, "cpu", bf16).hf_state_dict()
    # The updates (AdamW over fp32 masters) point the same way: cosine of the two weight changes. In bf16 a few
    # elements with tiny gradients flip the sign of their Adam step, so elementwise maxima say little there.
    dc = torch.cat([(sc[n].float() - s0[n].float()).flatten() for n in s0])
    dg = torch.cat([(sg[n].float().cpu() - s0[n].float()).flatten() for n in s0])
    cos = torch.nn.functional.cosine_similarity(dc, dg, dim=0).item()
    assert dc.abs().max() > 0 and cos > (0.9 if bf16 else 0.999), cos

    from transformers import AutoModelForCausalLM

    out = gpu.write_weights(path, tmp_path / "weights")
    hf = AutoModelForCausalLM.from_pretrained(out)
    for name, t in hf.state_dict().items():
        if name in sg:
            assert torch.equal(t.float(), sg[name].float().cpu()), name


@pytest.mark.parametrize("launcher", ["in_process", "torchrun"])
def test_launcher_builds_a_cuda_trainer(tiny, tmp_path, launcher):
    """In-process, and a one-rank torchrun group (NCCL on CUDA): both train a step on the GPU."""
    from sluiceway.flows.config import RunConfig
    from sluiceway.tasks.train.launch import build_trainer

    path, tok = tiny
    cfg = RunConfig.model_validate({
        "data": {"prompt_data": "env:arithmetic"},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4},
        "resources": {"device": "cuda", "trainer_launcher": launcher},
        "training": {"hf_checkpoint": str(path), "global_batch_size": 8, "micro_batch_size": 4},
        "storage": {"output_dir": str(tmp_path / "run")},
    })  # fmt: skip
    trainer = build_trainer(cfg, path, tok.pad_token_id, tmp_path / "work", total_iters=2)
    try:
        if launcher == "in_process":
            assert next(trainer.model.parameters()).device.type == "cuda"
        m = trainer.train_rollout(batches(tok, 1)[0], 0)
        assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss"]))
        out = trainer.write_weights(path, tmp_path / "weights")
        assert (out / "config.json").exists()
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
