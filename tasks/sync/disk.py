"""Weight sync through a shared directory: each new version becomes an HF model directory that engines load
with SGLang's `/update_weights_from_disk`.

A version directory holds the base model's config and tokenizer files plus the new `model.safetensors`,
so it is a complete model an SGLang server could also start from. It is written under a temporary name and
renamed, so an engine never sees half a file. Only the newest `keep` versions stay on disk.

Once `keep` (>= 2) versions exist, the oldest one's directory becomes the new version's: its model file has
the same size every step and is overwritten in place (`safetensors_raw.write(reuse=True)`), which reuses its
pages instead of allocating and writing back a new file each step (SmolLM2 fp32, 540 MB: 0.1 s, where
safetensors' `save_file` of a new file took 0.16-1.5 s). That version is two updates old: every engine has
loaded a newer one since, and engines copy what they load (the embedded engine owns its tensors; SGLang's
are on the GPU), so no reader sees its bytes change.

Every version directory records its files' sizes and sha256s in `checksums.json` (storage/weights/checksums.py;
the model file's digest is taken as it is written, +0.17 s for SmolLM2's 270 MB here), and the run keeps the same
record of every version on disk outside them, in `weights.published.json` beside `weights/` (entered before the
version's directory is renamed into place), so a checksums.json lost or emptied with its files, or a directory
copied over another version's, is seen. A resume checks the one version its engines load against it before
trusting it (`settle_versions`).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch

from sluiceway.storage.weights import safetensors_raw
from sluiceway.storage.weights.checksums import (
    CHECKSUMS,
    has_record,
    record_published,
    version_problem,
    write_checksums,
)
from sluiceway.storage.weights.model_dir import config_with_dtype

log = logging.getLogger("sluiceway")

_SAFETENSORS_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", CHECKSUMS)
_VERSION_DIR = re.compile(r"v(\d{6,})")


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def _versions_on_disk(root: Path) -> list[Path]:
    return sorted(d for d in Path(root).iterdir() if _VERSION_DIR.fullmatch(d.name) and d.is_dir())


def _publish(root: Path, tmp: Path, final: Path, version: int, record: dict, keep: int) -> None:
    """Enter the version in the run's record, then rename it into place and drop all but the newest `keep`."""
    on_disk = {int(d.name[1:]) for d in _versions_on_disk(root)}
    record_published(root, version, record, on_disk=set(sorted(on_disk)[-keep:]))
    tmp.rename(final)
    for old in _versions_on_disk(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_weight_version(
    state_dict: dict[str, torch.Tensor],
    base_model_dir: Path,
    root: Path,
    version: int,
    keep: int = 2,
    dtype: str | None = None,
) -> Path:
    """The version's model directory under `root`; `dtype` (a torch name) casts floating tensors to it and says
    so in config.json (an engine loading with dtype "auto" then serves them as written)."""
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if final.exists():  # a retried sync of the same version: the directory is complete (it was renamed)
        return final
    tmp = root / f".tmp-v{version:06d}"
    for stale in root.glob(".tmp-v*"):  # a write a kill interrupted (one writer per run: the run lock)
        shutil.rmtree(stale, ignore_errors=True)
    versions = _versions_on_disk(root)
    if keep >= 2 and len(versions) >= keep:
        versions[0].rename(tmp)  # leaves with this write anyway: its model file is overwritten in place below
    else:
        tmp.mkdir()
    for f in Path(base_model_dir).iterdir():
        if f.is_file() and f.name not in _MODEL_FILES:
            shutil.copy2(f, tmp / f.name)
    # Tied embeddings appear once (HF re-ties lm_head on load).
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if dtype is not None:
        to = getattr(torch, dtype)
        tensors = {k: v.to(to) if v.is_floating_point() else v for k, v in tensors.items()}
        if (tmp / "config.json").exists():
            config_with_dtype(tmp / "config.json", _SAFETENSORS_NAMES[dtype], tmp)
    raw = {k: safetensors_raw.from_torch(v, copy=False) for k, v in sorted(tensors.items())}
    meta = {"format": "pt", "weight_version": str(version)}
    digest = safetensors_raw.write(tmp / "model.safetensors", raw, meta, reuse=True, checksum=True)
    size = (tmp / "model.safetensors").stat().st_size
    record = write_checksums(tmp, version, known={"model.safetensors": {"bytes": size, "sha256": digest}})
    _publish(root, tmp, final, version, record, keep)
    return final


def write_adapter_version(
    adapter: dict[str, torch.Tensor], spec, base_model_dir: Path, root: Path, version: int, keep: int = 2
) -> Path:
    """A LoRA adapter version under `root`: peft's adapter directory (adapter_config.json with the base model's
    directory as base_model_name_or_path, adapter_model.safetensors in fp32). Engines merge it into their own base
    weights on load (models/engine/core.py) or load it as a LoRA adapter (SGLang). Written under a temporary name
    and renamed, like a full version; the newest `keep` stay."""
    from sluiceway.models.lora import write_adapter_dir

    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if final.exists():
        return final
    tmp = root / f".tmp-v{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_adapter_dir(adapter, spec, tmp, str(Path(base_model_dir).resolve()), {"weight_version": str(version)})
    record = write_checksums(tmp, version)  # an adapter is small (megabytes): hashed from the file
    _publish(root, tmp, final, version, record, keep)
    return final


def settle_versions(root: Path, version: int) -> None:
    """Before a resumed run trusts its weight directory `root`, where its trainer (just loaded from a verified
    checkpoint) is at `version`.

    - Versions newer than `version` were written after the checkpoint, by steps the resume trains again: removed,
      so each is written anew when its step syncs (a write finds an existing directory and keeps it).
    - `version` itself is what the resume's engines load. Checked against the run's record of what it published
      as `version` (storage/weights/checksums.py `version_problem`), else its own checksums.json; a damaged one (a
      file missing, truncated, added or with a flipped byte, a checksums.json missing, emptied or unlike the
      run's record, another version's directory in its place) is removed with one warning naming what is wrong,
      and the resume's sync writes it again from the checkpoint's weights. Rebuilt rather than refused: the trainer
      holds exactly these weights, so the repair costs one write (the same as a sync) and the run ends as an
      undamaged one would.
    - Older versions are not loaded by anything in a resume (the next write reuses the oldest as scratch).

    A directory neither the run's record nor a checksums.json covers (both lost, or written by a build before
    them) is rebuilt the same way: nothing says what its bytes should be. Cost: one hash of one version (SmolLM2,
    270 MB: about 0.2 s here), once per resume; no hashing when engines load a version.
    """
    if not Path(root).is_dir():
        return
    for d in sorted(Path(root).iterdir()):
        m = _VERSION_DIR.fullmatch(d.name)
        if m is None or not d.is_dir():
            continue
        v = int(m.group(1))
        if v > version:
            shutil.rmtree(d)
            log.info("removed %s: written after the checkpoint (v%d); its step is trained again", d, version)
        elif v == version:
            # Nothing vouching for it (both records lost, or a build before them): rebuilt like a damaged one,
            # since loading it unchecked would train on whatever bytes it holds (issue 40 point 4).
            problem = "no checksums.json and no entry in the run's record" if not has_record(d, v) else None
            problem = problem or version_problem(d, v)
            if problem is not None:
                log.warning("weights %s/%s; writing v%d again from the checkpoint's weights", d, problem, version)
                shutil.rmtree(d)
