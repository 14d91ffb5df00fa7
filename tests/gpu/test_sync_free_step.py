"""A training step on CUDA waits for the device once (issue 44), and the GPU's log-prob paths give the numbers
of the plain ones (skipped without a GPU; run on one with tests/gpu/run_on_device.sh).

- the micro-batch loop (forward, loss, backward of every micro-batch) runs under
  `torch.cuda.set_sync_debug_mode("error")`: any `.item()`, `nonzero`, blocking copy or synchronize raises;
- a whole `train_rollout` synchronises exactly once: the step's metrics, read in one copy before the optimizer
  step (they decide whether it is refused);
- the output layer fused with the log-prob (`LinearTokenLogProbEntropy`, compiled chunk kernels) agrees with the
  output layer's logits through `TokenLogProbEntropy`, values and gradients;
- compiled transformer layers (`build_gpt_model`'s default on CUDA) agree with the eager ones over three lengths.
"""

from __future__ import annotations

import random
import traceback
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint

    path = resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    return path, load_tokenizer(path)


def _train_sample():
    try:
        from sluiceway.tasks.train.samples import TrainSample
    except ImportError:  # where TrainSample still lives in batch.py (it moves to a storage-free module)
        from sluiceway.tasks.train.batch import TrainSample
    return TrainSample


def rows(tok, n: int = 8, seed: int = 0):
    TrainSample = _train_sample()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tok.encode(f"What is {rng.randint(1, 9)} + {rng.randint(1, 9)}?")
        resp = [rng.randrange(5, 200) for _ in range(rng.randint(2, 12))]
        out.append(TrainSample(prompt, resp, [1] * len(resp), rng.uniform(-1, 1), [-3.0] * len(resp)))
    return out


def trainer_for(path, tok, bf16: bool, **training):
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.tasks.train.trainer import PolicyTrainer

    cfg = TrainingConfig(global_batch_size=8, micro_batch_size=4, lr=1e-3, bf16=bf16, hf_checkpoint=str(path),
                         **training)  # fmt: skip
    return PolicyTrainer(path, cfg, AlgorithmConfig(), temperature=0.9, pad_token_id=tok.pad_token_id, device="cuda")


class _Syncs:
    """Records the synchronising CUDA calls made inside it (sync debug mode "warn"): where each was made."""

    def __enter__(self):
        self.where: list[str] = []
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self.where.append("".join(traceback.format_stack(limit=14)[:-1]))

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        return False


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_micro_batch_loop_never_waits_for_the_device(tiny, packed):
    path, tok = tiny
    trainer = trainer_for(path, tok, bf16=True, **({"max_tokens_per_gpu": 64} if packed else {}))
    batch = rows(tok)
    trainer.train_rollout(batch, 0)  # the same shapes once first: compiling and autotuning synchronise
    inner = trainer._accumulate

    def guarded(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    trainer._accumulate = guarded
    m = trainer.train_rollout(batch, 1)
    assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss"]))


def test_a_step_synchronises_once(tiny):
    path, tok = tiny
    trainer = trainer_for(path, tok, bf16=True)
    batch = rows(tok)
    trainer.train_rollout(batch, 0)
    with _Syncs() as syncs:
        m = trainer.train_rollout(batch, 1)
    assert torch.isfinite(torch.tensor(m["loss"]))
    assert len(syncs.where) == 1, f"{len(syncs.where)} synchronisations:\n" + "\n----\n".join(syncs.where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_output_layer_on_cuda_matches_the_logits_path(tiny, dtype, monkeypatch):
    import sluiceway.models.megatron_gpt as mg
    import sluiceway.models.megatron_logprobs as mlp
    from sluiceway.models.hf_megatron import load_hf_weights
    from sluiceway.models.zoo import load_hf_model

    path, _ = tiny
    hf = load_hf_model(path)
    mg.init_parallel_state()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (4, 40), generator=g).cuda()
    needed = torch.zeros(4, 39, dtype=torch.bool, device="cuda")
    needed[:, 12:] = True

    def run(fused: bool):
        monkeypatch.setattr(mlp, "FUSED_OUTPUT_LAYER", fused)
        model = mg.build_gpt_model(hf.config, dtype=dtype, device="cuda").train()
        load_hf_weights(model, hf)
        assert (mlp.fused_output_weight(model, ids.device) is not None) == fused
        logp, ent = mlp.token_logprobs_and_entropy(model, ids, 0.8, needed=needed)
        (logp.sum() - 0.1 * ent.sum()).backward()
        return logp.detach(), ent.detach(), [p.grad.float() for p in model.parameters()]

    logp, ent, grads = run(True)
    ref_logp, ref_ent, ref_grads = run(False)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (logp - ref_logp).abs().max().item() < tol and (ent - ref_ent).abs().max().item() < tol
    for a, b in zip(grads, ref_grads):
        assert (a - b).norm().item() <= 10 * tol * max(1.0, b.norm().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_layers_on_cuda_match_the_eager_layers(tiny, dtype, monkeypatch):
    import sluiceway.models.megatron_gpt as mg
    import sluiceway.models.megatron_logprobs as mlp
    from sluiceway.models.hf_megatron import load_hf_weights
    from sluiceway.models.zoo import load_hf_model

    path, _ = tiny
    hf = load_hf_model(path)
    mg.init_parallel_state()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, hf.config.vocab_size, s, generator=g).cuda() for s in ((4, 40), (3, 57), (2, 33))]

    def run(compiled: bool):
        monkeypatch.setenv("SLUICEWAY_COMPILE_LAYERS", "1" if compiled else "0")
        model = mg.build_gpt_model(hf.config, dtype=dtype, device="cuda").train()
        layer = model.decoder.layers[0]
        assert (layer._compiled_call_impl is not None) == compiled
        load_hf_weights(model, hf)
        out = []
        for ids in batches:
            model.zero_grad(set_to_none=True)
            logp, ent = mlp.token_logprobs_and_entropy(model, ids, 0.8)
            (logp.sum() - 0.1 * ent.sum()).backward()
            out.append((logp.detach(), [p.grad.float() for p in model.parameters()]))
        return out

    got, want = run(True), run(False)
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: fused elementwise ops round once, eager ones each op
    for (logp, grads), (ref_logp, ref_grads) in zip(got, want):
        assert (logp - ref_logp).abs().max().item() < tol
        for a, b in zip(grads, ref_grads):
            assert (a - b).norm().item() <= 10 * tol * max(1.0, b.norm().item())
