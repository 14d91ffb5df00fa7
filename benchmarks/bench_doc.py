"""The one place benchmark scripts write their results: a section of docs/benchmarks.md, replaced in place.

Every section records the machine it was measured on (`machine_line`): CPUs differ between the machines this
project runs on (some have AVX-512 and bf16 instructions, some only AVX2), and the figures depend on it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sluiceway.models.precision import read_cpuinfo

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
_HEADER = "# Benchmarks\n\nMeasured numbers; each section is refreshed by its script and names the machine it ran on.\n"
MACHINE_PREFIX = "Machine: "

# CPU flags that decide which fast paths torch/oneDNN take (bf16 matrix products, weight packing).
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# Set, they make a capable CPU take the code paths of a narrower one (AVX2 only, say).
_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def machine_line(cpuinfo: str = "/proc/cpuinfo") -> str:
    """One line saying what a benchmark ran on: CPU model, cores, the ISA flags that matter, ISA overrides, GPU.

    e.g. "AMD EPYC (family 26), 2 cores; avx2 avx512f avx512_bf16, no amx_tile amx_bf16; ATen CPU capability
    AVX512; ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA unset; torch 2.13.0+cpu; no GPU"
    """
    name, family, flags = read_cpuinfo(cpuinfo)
    cpu = f"{name} (family {family})" if family else name
    total = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    cores = f"{usable} cores" if usable == total else f"{usable} of {total} cores"
    parts = [f"{cpu}, {cores}"]
    if flags:
        have = [f for f in _FLAGS if f in flags]
        missing = [f for f in _FLAGS if f not in flags]
        parts.append(", ".join(([" ".join(have)] if have else []) + (["no " + " ".join(missing)] if missing else [])))
    else:
        parts.append("CPU flags unknown")
    env = [f"{k}={os.environ[k]}" for k in _ISA_ENV if os.environ.get(k)]
    overrides = " ".join(env) + " (emulating a narrower CPU)" if env else f"{', '.join(_ISA_ENV)} unset"
    try:
        import torch
    except ImportError:
        return "; ".join([*parts, overrides])
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    parts += [f"ATen CPU capability {capability}", overrides, f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        parts.append(f"GPU {torch.cuda.get_device_name(0)}" + (f" x{n}" if n > 1 else ""))
    else:
        parts.append("no GPU")
    return "; ".join(parts)


def with_machine(text: str, machine: str) -> str:
    """`text` with a `Machine: ...` line under its heading, unless it has one already."""
    lines = text.split("\n")
    if any(line.startswith(MACHINE_PREFIX) for line in lines):
        return text
    entry = f"{MACHINE_PREFIX}{machine}."
    if lines and lines[0].startswith("#"):
        rest = lines[1:]
        return "\n".join([lines[0], "", entry, *([""] if rest and rest[0] else []), *rest])
    return "\n".join([entry, "", *lines])


def write_section(text: str, section: str, doc_path: Path = DOC, machine: str | None = None) -> None:
    """Replace the section headed `section` (up to the next `## `) with `text`, or append it if absent.

    The section gets a `Machine: ...` line under its heading: `machine_line()` of this process (the one that
    measured), or `machine` when the text is rendered from results stored by an earlier run.
    """
    text = with_machine(text, machine if machine is not None else machine_line())
    doc = doc_path.read_text() if doc_path.exists() else _HEADER
    pattern = re.compile(rf"{re.escape(section)}\n.*?(?=\n## |\Z)", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: text.rstrip("\n") + "\n", doc)
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    doc_path.write_text(doc)
