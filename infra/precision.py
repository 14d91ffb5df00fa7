"""Which precision a run computes in when it asks for `auto`: bf16 where this device does it natively and fast.

bf16 halves the bytes of every weight, activation and published weight version, and on CPUs with AVX-512 BF16
or AMX its matrix products run 2-4x faster than fp32. On a CPU with only AVX2 the same products are emulated:
measured here under torch's and oneDNN's AVX2 code paths, 2.8 GFLOP/s in bf16 against 204 in fp32 (2 threads),
so a bf16 run there would spend minutes on what fp32 does in seconds. CPU flags alone do not tell: the
`ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` variables (or a torch build without the kernels) change what runs
without changing /proc/cpuinfo. So on CPU the choice comes from a short measurement, the way
`infra/engine/packed_linear.available` probes its ops: one product at a SmolLM2 MLP's shape in each dtype,
cached per machine (CPU, torch version, those variables, thread count) under the sluiceway cache.

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
# bf16 is chosen only when it is clearly faster: a tie is not worth bf16's rounding.
MIN_SPEEDUP = 1.25
# Environment variables that change which CPU kernels torch and oneDNN run (part of the cache key).
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_PROBE_VERSION = 1


@dataclass(frozen=True)
class Choice:
    precision: str  # "bf16" or "fp32"
    reason: str  # one line: why

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"


@dataclass(frozen=True)
class CpuProbe:
    fp32_gflops: float
    bf16_gflops: float
    threads: int

    @property
    def speedup(self) -> float:
        """bf16's rate over fp32's (above 1: bf16 is faster)."""
        return self.bf16_gflops / self.fp32_gflops if self.fp32_gflops > 0 else 0.0


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


def _rates(threads: int, budget_s: float = 0.3) -> tuple[float, float]:
    """fp32 and bf16 GFLOP/s of one [64, 576] x [576, 1536] product (a SmolLM2 MLP's shape at a decode step's
    rows). The two dtypes alternate and each keeps its best time, so a load from other processes falls on both."""
    import torch

    m, k, n = 64, 576, 1536
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    pairs = [(a, b), (a.bfloat16(), b.bfloat16())]
    best = [float("inf")] * 2
    with torch.inference_mode():
        for x, y in pairs:
            torch.mm(x, y)  # first call: kernel selection and packing, not timed
        spent = 0.0
        for _ in range(50):
            for i, (x, y) in enumerate(pairs):
                t0 = time.perf_counter()
                torch.mm(x, y)
                dt = time.perf_counter() - t0
                best[i], spent = min(best[i], dt), spent + dt
            if spent > budget_s:
                break
    flops = 2 * m * k * n / 1e9
    return flops / best[0], flops / best[1]


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
    probe = CpuProbe(*_rates(threads), threads)
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
    if p.speedup >= MIN_SPEEDUP:
        return Choice(
            "bf16", f"auto: bf16 matrix products run {p.speedup:.1f}x fp32's rate here ({rates}) on {cpu_description()}"
        )
    return Choice(
        "fp32",
        f"auto: bf16 matrix products run at {p.speedup:.2f}x fp32's rate here ({rates}; no native bf16) on "
        f"{cpu_description()}",
    )
