"""An HF model directory's files, as the weight store and the trainer's weight versions see them: its tensors
(`read_model_dir`), the files that are not weights (`aux_files`), and its config saying the weights' dtype
(`config_with_dtype`).

Nothing here touches the object store, so a trainer writing a version to its own disk (tasks/sync/disk.py) reads
it without loading the store.
"""

from __future__ import annotations

import json
from pathlib import Path

from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.checksums import CHECKSUMS
from sluiceway.storage.weights.manifest import MANIFEST

# Files of an HF model directory that hold weights or describe them: the store rebuilds these, it never copies
# them (checksums.json changes with every version: as an aux file it would make every version a full one).
_WEIGHT_FILES = ("model.safetensors.index.json", MANIFEST, CHECKSUMS)


def aux_files(model_dir: Path | None) -> dict[str, Path]:
    """The non-weight files of an HF model directory (config, tokenizer, generation config, ...)."""
    if model_dir is None:
        return {}
    return {
        f.name: f
        for f in sorted(Path(model_dir).iterdir())
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _WEIGHT_FILES
        and not f.name.startswith(".")
    }  # fmt: skip


def read_model_dir(model_dir: Path) -> dict[str, st.RawTensor]:
    """Every tensor of every *.safetensors file in an HF model directory (sharded or not), as raw bytes."""
    tensors: dict[str, st.RawTensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(st.read(f)[0])
    if not tensors:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return tensors


_TORCH_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def config_with_dtype(config: Path, dtype: str, out_dir: Path) -> Path:
    """``config`` saying the weights are ``dtype`` (an engine with dtype "auto" loads what the config says):
    the same file if it already does, else a rewritten copy in ``out_dir``."""
    cfg = json.loads(config.read_text())
    name = _TORCH_NAMES[dtype]
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]  # transformers 5 writes "dtype"
    if all(cfg.get(k) == name for k in keys):
        return config
    for k in keys:
        cfg[k] = name
    out = out_dir / "config.json"
    out.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
