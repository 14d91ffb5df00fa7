"""slime.rollout.sample_hooks: --rollout-sample-hook-path, run on each generated sample before its reward
(slime's slime/rollout/sample_hooks.py).

A hook is `hook(args, sample, **kwargs)`, sync or async, given only the keyword arguments it names (all of them when it
takes **kwargs): `evaluation` and `rollout_id`. It returns a Sample (which replaces the one passed) or None.
"""

from __future__ import annotations

import inspect
from typing import Any

from slime.utils.misc import load_function
from slime.utils.types import Sample

# The rollout id hooks get by default: module state as in slime, whose driver sets it (no handle reaches the hooks).
# sluiceway refuses --rollout-sample-hook-path, so nothing here sets it; a plugin may call set_current_rollout_id.
_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """The rollout id hooks receive as `rollout_id` unless the caller passes one."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


def _accepted_kwargs(function, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


async def _apply_to_sample(args, sample: Sample, paths: list[str], **kwargs) -> Sample:
    for path in paths:
        hook = load_function(path)
        result = hook(args, sample, **_accepted_kwargs(hook, kwargs))
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            continue
        if not isinstance(result, Sample):
            raise TypeError(f"Rollout sample hook {path!r} returned {type(result).__name__}, expected Sample or None.")
        sample = result
    return sample


async def apply_rollout_sample_hooks(args, value, **kwargs):
    """Run args.rollout_sample_hook_path's hooks, in order, on every Sample in `value` (a Sample or nested lists
    of them), keeping its shape."""
    paths = getattr(args, "rollout_sample_hook_path", None) or []
    if not paths:
        return value
    kwargs.setdefault("rollout_id", _current_rollout_id)
    if isinstance(value, Sample):
        return await _apply_to_sample(args, value, paths, **kwargs)
    if isinstance(value, list):
        return [await apply_rollout_sample_hooks(args, item, **kwargs) for item in value]
    raise TypeError(f"Rollout sample hooks expected Sample or list, got {type(value).__name__}.")
