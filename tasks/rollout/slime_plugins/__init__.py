"""Plugins written for slime (THUDM/slime), run here unchanged (issue 41).

slime's plugins import slime's own names (`from slime.utils.types import Sample`, `from slime.utils.http_utils import
post`, `from slime.rollout.sglang_rollout import GenerateState`, ...). `names/slime/` is a small package of those
names, importable as `slime.*` once `provide_slime_names()` has put `names/` at the END of sys.path: a real slime
installation, found earlier on the path, always wins, and ours only fills in where there is none.

`names/` is never imported as part of sluiceway (its `__init__.py` refuses): code that hands objects to plugins calls
`provide_slime_names()` and then imports `slime.utils.types` etc. itself, so a plugin and sluiceway share one `Sample`
class (isinstance and `is` hold). The interface mirrored is slime's at commit 624b824a.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

NAMES_DIR = Path(__file__).resolve().parent / "names"
OUR_SLIME = NAMES_DIR / "slime"


def provide_slime_names() -> str:
    """Make `import slime` resolve, and say to what: "slime" (a real installation) or "sluiceway" (names/slime).

    Appends names/ to the end of sys.path unless it is there already; idempotent."""
    entry = str(NAMES_DIR)
    if entry not in sys.path:
        sys.path.append(entry)
        importlib.invalidate_caches()
    return "sluiceway" if is_ours(importlib.import_module("slime")) else "slime"


def is_ours(module) -> bool:
    """Whether `module` (a `slime` package) is names/slime rather than a real slime."""
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve().parent == OUR_SLIME
