"""Custom multi-turn generation's errors, and the calculator tool of examples/ (two turns through a real engine:
tests/integration/test_multiturn_engine.py)."""

import importlib.util

import pytest
from paths import DATA, ROOT

from sluiceway.infra.errors import UserError
from sluiceway.tasks.rollout.multiturn import load_custom_generate


def test_custom_generate_path_errors_are_one_line():
    with pytest.raises(UserError, match="not found"):
        load_custom_generate("nope.py:generate")
    with pytest.raises(UserError, match="must be an async function"):
        load_custom_generate(f"{DATA / 'noise_rewards.py'}:vowel_share")


@pytest.fixture(scope="module")
def calculator():
    spec = importlib.util.spec_from_file_location("calculator_tool", ROOT / "examples" / "calculator_tool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("expr,want", [("3*4", "12"), ("(2+3)*-2", "-10"), ("7/2", "3.5"), ("1/0", "error")])
def test_calculator_evaluates_arithmetic(calculator, expr, want):
    assert calculator.calculate(expr).startswith(want)


@pytest.mark.parametrize(
    "expr", ["__import__('os').system('true')", "open('/etc/passwd')", "2**999999", "x+1", "9" * 300]
)
def test_calculator_refuses_anything_else(calculator, expr):
    assert calculator.calculate(expr).startswith("error")
