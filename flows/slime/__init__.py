"""slime's room: what sluiceway does with the flags of slime's launch scripts that are not config fields.

    treatments.py   the five treatments (implemented, mapped, not applicable, refused, architecture), `Flag`
    architecture.py the Megatron architecture flags, checked against the HF checkpoint's config.json
    flag_table.py   every other slime flag and its treatment (`SLIME_FLAGS`)
    translate.py    a parsed slime command line onto config overrides (`take`), its checks and log lines
    script.py       the reader of a slime launch script (`--from-slime-script`)
    docs.py         docs/slime.md (`python -m sluiceway.flows.slime.docs > docs/slime.md`)

The CLI imports this room; this room imports the config, never the CLI.
"""

from sluiceway.flows.slime.flag_table import SLIME_FLAGS
from sluiceway.flows.slime.script import read_slime_script, splice_slime_script
from sluiceway.flows.slime.translate import (
    Given,
    add_arguments,
    add_help_flag,
    check_architecture,
    classify,
    describe,
    report,
    take,
)
from sluiceway.flows.slime.treatments import ARCHITECTURE, IMPLEMENTED, MAPPED, NOT_APPLICABLE, REFUSED

__all__ = [
    "ARCHITECTURE", "IMPLEMENTED", "MAPPED", "NOT_APPLICABLE", "REFUSED", "SLIME_FLAGS", "Given", "add_arguments",
    "add_help_flag", "check_architecture", "classify", "describe", "read_slime_script", "report",
    "splice_slime_script", "take",
]  # fmt: skip
