"""Which precision a run computes in when it asks for `auto`: bf16 where this device does it natively and fast.

bf16 halves the bytes of every weight, activation and published weight version, and on CPUs with AVX-512 BF16
or AMX its matrix products run 2-4x faster than fp32. On a CPU with only AVX2 the same products are emulated:
measured here under torch's and oneDNN's AVX2 code paths, 2.8 GFLOP/s in bf16 against 204 in fp32 (2 threads),
so a bf16 run there would spend minutes on what fp32 does in seconds. CPU flags alone do not tell: the
`ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` variables (or a torch build without the kernels) change what runs
without changing /proc/cpuinfo. So on CPU the choice comes from a short measurement, the way
`models/engine/packed_linear.available` probes its ops: one transformer layer's training and decode work at
SmolLM2's widths in each dtype (not one matrix product: that said 3.9x where whole steps ran 1.2-1.3x faster,
issue 31), cached per machine (CPU, torch version, those variables, thread count) under the sluiceway cache.
bf16 must win by MIN_SPEEDUP; that it learns as fp32 does is docs/benchmarks.md's learning benchmark, and that
the engine and the trainer agree in it is tests/unit/train/test_bf16_agreement.py.

On CUDA: bf16 where the device supports it (compute capability 8.0 and newer), else fp32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sluiceway.infra.cache import cache_root

log = logging.getLogger("sluiceway")

PRECISIONS = ("auto", "bf16", "fp32")
# bf16 is chosen where the whole step is clearly faster in it. The step is modelled from the probe's two roles by
# their shares of an fp32 step: the demo's (examples/demo_smollm2.yaml) fp32 step on the AMX Xeon spent 7.6 s
# training and 4.3 s in rollout, so 0.65 / 0.35. Measured there (issue 51): probe training 1.9-2.8x, decode
# 0.6-0.8x -> modelled step 1.22-1.31x, real demo steps 1.2-1.35x faster in bf16; with AMX turned off 0.72x. The
# margin is small because bf16 no longer costs learning: with stochastic rounding of the masters (the default) it
# learns about as fp32 does (docs/benchmarks.md, "bf16 against fp32": held-out reward 0.303 against 0.317 over six
# seeds, the engine-trainer gap 0); it keeps a step that is faster only within the probe's noise in fp32.
STEP_SHARES = (0.65, 0.35)  # training, decode
MIN_SPEEDUP = 1.1
# One training-sized product this many times slower in bf16 than in fp32 means bf16 is emulated (AVX2-only:
# ~50x); the rest of the probe, seconds there, is then not run.
EMULATED = 5.0
# Environment variables that change which CPU kernels torch and oneDNN run (part of the cache key).
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_PROBE_VERSION = 3  # 2: a layer's training and decode work, not one product; 3: by role, row blocks where they run


@dataclass(frozen=True)
class Choice:
    precision: str  # "bf16" or "fp32"
    reason: str  # one line: why

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"


@dataclass(frozen=True)
class CpuProbe:
    fp32_gflops: float  # the whole step's work (training and decode together)
    bf16_gflops: float
    threads: int
    train_speedup: float = 0.0  # bf16's rate over fp32's for each role alone (0: not measured)
    decode_speedup: float = 0.0

    @property
    def speedup(self) -> float:
        """How much faster a whole step runs in bf16 than in fp32 (above 1: bf16 is faster): the roles' speedups
        by their shares of an fp32 step (STEP_SHARES); a probe without roles, its rates' ratio."""
        if self.train_speedup > 0 and self.decode_speedup > 0:
            (train, decode) = STEP_SHARES
            return 1.0 / (train / self.train_speedup + decode / self.decode_speedup)
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops > 0 else 0.0

    def roles(self) -> str:
        """'training 3.1x, decode 1.4x' (bf16 over fp32 by role), or '' for a probe that did not measure them."""
        if not (self.train_speedup and self.decode_speedup):
            return ""
        return f"training {self.train_speedup:.2f}x, decode {self.decode_speedup:.2f}x"


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, str | None, set[str]]:
    """(model name, cpu family, flags) of the first CPU in /proc/cpuinfo; the platform's name elsewhere."""
    try:
        text = Path(path).read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", None, set()
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    return name, fields.get("cpu family"), set(fields.get("flags", "").split())


