"""Render the configuration reference (docs/configuration.md) from the config models themselves.

python -m sluiceway.flows.config_docs > docs/configuration.md
"""

from __future__ import annotations

from pydantic_core import PydanticUndefined

from sluiceway.flows.config import RunConfig
from sluiceway.flows.slime.docs import render_table


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "(required)"
    return "`null`" if field.default is None else f"`{field.default}`"


def render_markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `flows/config/` by `python -m sluiceway.flows.config_docs`; do not edit by hand.",
        "",
        "A run config is YAML with one mapping per group; every field is also a command-line flag",
        "(`rollout_batch_size` -> `--rollout-batch-size`, booleans as `--flag` / `--no-flag`). Flags override",
        "the YAML. Names follow slime's arguments where slime has one.",
        "",
    ]
    for group, info in RunConfig.model_fields.items():
        model = info.annotation
        lines += [f"## `{group}`", "", "| flag | default | meaning |", "| --- | --- | --- |"]
        for name, f in model.model_fields.items():
            desc = (f.description or "").replace("|", "\\|")
            lines.append(f"| `--{name.replace('_', '-')}` | {_default(f)} | {desc} |")
        lines.append("")
    lines += [
        "## slime's other flags",
        "",
        "Flags of slime's launch scripts that are not fields: implemented, mapped onto a field, not applicable",
        "on this device (logged once), or model architecture checked against `--hf-checkpoint`'s config.json",
        "(docs/slime.md; `--from-slime-script FILE` reads a script's flags).",
        "",
        *render_table(),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
