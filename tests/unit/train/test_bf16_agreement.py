"""Issue 31: in bf16 the embedded engine and the trainer give a sampled token the same log-prob.

The engine samples with continuous batching (requests joining and leaving, one decode row at the end, padded
prefills); the trainer scores the same tokens in each of its layouts (one sample a row, shared prompts, packed
rows). They agree bit for bit: same norm, same attention arithmetic over a padded key span, same log-prob formula
(models/batch_invariant.py, models/fused_logprobs.py). On tiny-llama and on a model of SmolLM2's widths (576 wide,
9 query / 3 KV heads, 1536 MLP). The Makefile runs this file again as an AVX2-only CPU (`make test-avx2`).

Exact equality on every CPU kind measured: AVX-512 BF16 (AMD EPYC), AVX2 (the Makefile's pass) and AMX (Intel
Xeon), where oneDNN's bf16 products vary with the number of rows and both sides run them in row blocks (issue 51,
models/batch_invariant.py `stable_linear`). On an AMX machine the file runs once more with AMX turned off
(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), so one machine checks both kinds.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.engine.calls import GenerateRequest, SamplingParams
from sluiceway.models.engine.core import Engine
from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.trainer import PolicyTrainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEMPERATURE = 0.7
PROMPTS, SAMPLES = 2, 3  # GRPO-style groups: the shared-prompt layout has something to share


def amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory, tiny):
    """SmolLM2's widths with 3 layers and a small vocabulary, random weights (norms perturbed), saved as HF with
    tiny-llama's tokenizer files (a model directory needs one; nothing here decodes)."""
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=2048, max_position_embeddings=512, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.0) if "norm" not in name else p.add_(0.2 * torch.randn_like(p))  # livelier than the init
    path = tmp_path_factory.mktemp("smollm2-shaped")
    model.save_pretrained(path)
    for f in tiny[0].glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


def engine_samples(path: Path, vocab: int) -> list[TrainSample]:
    """PROMPTS x SAMPLES responses from the bf16 engine, at most 4 running at once (rows join and leave)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 23)]
    engine = Engine(path, dtype=torch.bfloat16, max_running_requests=4, max_total_len=256, load_tokenizer=False)
    try:
        requests = [
            GenerateRequest(p, SamplingParams(max_new_tokens=30 + 7 * j, temperature=TEMPERATURE, ignore_eos=True,
                                              sampling_seed=10 * i + j), rid=f"{i}-{j}")  # fmt: skip
            for i, p in enumerate(prompts)
            for j in range(SAMPLES)
        ]
        outs = engine.generate(requests, timeout=300)
    finally:
        engine.shutdown()
    return [
        TrainSample(r.input_ids, o.output_ids, [1] * len(o.output_ids), 0.0, o.output_logprobs)
        for r, o in zip(requests, outs)
    ]


LAYOUTS = {
    "own rows": None,
    "shared prompts": [[0, 1, 2], [3, 4, 5]],
    "packed": [[0, 3], [1, 4], [2, 5]],
}


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-shaped"])
def test_engine_and_trainer_bf16_logprobs_agree(model, tiny, smollm2_shaped):
    path = tiny[0] if model == "tiny-llama" else smollm2_shaped
    training = TrainingConfig(global_batch_size=6, micro_batch_size=6, bf16=True, hf_checkpoint=str(path))
    trainer = PolicyTrainer(path, training, AlgorithmConfig(), temperature=TEMPERATURE, pad_token_id=0)
    samples = engine_samples(path, trainer.hf_config.vocab_size)
    for layout, rows in LAYOUTS.items():
        mb = collate(samples, 0, rows)
        with torch.no_grad():
            logp, _ = trainer._logprobs(trainer.model, mb)
        on = mb.loss_mask > 0
        gap = (logp[on] - mb.rollout_logprobs[on]).abs()
        assert gap.numel() == sum(len(s.response_token_ids) for s in samples)
        assert float(gap.mean()) <= 1e-3, (layout, float(gap.mean()))  # issue 31's bound, on any CPU
        assert torch.equal(logp[on], mb.rollout_logprobs[on]), (layout, float(gap.max()), int((gap > 0).sum()))


@pytest.mark.skipif(not amx(), reason="this CPU has no AMX to turn off")
@pytest.mark.skipif(bool(os.environ.get("ONEDNN_MAX_CPU_ISA")), reason="oneDNN's ISA is limited already")
def test_agreement_with_amx_turned_off():
    """The same file under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: the AVX-512 BF16 kernels, not AMX's."""
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    # SmolLM2's widths only: tiny-llama's products (inner dimension <= 256) are row-invariant on AMX as well.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "smollm2", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-1000:]
