"""Weight versions on the object store: the delta codec reproduces every bit, corruption is caught and named,
retention keeps what deltas need (the CLI that inspects and repairs a store:
tests/integration/test_weight_deltas_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs
from safetensors.torch import load_file
from weight_helpers import assert_holds, bits, publish_run, small_step, tiny_state

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.codec import decode, encode
from sluiceway.storage.weights.errors import BaseMismatch, CorruptWeights
from sluiceway.storage.weights.materialize import apply_delta, local_version, materialize, verify
from sluiceway.storage.weights.publish import WeightPublisher, sha256
from sluiceway.storage.weights.store import WeightStore

# Bit patterns the codec must carry untouched: NaNs with several payloads (quiet, signalling, negative),
# +-inf, -0.0, the smallest and largest denormals.
SPECIAL = {
    torch.float32: [0x7FC00000, 0x7F800001, 0xFFC00123, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x80000000,
                    0x00000001, 0x807FFFFF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFFF, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F],
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0x7FFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF],
}  # fmt: skip
_UINT = {torch.float32: (torch.int32, np.uint32), torch.bfloat16: (torch.int16, np.uint16),
         torch.float16: (torch.int16, np.uint16)}  # fmt: skip


def with_specials(t: torch.Tensor, where: list[tuple[int, int]]) -> torch.Tensor:
    """``t`` with the given flat positions set to special bit patterns (indices into SPECIAL)."""
    if not where or t.numel() == 0:
        return t
    as_int, np_uint = _UINT[t.dtype]
    flat = t.clone().reshape(-1).view(as_int)
    for pos, which in where:
        pattern = np.array([SPECIAL[t.dtype][which]], np_uint).view(np.dtype(f"i{np.dtype(np_uint).itemsize}"))[0]
        flat[pos % t.numel()] = int(pattern)
    return flat.view(t.dtype).reshape(t.shape)


@hs.composite
def tensor_pairs(draw):
    """(base, new): random weights with special values in both, changed sparsely, densely or not at all."""
    dtype = draw(hs.sampled_from(list(SPECIAL)))
    shape = draw(hs.sampled_from([(0,), (1,), (7,), (33, 5), (64, 64), (3, 4, 50)]))
    g = torch.Generator().manual_seed(draw(hs.integers(0, 2**31 - 1)))
    base = (torch.randn(shape, generator=g) * draw(hs.sampled_from([1e-3, 1.0, 1e4]))).to(dtype)
    specials = hs.lists(hs.tuples(hs.integers(0, 10**6), hs.integers(0, 8)), max_size=12)
    base = with_specials(base, draw(specials))
    mode = draw(hs.sampled_from(["same", "sparse", "dense", "small_lr", "specials_only"]))
    new = base.clone()
    if base.numel() and mode != "same":
        if mode == "sparse":
            mask = torch.rand(shape, generator=g) < draw(hs.sampled_from([0.001, 0.01, 0.1]))
        else:
            mask = torch.ones(shape, dtype=torch.bool)
        scale = {"sparse": 1.0, "dense": 1.0, "small_lr": 1e-3, "specials_only": 0.0}[mode]
        step = (torch.randn(shape, generator=g) * scale).to(dtype)
        new = torch.where(mask, (base.float() + step.float() * base.float().abs()).to(dtype), base)
    new = with_specials(new, draw(specials))
    return base, new


@settings(max_examples=50, deadline=None, database=None)
@given(tensor_pairs())
def test_codec_round_trip_is_bit_exact(pair):
    base, new = pair
    raw_base, raw_new = st.from_torch(base), st.from_torch(new)
    width = st.DTYPE_WIDTH[raw_new.dtype]
    encoding, payload, changed = encode(raw_base.data, raw_new.data, width)
    out = decode(encoding, payload, raw_base.data, raw_new.nbytes, width, version=1, tensor="t")
    assert out == raw_new.data
    diff = np.frombuffer(raw_new.data, np.uint8).reshape(-1, width) != np.frombuffer(raw_base.data, np.uint8).reshape(
        -1, width
    )
    assert changed == int(diff.any(axis=1).sum())
    # And back into torch: the same bit patterns, NaN payloads and -0.0 included.
    assert bits(st.to_torch(st.RawTensor(raw_new.dtype, raw_new.shape, out))) == bits(new)
    # With no base the tensor travels raw, still exactly.
    enc, payload, _ = encode(None, raw_new.data, width)
    assert decode(enc, payload, None, raw_new.nbytes, width, version=1, tensor="t") == raw_new.data


@settings(max_examples=20, deadline=None, database=None)
@given(hs.lists(tensor_pairs(), min_size=1, max_size=3), hs.integers(1, 3))
def test_publish_and_materialize_are_bit_exact(pairs, full_every):
    """Three versions through the store (a chain of deltas or fulls), rebuilt from nothing and from each one."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wstore = WeightStore(ObjectStore.from_uri(str(tmp / "store")), "weights/run")
        pub = WeightPublisher(wstore, full_every=full_every, keep=3, max_delta_ratio=10.0)
        versions = [
            {f"t{i}": b for i, (b, _) in enumerate(pairs)},
            {f"t{i}": n for i, (_, n) in enumerate(pairs)},
            {f"t{i}": n.flip(0) if n.dim() else n for i, (_, n) in enumerate(pairs)},
        ]
        for v, sd in enumerate(versions, start=1):
            pub.publish(v, sd)
        held = None
        for v, sd in enumerate(versions, start=1):
            out = materialize(wstore, v, held, tmp / f"out{v}")
            got, meta = st.read(out / "model.safetensors")
            assert {k: bytes(t.data) for k, t in got.items()} == {k: bits(t) for k, t in sd.items()}
            assert meta["weight_version"] == str(v) and local_version(out) == v
            held = out


