"""Which calling convention a custom function speaks, told from its signature, and loading it by either path form.

Three flags take a function that may be written for slime or for sluiceway:

| hook | slime's | sluiceway's |
| --- | --- | --- |
| --custom-generate-function-path | `(args, sample, sampling_params[, evaluation])` | `(ctx, prompt, params)` |
| --custom-rm-path | `(args, sample)` | `(response, label, sample)` |
| --custom-rm-path with --group-rm | `(args, samples)` | `(responses, labels, samples)` |
| --dynamic-sampling-filter-path | `(args, group)` | `(rows)` |

A generate function takes three positional arguments either way, so its parameter names (or annotations) tell:
slime's start `args, sample` (or have `evaluation`, or annotate a `Sample`), ours `ctx, prompt` (or annotate a
`GenerateContext`). The others differ in how many positional arguments they take; where both counts bind
(`def score(response, label, sample=None)`) the names tell again: slime's first is `args` (its second a `sample`,
`samples` or `group`), ours `response`/`responses`/`rows` (or a second `label`). Where nothing tells (`*args`,
other names) the run's `plugin_convention` must say; without it the run stops with one line
naming the function and both signatures, before anything starts: a guess would call the function with the wrong
arguments mid-rollout. An explicit `plugin_convention` (slime or sluiceway) decides for every function.

Paths: sluiceway's `module:fn` / `file.py:fn`, or slime's dotted `module.attr`, resolved as slime's `load_function`
does (importlib, then getattr), with the current directory importable and the launch script's directory in front
(slime's scripts put it on PYTHONPATH; `--from-slime-script` does the same, flows/slime/script.py). slime's names
are provided (`import slime` resolves) before any plugin is imported, since a slime plugin imports them at its top.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

from sluiceway.infra.errors import UserError
from sluiceway.infra.plugins import load_function as load_ours
from sluiceway.tasks.rollout.slime_plugins import provide_slime_names

SLIME, SLUICEWAY, AUTO = "slime", "sluiceway", "auto"
GENERATE, RM, GROUP_RM, FILTER = "generate", "rm", "group_rm", "filter"

# hook -> (slime's signature, sluiceway's signature), as the error line shows them
SIGNATURES = {
    GENERATE: ("(args, sample, sampling_params[, evaluation])", "(ctx, prompt, params)"),
    RM: ("(args, sample)", "(response, label, sample)"),
    GROUP_RM: ("(args, samples)", "(responses, labels, samples)"),
    FILTER: ("(args, group)", "(rows)"),
}
# positional arguments each convention passes (the generate's are told by name instead)
_ARITY = {RM: (2, 3), GROUP_RM: (2, 3), FILTER: (2, 1)}


def load_plugin(path: str, flag: str) -> Callable:
    """The function at `path` ('module:fn', 'file.py:fn' or slime's dotted 'module.attr'); one UserError line if
    it cannot be imported."""
    provide_slime_names()
    if ":" in path:
        return load_ours(path, flag)
    module_path, _, attr = path.rpartition(".")
    if not module_path or not attr:
        raise UserError(f"{flag} {path}: expected 'module:function', 'file.py:function' or slime's 'module.function'")
    _importable_dirs()
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise UserError(
            f"{flag} {path}: cannot import {module_path} ({e}); the current directory and "
            "--from-slime-script's directory are importable, or set PYTHONPATH as slime's scripts "
            "do"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{flag} {path}: {module_path} has no function '{attr}'")
    return fn


def _importable_dirs() -> None:
    """The current directory, as `python train.py` has it first on sys.path in slime."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()


def convention_of(fn: Callable, hook: str, setting: str = AUTO, name: str | None = None) -> str:
    """SLIME or SLUICEWAY for `fn` used as `hook`; `setting` (plugin_convention) decides when not auto. Raises
    one UserError line naming the function and both signatures when its signature cannot tell."""
    if setting in (SLIME, SLUICEWAY):
        return setting
    told = _tell_generate(fn) if hook == GENERATE else _tell_arity(fn, *_ARITY[hook])
    if told is not None:
        return told
    slime_sig, our_sig = SIGNATURES[hook]
    shown = name or getattr(fn, "__qualname__", repr(fn))
    raise UserError(f"{shown}{_sig(fn)}: cannot tell whether it is slime's {slime_sig} or sluiceway's {our_sig}; "
                    "set --plugin-convention slime or --plugin-convention sluiceway")  # fmt: skip


def _sig(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _positional(fn: Callable) -> list[inspect.Parameter] | None:
    """The positional parameters, or None when the signature cannot tell (*args, or no signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _annotation_name(p: inspect.Parameter) -> str:
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else getattr(a, "__name__", str(a))


def _tell_generate(fn: Callable) -> str | None:
    params = _positional(fn)
    if params is None or len(params) < 3:
        return None
    names = [p.name for p in params]
    try:
        has_evaluation = "evaluation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        has_evaluation = False
    slime = names[:2] == ["args", "sample"] or has_evaluation or _annotation_name(params[1]).endswith("Sample")
    ours = names[0] == "ctx" or names[1] == "prompt" or _annotation_name(params[0]).endswith("GenerateContext")
    if slime != ours:
        return SLIME if slime else SLUICEWAY
    return None


def _binds(fn: Callable, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*[None] * n)
    except TypeError:
        return False
    return True


def _tell_arity(fn: Callable, slime_n: int, our_n: int) -> str | None:
    params = _positional(fn)
    if params is None:
        return None
    slime, ours = _binds(fn, slime_n), _binds(fn, our_n)
    if slime != ours:
        return SLIME if slime else SLUICEWAY
    return _tell_by_names(params) if slime else None


# Where both counts bind (`def score(response, label, sample=None)`, as our own docs wrote a reward), the names tell:
# slime passes `args` first and a Sample (or a group of them) second; sluiceway a response (or rows) first and a
# label second.
_SLIME_FIRST, _SLIME_SECOND = {"args"}, {"sample", "samples", "group"}
_OUR_FIRST, _OUR_SECOND = {"response", "responses", "rows", "text", "completion"}, {"label", "labels"}


def _tell_by_names(params: list[inspect.Parameter]) -> str | None:
    names = [p.name for p in params] + ["", ""]
    slime = names[0] in _SLIME_FIRST or names[1] in _SLIME_SECOND or _annotation_name(params[0]) == "Namespace"
    ours = names[0] in _OUR_FIRST or names[1] in _OUR_SECOND
    if slime != ours:
        return SLIME if slime else SLUICEWAY
    return None
