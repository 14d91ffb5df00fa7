"""The receiver's side: turn what it holds plus the store into an exact local copy of a weight version.

A receiver that holds version L of the target's chain downloads only the deltas after L. Every delta checks the
receiver's bytes against the sha256 of the base it was made from before applying, and every result against the
target sha256; a receiver whose bytes do not match (a different run, a corrupted disk, a version outside the
chain) falls back to the chain's full version. The output directory is written beside the target and renamed
into place, so a failure leaves the receiver's old weights untouched.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.checksums import write_checksums
from sluiceway.storage.weights.codec import decode
from sluiceway.storage.weights.errors import BaseMismatch, CorruptWeights
from sluiceway.storage.weights.manifest import MANIFEST, Manifest
from sluiceway.storage.weights.model_dir import aux_files, read_model_dir
from sluiceway.storage.weights.publish import sha256
from sluiceway.storage.weights.store import WeightStore

log = logging.getLogger(__name__)

# name -> (tensor, its sha256 if already checked, else None)
_State = dict[str, tuple[st.RawTensor, str | None]]


def local_version(model_dir: Path | None) -> int | None:
    """The version a materialized directory claims to hold (its manifest), or None."""
    if model_dir is None or not (Path(model_dir) / MANIFEST).is_file():
        return None
    try:
        return Manifest.loads((Path(model_dir) / MANIFEST).read_text()).version
    except ValueError:
        return None


def _held_sha(state: _State, name: str) -> str:
    tensor, sha = state[name]
    if sha is None:
        sha = sha256(tensor.data)
        state[name] = (tensor, sha)
    return sha


def apply_delta(state: _State, manifest: Manifest, data: bytes) -> _State:
    """The tensors of ``manifest``'s version from those of its base; raises naming the version and tensor."""
    v = manifest.version
    view = memoryview(data)
    out: _State = {}
    for name, e in manifest.tensors.items():
        width = st.DTYPE_WIDTH[e.dtype]
        base = None
        if e.encoding != "raw":
            if name not in state:
                raise BaseMismatch(v, name, f"the receiver holds no such tensor (delta on v{manifest.base_version})")
            held = state[name][0]
            if _held_sha(state, name) != e.base_sha256 or (held.dtype, list(held.shape)) != (e.dtype, e.shape):
                raise BaseMismatch(v, name, f"the receiver's tensor is not the one in v{manifest.base_version}")
            base = held.data
            if e.encoding == "same":
                out[name] = (st.RawTensor(e.dtype, tuple(e.shape), held.data), e.sha256)
                continue
        if e.offset is None or e.length is None or e.offset + e.length > len(view):
            end = None if e.offset is None or e.length is None else e.offset + e.length
            raise CorruptWeights(v, name, f"payload ends at byte {end} but {manifest.data_file} has {len(view)}")
        new = decode(e.encoding, view[e.offset : e.offset + e.length], base, e.nbytes, width, version=v, tensor=name)
        got = sha256(new)
        if got != e.sha256:
            raise CorruptWeights(v, name, f"decoded bytes have sha256 {got[:12]}..., manifest says {e.sha256[:12]}...")
        out[name] = (st.RawTensor(e.dtype, tuple(e.shape), new), got)
    return out


def _check_full(manifest: Manifest, tensors: dict[str, st.RawTensor]) -> _State:
    v = manifest.version
    missing = sorted(set(manifest.tensors) - set(tensors))
    if missing:
        raise CorruptWeights(v, missing[0], f"not in {manifest.data_file}")
    state: _State = {}
    for name, e in manifest.tensors.items():
        t = tensors[name]
        got = sha256(t.data)
        if got != e.sha256 or (t.dtype, list(t.shape)) != (e.dtype, e.shape):
            raise CorruptWeights(v, name, f"stored bytes do not match the manifest (sha256 {got[:12]}...)")
        state[name] = (t, got)
    return state


def _download_full(wstore: WeightStore, manifest: Manifest) -> _State:
    data = wstore.read_file(manifest.version, manifest.data_file)
    try:
        tensors, _ = st.parse(data, what=manifest.data_file)
    except (ValueError, KeyError) as exc:
        raise CorruptWeights(manifest.version, _blamed(str(exc)), str(exc)) from None
    return _check_full(manifest, tensors)


