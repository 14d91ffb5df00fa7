"""Loading a user's function named on the command line as 'pkg.module:fn' or 'path/to/file.py:fn'."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from sluiceway.infra.errors import UserError


def load_function(path: str, flag: str) -> Callable:
    """The callable at `path`; `flag` names the option in error messages (one line, no traceback)."""
    target, sep, name = path.rpartition(":")
    if not sep or not target or not name:
        if not sep and "." in path:  # slime's form: its functions take slime's (args, Sample, ...) (docs/slime.md)
            raise UserError(f"{flag} {path}: a slime-style dotted path; sluiceway loads 'module:function' written "
                            "for its own interface (slime's functions take slime's Sample: docs/slime.md)")  # fmt: skip
        raise UserError(f"{flag} {path}: expected 'module:function' or 'file.py:function'")
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            raise UserError(f"{flag} {path}: file {file} not found")
        spec = importlib.util.spec_from_file_location(f"sluiceway_user_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"{flag} {path}: cannot import {target} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{flag} {path}: {target} has no function '{name}'")
    return fn


def check_function(path: str, flag: str, params: tuple[str, ...]) -> None:
    """Import the function at `path` and check it takes the positional `params`; raises ValueError with one line
    (what a config validator raises, so a mistake is reported when the config is read, not mid-run)."""
    import inspect

    try:
        fn = load_function(path, flag)
    except UserError as e:
        raise ValueError(str(e).removeprefix(f"{flag} ")) from None
    try:
        inspect.signature(fn).bind(*[None] * len(params))
    except TypeError:
        raise ValueError(f"{path} must take ({', '.join(params)})") from None
    except ValueError:
        pass  # a builtin without a signature to check
