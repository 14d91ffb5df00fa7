"""Importing megatron-core: quietly, and without paying for torch's compiler at import.

megatron-core decorates about 40 fused functions with `torch.compile` when its modules are imported
(megatron/core/jit.py `jit_fuser`). Wrapping a function compiles nothing, but the wraps import torch's compiler
stack (dynamo, inductor's compile_fx, functorch) and read its config, for functions the CPU path never calls
(models/megatron_gpt.py turns the fusions on only on GPUs where compiling works). While megatron is imported
here, `torch.compile(fn)` returns a wrapper that calls the real `torch.compile(fn, ...)` on its first call:
compiling happens at first call either way, so what runs is unchanged. A process that trains still imports dynamo
when it builds its first optimizer (torch.optim's `_disable_dynamo`), but not inductor: measured on the 2-core AMD
EPYC, importing the trainer and building an AdamW takes 4.1 s instead of 5.2 (three alternating runs each), and
a process that imports megatron without training (`sluiceway eval`'s) saves about 2 s.

Import megatron through `megatron_import()` in modules that import it at load time (models/megatron_attention.py
first, so any later import finds it loaded).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile`'s calling forms (`compile(fn, **kw)` and `compile(**kw)(fn)`), compiling at first call."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...): the function comes next
            return lambda fn: compile_later(fn, **kwargs)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return real(model, **kwargs)  # modules are compiled as they are (megatron wraps functions only)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    return compile_later


@contextmanager
def megatron_import() -> Iterator[None]:
    """The block that imports megatron: its Apex / Transformer Engine warnings (the expected CPU setup) hidden,
    and `torch.compile` deferred to first call while its modules decorate their functions."""
    real = torch.compile
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed", category=UserWarning)
        torch.compile = _deferred_compile(real)
        try:
            yield
        finally:
            torch.compile = real


def _tp_group_or_default(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    """megatron's `get_tensor_model_parallel_group_if_none` without its deprecation warning (same groups returned)."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def traceable_linear_layers() -> None:
    """Let torch.compile trace megatron's parallel linear layers whole.

    megatron 0.16's RowParallelLinear calls its linear function with no `tp_group`, which then looks the group up
    through `get_tensor_model_parallel_group_if_none` and calls `warnings.warn` on rank 0: a graph break dynamo
    cannot trace, twice in every linear, so a compiled transformer layer fell into ~9 graphs (measured on
    tiny-llama: 9 graphs a layer before, 1 after). The lookup in `tensor_parallel.layers` is replaced by the same
    lookup without the warning; idempotent, and only called where layers are compiled (models/megatron_gpt.py).
    """
    from megatron.core.tensor_parallel import layers

    layers.get_tensor_model_parallel_group_if_none = _tp_group_or_default
