"""Precision `auto` in a fresh process under torch's and oneDNN's AVX2 code paths: fp32 where bf16 is emulated."""

import os
import subprocess
import sys

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_auto_is_fp32_where_bf16_is_emulated(tmp_path):
    """Under torch's and oneDNN's AVX2 code paths (an AVX2-only CPU, or one made to act as such) bf16 matrix
    products are emulated: auto must not pick bf16 there."""
    code = "from sluiceway.models.precision import choose; c = choose('auto'); print(c.precision); print(c.reason)"
    env = dict(os.environ) | AVX2_ONLY | {"SLUICEWAY_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    chosen, reason = out.splitlines()
    print(reason)
    assert chosen == "fp32", reason
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in reason