def cpu_description() -> str:
    """The CPU model and the flags that decide bf16 speed, e.g. 'AMD EPYC (avx2 avx512f avx512_bf16)'."""
    model, _, flags = read_cpuinfo()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert")
    present = [f for f in wanted if f in flags] or ["no avx2"]
    limits = [f"{k}={os.environ[k]}" for k in ISA_VARIABLES if os.environ.get(k)]
    return f"{model} ({' '.join(present)})" + (f" limited by {' '.join(limits)}" if limits else "")


def _cache_file(threads: int) -> Path:
    import torch

    env = {k: os.environ.get(k, "") for k in ISA_VARIABLES}
    key = json.dumps([_PROBE_VERSION, cpu_description(), torch.__version__, env, threads], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "precision" / f"cpu-{digest}.json"


# The probe's workload: one transformer layer at SmolLM2's widths, as a run spends its time there.
_H, _FF, _HEADS, _KV, _HD = 576, 1536, 9, 3, 64
_TRAIN_ROWS, _TRAIN_T, _DECODE_ROWS, _DECODE_SPAN = 8, 64, 16, 64


def _layer_workload(dtype, weights, grad: bool, rows: int, t: int, span: int):
    """One layer's forward (and backward with `grad`): RMSNorm, q/k/v, attention over `span` keys with an fp32
    softmax, output projection, RMSNorm, SwiGLU MLP. In bf16 the weights are cast from fp32 masters first (the
    trainer's cost on every step), and where this CPU's products vary with their rows (AMX) they run in the row
    blocks the engine and the trainer then use (models/batch_invariant.py)."""
    import torch
    import torch.nn.functional as F

    from sluiceway.models.batch_invariant import RowBlockLinear, rows_vary

    linear = RowBlockLinear.apply if dtype != torch.float32 and rows_vary(dtype) else F.linear
    ws = [w.to(dtype) for w in weights] if dtype != torch.float32 else weights
    qkv, o, gate_up, down = ws
    x = torch.randn(rows, t, _H, dtype=dtype, requires_grad=grad)
    h = F.rms_norm(x, (_H,), None, 1e-5)
    q, k, v = linear(h, qkv).split([_HEADS * _HD, _KV * _HD, _KV * _HD], dim=-1)
    q = q.view(rows, t, _KV, _HEADS // _KV * _HD).transpose(1, 2).reshape(rows, _KV, -1, _HD)
    k, v = (z.view(rows, t, _KV, _HD).transpose(1, 2) for z in (k, v))
    if span > t:  # a decode step: the new key joins `span - t` cached ones
        k, v = (torch.cat([z.new_ones(rows, _KV, span - t, _HD), z], dim=2) for z in (k, v))
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float() * _HD**-0.5, dim=-1)
    att = torch.matmul(probs.to(dtype), v).reshape(rows, _KV, _HEADS // _KV, t, _HD).permute(0, 3, 1, 2, 4)
    x = x + linear(att.reshape(rows, t, _HEADS * _HD), o)
    g, u = linear(F.rms_norm(x, (_H,), None, 1e-5), gate_up).chunk(2, dim=-1)
    out = x + linear(F.silu(g) * u, down)
    if grad:
        out.float().sum().backward()


def _layer_flops(grad: bool, rows: int, t: int, span: int) -> float:
    matmul = 2 * rows * t * (_H * (_HEADS + 2 * _KV) * _HD + _HEADS * _HD * _H + 3 * _H * _FF)
    attention = 4 * rows * t * span * _HEADS * _HD
    return (matmul + attention) * (3 if grad else 1)


def _rates(threads: int, budget_s: float = 0.6) -> tuple[float, float, float, float]:
    """fp32 and bf16 GFLOP/s of what a step does, at one layer of SmolLM2's widths: a training micro-batch's
    forward and backward (8 rows x 64 tokens) plus a decode step's forward (16 rows, 64 keys), softmax, norms,
    activations and bf16's cast of the fp32 masters included; then bf16's speedup for each role alone. A single
    matrix product said 3.9x where whole steps ran 1.2-1.3x faster in bf16 (issue 31): what does not speed up
    counts here. The dtypes alternate and each keeps its best time, so a load from other processes falls on both.
    Where bf16 is emulated (a few percent of fp32's rate) one decode step in each dtype says so, and the training
    work, seconds there in bf16, is not run."""
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = [((_HEADS + 2 * _KV) * _HD, _H), (_H, _HEADS * _HD), (2 * _FF, _H), (_H, _FF)]
    weights = [torch.randn(*s, generator=g) * 0.02 for s in shapes]

    def train(dtype) -> None:
        _layer_workload(dtype, [w.requires_grad_(True) for w in weights], True, _TRAIN_ROWS, _TRAIN_T, _TRAIN_T)

    def decode(dtype) -> None:
        with torch.inference_mode():
            _layer_workload(dtype, [w.detach() for w in weights], False, _DECODE_ROWS, 1, _DECODE_SPAN)

    dtypes = [torch.float32, torch.bfloat16]
    x, w = torch.randn(_TRAIN_T, _H, generator=g), weights[0]
    xb, wb = x.bfloat16(), w.bfloat16()
    product = [_best_time(lambda: x @ w.t(), 3), _best_time(lambda: xb @ wb.t(), 3)]
    if product[1] > EMULATED * product[0]:
        rate = 2 * _TRAIN_T * _H * weights[0].size(0) / 1e9
        return rate / product[0], rate / product[1], product[0] / product[1], product[0] / product[1]
    best = {(role, d): float("inf") for role in (train, decode) for d in dtypes}
    for d in dtypes:
        train(d), decode(d)  # first calls: kernel selection and packing, not timed
    spent = 0.0
    for _ in range(20):
        for role, d in best:
            t0 = time.perf_counter()
            role(d)
            dt = time.perf_counter() - t0
            best[role, d], spent = min(best[role, d], dt), spent + dt
        if spent > budget_s:
            break
    f32, b16 = torch.float32, torch.bfloat16
    flops = _layer_flops(True, _TRAIN_ROWS, _TRAIN_T, _TRAIN_T) + _layer_flops(False, _DECODE_ROWS, 1, _DECODE_SPAN)
    fp32_s, bf16_s = best[train, f32] + best[decode, f32], best[train, b16] + best[decode, b16]
    return (flops / 1e9 / fp32_s, flops / 1e9 / bf16_s,
            best[train, f32] / best[train, b16], best[decode, f32] / best[decode, b16])  # fmt: skip


def _best_time(fn, repeats: int) -> float:
    fn()  # kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_cpu(refresh: bool = False) -> CpuProbe:
    """bf16 and fp32 matrix-product rates on this CPU at torch's thread count, cached per machine."""
    import torch

    threads = torch.get_num_threads()
    path = _cache_file(threads)
    if not refresh:
        try:
            return CpuProbe(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    fp32, bf16, train, decode = _rates(threads)
    probe = CpuProbe(fp32, bf16, threads, train, decode)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(probe)))
        tmp.replace(path)  # atomic: two runs probing at once never read half a file
    except OSError:
        pass  # a read-only cache costs a probe per run, nothing else
    return probe


def choose(requested: str, device: str = "cpu") -> Choice:
    """The precision for a run that asked for `requested` ('auto', 'bf16' or 'fp32') on `device`."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {requested!r}")
    if requested != "auto":
        return Choice(requested, "asked for")
    if device == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return Choice("bf16", f"auto: {torch.cuda.get_device_name()} computes bf16 natively")
        return Choice("fp32", "auto: this CUDA device has no native bf16")
    p = probe_cpu()
    rates = f"{p.bf16_gflops:.1f} vs {p.fp32_gflops:.1f} GFLOP/s, {p.threads} threads"
    if p.roles():
        rates += f"; by role {p.roles()}, weighted {STEP_SHARES[0]:.2f}/{STEP_SHARES[1]:.2f}"
    if p.speedup >= MIN_SPEEDUP:
        return Choice(
            "bf16",
            f"auto: a step's training and decode work runs {p.speedup:.2f}x as fast in bf16 as in fp32 here ({rates}) "
            f"on {cpu_description()}; bf16 for the trainer and the engines, which give a token the same log-prob "
            "(learning against fp32: docs/benchmarks.md)",
        )
    return Choice(
        "fp32",
        f"auto: a step's training and decode work runs only {p.speedup:.2f}x as fast in bf16 as in fp32 here ({rates}) "
        f"on {cpu_description()}, under the {MIN_SPEEDUP}x that bf16 must win by; fp32 for the trainer and the engines",
    )