def _blamed(message: str) -> str | None:
    """The tensor a safetensors parse error names, if it names one."""
    if "tensor '" in message:
        return message.split("tensor '", 1)[1].split("'", 1)[0]
    return None


def _from_local(wstore: WeightStore, chain: list[Manifest], local_dir: Path) -> _State | None:
    """Apply the chain's deltas after the receiver's version; None if the receiver's weights are not usable."""
    held = local_version(local_dir)
    versions = [m.version for m in chain]
    if held not in versions:
        return None
    start = versions.index(held)
    try:
        state: _State = {k: (t, None) for k, t in read_model_dir(local_dir).items()}
    except (OSError, ValueError, KeyError) as exc:  # a damaged local copy is a reason to fetch, not to stop
        log.warning("weights in %s unreadable (%s); falling back to full version v%d", local_dir, exc, chain[0].version)
        return None
    try:
        for m in chain[start + 1 :]:
            state = apply_delta(state, m, wstore.read_file(m.version, m.data_file))
        target = chain[-1]
        for name, e in target.tensors.items():  # the receiver may already be at the target: check what it holds
            if name not in state or _held_sha(state, name) != e.sha256:
                raise BaseMismatch(target.version, name, "the receiver's copy of this version differs from the store's")
        if set(state) != set(target.tensors):
            extra = sorted(set(state) - set(target.tensors))[0]
            raise BaseMismatch(target.version, extra, "the receiver holds a tensor this version does not have")
    except BaseMismatch as exc:
        log.warning("%s; falling back to full version v%d", exc, chain[0].version)
        return None
    return state


def materialize(wstore: WeightStore, version: int, local_base_dir: Path | None, out_dir: Path) -> Path:
    """Write weight ``version`` as an HF model directory at ``out_dir`` (may be ``local_base_dir`` itself).

    Uses the deltas after what ``local_base_dir`` holds where it can, else downloads the chain's full version.
    Raises :class:`CorruptWeights` / :class:`MissingVersion` naming the version and tensor when the store cannot
    produce exactly the manifest's bytes; ``out_dir`` is then left as it was.
    """
    chain = wstore.chain(version)
    target = chain[-1]
    state = _from_local(wstore, chain, Path(local_base_dir)) if local_base_dir is not None else None
    if state is None:
        state = _download_full(wstore, chain[0])
        for m in chain[1:]:
            state = apply_delta(state, m, wstore.read_file(m.version, m.data_file))
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_files(wstore, target, local_base_dir, tmp)
        # A LoRA adapter version (--lora-sync adapter) keeps peft's file name, so peft and SGLang load it as is.
        name = "adapter_model.safetensors" if "adapter_config.json" in target.files else "model.safetensors"
        digest = st.write(tmp / name, {k: state[k][0] for k in target.tensors}, target.metadata, checksum=True)
        (tmp / MANIFEST).write_text(target.dumps())
        # What a pool agent checks its copy against when it starts (infra/pool_agent.py): the file as written.
        known = {name: {"bytes": (tmp / name).stat().st_size, "sha256": digest}}
        write_checksums(tmp, target.version, known=known)
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_files(wstore: WeightStore, target: Manifest, local_dir: Path | None, tmp: Path) -> None:
    """Config/tokenizer files: copied from the receiver where their checksum matches, else downloaded."""
    have = aux_files(local_dir) if local_dir is not None else {}
    for name, entry in target.files.items():
        if name in have and sha256(have[name].read_bytes()) == entry.sha256:
            shutil.copy2(have[name], tmp / name)
            continue
        wstore.get_file(target.full_version, name, tmp / name)
        if sha256((tmp / name).read_bytes()) != entry.sha256:
            raise CorruptWeights(target.version, None, f"file {name} of v{target.full_version} fails its checksum")


def verify(wstore: WeightStore, version: int) -> Manifest:
    """Rebuild ``version`` from its full version and check every tensor and file; its manifest if all is well."""
    with tempfile.TemporaryDirectory(prefix="sluiceway-verify-") as tmp:
        materialize(wstore, version, None, Path(tmp) / "out")
    return wstore.manifest(version)
