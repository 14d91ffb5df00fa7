"""benchmarks/bench_doc.py: every section written to docs/benchmarks.md names the machine it was measured on."""

from __future__ import annotations

import sys

from paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_doc  # noqa: E402

CPUINFO = """processor\t: 0
model name\t: Some CPU 9000
cpu family\t: 25
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
model name\t: Some CPU 9000
"""


def test_machine_line_names_cpu_flags_and_isa_overrides(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    line = bench_doc.machine_line(str(info))
    assert line.startswith("Some CPU 9000 (family 25), ")
    assert "avx2 avx512f avx512_bf16, no amx_tile amx_bf16" in line
    assert "ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA unset" in line
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "ATEN_CPU_CAPABILITY=avx2 (emulating a narrower CPU)" in bench_doc.machine_line(str(info))
    assert "CPU flags unknown" in bench_doc.machine_line(str(tmp_path / "missing"))


def test_write_section_puts_the_machine_under_the_heading(tmp_path):
    doc = tmp_path / "benchmarks.md"
    bench_doc.write_section("## A\n\nfigures\n", "## A", doc, machine="box 1")
    bench_doc.write_section("## B\n\nother\n", "## B", doc, machine="box 2")
    bench_doc.write_section("## A\n\nnew figures\n", "## A", doc, machine="box 3")  # replaced in place
    text = doc.read_text()
    assert "## A\n\nMachine: box 3.\n\nnew figures\n\n## B\n\nMachine: box 2.\n\nother\n" in text
    assert "box 1" not in text and text.count("Machine:") == 2
