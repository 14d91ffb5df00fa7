"""Weight-store test data: tiny bf16 state dicts, small updates as a small learning rate makes, a published run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.publish import WeightPublisher


def bits(t: torch.Tensor) -> bytes:
    return st.from_torch(t).data


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "lm_head.bias": torch.zeros(64, dtype=torch.float32),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def small_step(sd: dict[str, torch.Tensor], version: int, frac: float = 0.02) -> dict[str, torch.Tensor]:
    """An update that changes a few percent of the bf16 weights by a small relative step (as a small lr does)."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for k, t in sd.items():
        if t.dtype == torch.bfloat16 and "norm" not in k:  # the norm stays: a tensor a delta skips
            mask = torch.rand(t.shape, generator=g) < frac
            t = torch.where(mask, (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=g))).bfloat16(), t)
        out[k] = t.clone()
    out["step"] = torch.tensor(version, dtype=torch.int64)
    return out


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    (path / "tokenizer.json").write_text(json.dumps({"vocab": list(range(64))}))
    return path


def publish_run(wstore, tmp: Path, n: int, **kw) -> list[dict[str, torch.Tensor]]:
    pub = WeightPublisher(wstore, **kw)
    sd, states = tiny_state(), []
    files = model_dir(tmp / "hf")
    for v in range(1, n + 1):
        pub.publish(v, sd, files)
        states.append(sd)
        sd = small_step(sd, v + 1)
    return states


def assert_holds(out: Path, sd: dict[str, torch.Tensor]) -> None:
    got, _ = st.read(out / "model.safetensors")
    assert {k: bytes(t.data) for k, t in got.items()} == {k: bits(t) for k, t in sd.items()}
    loaded = load_file(out / "model.safetensors")  # and it is a file safetensors / HF load
    assert all(bits(loaded[k]) == bits(sd[k]) for k in sd)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