def test_store_round_trip(store, tmp_path):
    wstore = WeightStore(store, "weights/r1")
    states = publish_run(wstore, tmp_path, 4, full_every=10, keep=10)
    assert wstore.versions() == [1, 2, 3, 4]
    kinds = [wstore.manifest(v) for v in range(1, 5)]
    assert [m.kind for m in kinds] == ["full", "delta", "delta", "delta"]
    assert [m.base_version for m in kinds] == [None, 1, 2, 3]
    for m in kinds[1:]:
        assert m.data_size * 10 < m.raw_size  # a small step ships a small fraction of the weights
        assert m.tensors["model.norm.weight"].encoding == "same" and m.files == kinds[0].files
    # From nothing (full + 3 deltas), from v1, from v3, and in place over v2.
    assert_holds(materialize(wstore, 4, None, tmp_path / "a"), states[3])
    v1 = materialize(wstore, 1, None, tmp_path / "v1")
    assert_holds(v1, states[0])
    assert_holds(materialize(wstore, 4, v1, tmp_path / "b"), states[3])
    v3 = materialize(wstore, 3, v1, tmp_path / "v3")
    assert_holds(materialize(wstore, 4, v3, tmp_path / "c"), states[3])
    v2 = materialize(wstore, 2, None, tmp_path / "inplace")
    assert materialize(wstore, 4, v2, v2) == v2
    assert_holds(v2, states[3]) and local_version(v2) == 4
    assert verify(wstore, 4).version == 4


def test_full_every_and_retention(tmp_path):
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w")
    pub = WeightPublisher(wstore, full_every=3, keep=2)
    sd, kinds = tiny_state(), []
    for v in range(1, 9):
        kinds.append(pub.publish(v, sd).kind)
        sd = small_step(sd, v)
        # The newest two versions, and all the chain each of them needs, are always there.
        have = set(wstore.versions())
        for kept in sorted(have)[-2:]:
            assert {m.version for m in wstore.chain(kept)} <= have
    assert kinds == ["full", "delta", "delta"] * 2 + ["full", "delta"]
    assert wstore.versions() == [7, 8]
    # v6 (a delta on v5 on v4) kept its chain while it was among the newest two:
    wstore2 = WeightStore(ObjectStore.from_uri(str(tmp_path / "s2")), "w")
    pub2 = WeightPublisher(wstore2, full_every=3, keep=2)
    sd = tiny_state()
    for v in range(1, 7):
        pub2.publish(v, sd)
        sd = small_step(sd, v)
    assert wstore2.versions() == [4, 5, 6]


