"""slime.utils.misc: load_function, SingletonMeta and the small helpers plugins use (slime's slime/utils/misc.py).

Not here (process and cluster helpers, not plugin interface): exec_command, get_current_node_ip, get_free_port,
should_run_periodic_action, chunk_named_params_by_size.
"""

from __future__ import annotations

import base64
import importlib
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from typing import Any

import torch


def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> torch.Tensor | None:
    """The first of `keys` present in `meta_info` as a flat int32 tensor; None when none is (or it is None).

    A str is base64 of little-endian int32s (slime decodes with pybase64; the bytes are the same), bytes-like is
    the raw buffer, anything else (tensor, array, list) is converted. slime's slime/utils/misc.py:13-35.
    """
    for key in (keys,) if isinstance(keys, str) else keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, bytes | bytearray | memoryview):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    if torch.is_tensor(value):
        return value.detach().to(device="cpu", dtype=torch.int32).reshape(-1)
    if getattr(getattr(value, "flags", None), "writeable", True) is False:
        value = value.copy()  # a read-only numpy array: torch would warn on sharing it
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)


@cache
def load_function(path):
    """The attribute `attr` of module `module.path` named by the dotted "module.path.attr" (a function or a class);
    cached per path string, as slime's (slime/utils/misc.py:38-47). Only the dotted form: "file.py:fn" is not
    understood (sluiceway's own flags take that form, through infra/plugins.py)."""
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


class SingletonMeta(type):
    """One instance per class: the first call's arguments build it, later calls return it whatever they pass.
    `cls.clear_instances()` forgets it. slime's slime/utils/misc.py:50-64."""

    _instances: dict = {}

    def __call__(cls, *args, **kwargs):
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls):
        cls._instances = {}


class Box:
    """A read-only holder of one object (`.inner`). slime's slime/utils/misc.py."""

    def __init__(self, inner):
        self._inner = inner

    @property
    def inner(self):
        return self._inner


def group_by(iterable, key=None) -> dict:
    """{key(item): [items...]} in first-seen order, without sorting first. slime's slime/utils/misc.py."""
    groups = defaultdict(list)
    for item in iterable:
        groups[item if key is None else key(item)].append(item)
    return dict(groups)
