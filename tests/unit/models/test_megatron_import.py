"""models/megatron_import.py: megatron imported without torch's compiler stack, its fused functions unchanged."""

from __future__ import annotations

import subprocess
import sys

import torch

from sluiceway.models.megatron_import import megatron_import


def test_the_trainer_imports_megatron_without_loading_torchs_compiler():
    probe = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "import sluiceway.tasks.train.trainer\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "assert torch.compile is real, 'torch.compile left patched'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_function_wrapped_during_the_import_is_compiled_at_its_first_call():
    def gelu_plus(x, y):
        return torch.nn.functional.gelu(x) + y

    real = torch.compile
    with megatron_import():
        assert torch.compile is not real
        wrapped = torch.compile(gelu_plus, backend="eager")  # megatron's form: jit_fuser(fn)
        with_options = torch.compile(backend="eager")(gelu_plus)  # and @torch.compile(...) with options
    assert torch.compile is real
    assert wrapped.__name__ == "gelu_plus" and wrapped.__wrapped__ is gelu_plus
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for fn in (wrapped, with_options):
        assert torch.equal(fn(x, y), gelu_plus(x, y))
        assert torch.equal(fn(x, y), gelu_plus(x, y))  # the compiled function, kept after the first call
    assert "torch._dynamo" in sys.modules  # compiling happened, at the call


def test_modules_are_compiled_as_they_are():
    layer = torch.nn.Linear(3, 2)
    with megatron_import():
        compiled = torch.compile(layer, backend="eager")
    assert isinstance(compiled, torch.nn.Module) and compiled(torch.ones(1, 3)).shape == (1, 2)