def test_crashed_upload_is_not_listed_and_is_pruned(tmp_path):
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w")
    pub = WeightPublisher(wstore, full_every=10, keep=1)
    pub.publish(1, tiny_state())
    # A crash after the data went up, before the manifest:
    half = Path(wstore.version_path(2))
    half.mkdir()
    (half / "delta.bin").write_bytes(b"partial")
    assert wstore.versions() == [1] and wstore.latest() == 1
    pub.publish(3, small_step(tiny_state(), 3))
    assert wstore.versions() == [1, 3] and not half.exists()  # v3 is a delta on v1, which stays
    assert wstore.manifest(3).base_version == 1


def test_retry_and_non_increasing_versions(tmp_path):
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w")
    pub = WeightPublisher(wstore)
    sd = tiny_state()
    first = pub.publish(1, sd)
    assert WeightPublisher(wstore).publish(1, sd) == first  # a retried publish after a restart
    with pytest.raises(ValueError, match="v1 is already stored with different tensors"):
        pub.publish(1, small_step(sd, 2))
    pub.publish(2, small_step(sd, 2))
    assert wstore.manifest(2).kind == "delta"


def test_a_big_change_is_stored_full(tmp_path):
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w")
    pub = WeightPublisher(wstore, full_every=10)
    pub.publish(1, tiny_state(0))
    assert pub.publish(2, tiny_state(1)).kind == "full"  # every weight changed: a delta would not be smaller


def test_float_dtype_publishes_fp32_masters_as_bf16(tmp_path):
    """float_dtype="BF16" (a --bf16 run): fp32 weights are published rounded to bf16 as torch rounds them,
    integer tensors as they are; an lr-sized step moves every fp32 element but few bf16 ones."""
    wstore = WeightStore(ObjectStore.from_uri(str(tmp_path / "s")), "w")
    pub = WeightPublisher(wstore, full_every=10, float_dtype="BF16")
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(256, 64, generator=g) * 0.05, "step": torch.tensor(1, dtype=torch.int64)}
    m1 = pub.publish(1, sd)
    assert {k: e.dtype for k, e in m1.tensors.items()} == {"w": "BF16", "step": "I64"}
    out = materialize(wstore, 1, None, tmp_path / "v1")
    assert bits(load_file(out / "model.safetensors")["w"]) == bits(sd["w"].to(torch.bfloat16))
    moved = {"w": sd["w"] + 1e-6 * torch.sign(torch.randn(256, 64, generator=g)), "step": sd["step"]}
    assert (moved["w"] != sd["w"]).float().mean() > 0.99
    m2 = pub.publish(2, moved)
    assert m2.kind == "delta" and m2.tensors["w"].dtype == "BF16"
    assert m2.tensors["w"].changed < 0.05 * moved["w"].numel()
    assert WeightPublisher(wstore).publish(3, moved).tensors["w"].dtype == "F32"  # the default keeps dtypes
    with pytest.raises(ValueError, match="float_dtype"):
        WeightPublisher(wstore, float_dtype="I8")


# -- corruption: each error names the version and the tensor --------------------------------------------------


def _two_versions(store, tmp_path):
    wstore = WeightStore(store, "weights/c")
    states = publish_run(wstore, tmp_path, 2, full_every=10, keep=5)
    v1 = materialize(wstore, 1, None, tmp_path / "held")
    return wstore, states, v1


def _payload_of(manifest, name):
    e = manifest.tensors[name]
    return e.offset, e.length


