"""Choosing a scorer: a built-in by --rm-type, or the user's function by --custom-rm-path."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from sluiceway.flows.errors import UserError
from sluiceway.tasks.reward.math_answer import exact_reward, math_reward

# A scorer takes (response_text, label, sample) and returns a float or (float, details dict).
Scorer = Callable[..., float | tuple[float, dict]]

BUILTIN: dict[str, Callable[[str, str], tuple[float, dict]]] = {"math": math_reward, "exact": exact_reward}


def load_custom(path: str) -> Scorer:
    """'pkg.module:fn' or 'path/to/file.py:fn'."""
    target, sep, fn_name = path.rpartition(":")
    if not sep or not target or not fn_name:
        raise UserError(f"--custom-rm-path {path}: expected 'module:function' or 'file.py:function'")
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            raise UserError(f"--custom-rm-path {path}: file {file} not found")
        spec = importlib.util.spec_from_file_location(f"sluiceway_custom_rm_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"--custom-rm-path {path}: cannot import {target} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"--custom-rm-path {path}: {target} has no function '{fn_name}'")
    return fn


def get_scorer(rm_type: str, custom_rm_path: str | None) -> Callable[[str, str, dict], tuple[float, dict]]:
    if custom_rm_path:
        fn = load_custom(custom_rm_path)

        def custom(response: str, label: str, sample: dict) -> tuple[float, dict]:
            out = fn(response, label, sample)
            return (float(out[0]), dict(out[1])) if isinstance(out, tuple) else (float(out), {})

        return custom
    if rm_type not in BUILTIN:
        raise UserError(f"--rm-type {rm_type}: unknown (built-in: {', '.join(BUILTIN)}; or use --custom-rm-path)")
    builtin = BUILTIN[rm_type]
    return lambda response, label, sample: builtin(response, label)
