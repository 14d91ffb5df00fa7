"""How sluiceway treats each of slime's flags that is not a config field: the five treatments and the record of one
flag (flows/slime/flag_table.py lists them all; docs/slime.md explains each treatment).

- implemented: slime's meaning holds here (a value that would mean something sluiceway does not do is one error
  line, never silently dropped);
- mapped: rewritten onto a sluiceway field (`--save DIR` is `--output-dir DIR`);
- not applicable: a setting of how GPU kernels, collectives or placement run, which does not change results here;
  accepted and reported once in the run's log;
- refused: a setting that changes results and is not implemented here: one error line saying so (none of
  slime's `scripts/run-qwen3-4B.sh`-style RL scripts needs one; see docs/slime.md);
- architecture: a Megatron model-architecture flag, checked against `--hf-checkpoint`'s config.json before
  anything starts: agreeing is accepted, a contradiction is one line naming both values.

The model is always built from the HF checkpoint's config.json; architecture flags never change it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # the THUDM/slime commit the table was checked against

IMPLEMENTED, MAPPED, NOT_APPLICABLE, ARCHITECTURE = "implemented", "mapped", "not applicable", "architecture"
REFUSED = "refused"  # changes results in a way sluiceway does not implement: one error line saying so


@dataclass(frozen=True)
class Flag:
    kind: str
    note: str  # what it means here (the --help text and docs/slime.md)
    nargs: int | str = 1  # 0: a switch
    # implemented / mapped: value(s) -> {(group, field): value} overrides, or raises UserError
    apply: Callable[[Any], dict[tuple[str, str], Any]] | None = None
    # architecture: (hf config dict, value) -> (agrees, what the checkpoint says)
    check: Callable[[dict, Any], tuple[bool, str]] | None = None