def test_flipped_byte_is_detected(store, tmp_path):
    wstore, states, held = _two_versions(store, tmp_path)
    m = wstore.manifest(2)
    name = "model.layers.0.mlp.up_proj.weight"
    offset, length = _payload_of(m, name)
    data = bytearray(wstore.read_file(2, "delta.bin"))
    before = (held / "model.safetensors").read_bytes()
    for at in (offset + length // 2, offset + length - 1):
        bad = bytearray(data)
        bad[at] ^= 0x10
        wstore.fs.pipe_file(wstore.version_path(2, "delta.bin"), bytes(bad))
        with pytest.raises(CorruptWeights) as err:
            materialize(wstore, 2, held, held)
        assert err.value.version == 2 and err.value.tensor == name
        assert f"weights v2 tensor '{name}'" in str(err.value)
        assert (held / "model.safetensors").read_bytes() == before and local_version(held) == 1  # old weights kept
    with pytest.raises(CorruptWeights, match=name):
        verify(wstore, 2)


def test_flipped_byte_in_a_full_version_is_detected(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "s"))
    wstore, states, held = _two_versions(store, tmp_path)
    path = Path(wstore.version_path(1, "model.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="weights v1 tensor 'step'"):
        materialize(wstore, 2, None, tmp_path / "x")
    path.write_bytes(bytes(data[:-4]))  # truncated
    with pytest.raises(CorruptWeights, match="weights v1 tensor 'step'.*truncated"):
        materialize(wstore, 1, None, tmp_path / "x")


def test_truncated_delta_is_detected(store, tmp_path):
    wstore, states, held = _two_versions(store, tmp_path)
    m = wstore.manifest(2)
    data = wstore.read_file(2, "delta.bin")
    last = max((e for e in m.tensors.values() if e.length), key=lambda e: e.offset)
    name = next(k for k, e in m.tensors.items() if e is last)
    wstore.fs.pipe_file(wstore.version_path(2, "delta.bin"), data[: last.offset + last.length // 2])
    with pytest.raises(CorruptWeights) as err:
        materialize(wstore, 2, held, tmp_path / "out")
    assert (err.value.version, err.value.tensor) == (2, name)
    assert not (tmp_path / "out").exists()


def test_wrong_base_is_refused_and_falls_back_to_full(store, tmp_path, caplog):
    wstore, states, held = _two_versions(store, tmp_path)
    m = wstore.manifest(2)
    # The receiver claims v1 but one tensor differs (another run, a bad disk):
    tensors, meta = st.read(held / "model.safetensors")
    name = "model.embed_tokens.weight"
    wrong = bytearray(tensors[name].data)
    wrong[0] ^= 0x01
    tensors = {**tensors, name: st.RawTensor(tensors[name].dtype, tensors[name].shape, bytes(wrong))}
    with pytest.raises(BaseMismatch) as err:
        apply_delta({k: (t, None) for k, t in tensors.items()}, m, wstore.read_file(2, "delta.bin"))
    assert (err.value.version, err.value.tensor) == (2, name)
    assert f"weights v2 tensor '{name}'" in str(err.value)
    st.write(held / "model.safetensors", tensors, meta)
    with caplog.at_level("WARNING"):
        out = materialize(wstore, 2, held, tmp_path / "out")
    assert_holds(out, states[1])
    assert any(f"weights v2 tensor '{name}'" in r.message and "falling back to full version v1" in r.message
               for r in caplog.records)  # fmt: skip


def test_raw_tensors_survive_torch_views():
    """from_torch/to_torch are views of the bits, never conversions (NaN payloads would not survive those)."""
    for dtype, patterns in SPECIAL.items():
        t = with_specials(torch.zeros(len(patterns), dtype=dtype), [(i, i) for i in range(len(patterns))])
        raw = st.from_torch(t)
        width = st.DTYPE_WIDTH[raw.dtype]
        ints = [int.from_bytes(raw.data[i * width : (i + 1) * width], "little") for i in range(len(patterns))]
        assert ints == patterns
        assert bits(st.to_torch(raw)) == raw.data
    assert sha256(b"") == sha256(st.from_torch(torch.empty(0)).data)


# -- the CLI ---------------------------------------------------------------------------------------------------


def ckpt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", "ckpt", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120,
    )  # fmt: skip


def test_newest_is_one_read_of_the_hint_and_listing_survives_a_pruned_directory(store, tmp_path, monkeypatch):
    """A pool agent's poll (infra/pool_agent.py) reads latest.json instead of listing every version directory;
    without a readable hint it lists. A directory pruned while the listing globs is listed again."""
    wstore = WeightStore(store, "weights/r-newest")
    publish_run(wstore, tmp_path, 3, full_every=10, keep=10)
    calls: list[str] = []
    for name in ("glob", "ls", "find", "cat_file"):
        real = getattr(wstore.fs, name)
        monkeypatch.setattr(wstore.fs, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    assert wstore.newest() == 3 and calls == ["cat_file"]
    wstore.put_text(wstore.path("latest.json"), "{not json")
    assert wstore.newest() == 3 == wstore.latest()  # the listing decides
    calls.clear()
    real_glob, failures = wstore.fs.glob, [FileNotFoundError("v000001 vanished")]

    def flaky_glob(*a, **k):
        if failures:
            raise failures.pop()
        return real_glob(*a, **k)

    monkeypatch.setattr(wstore.fs, "glob", flaky_glob)
    assert wstore.versions() == [1, 2, 3]
