"""Reading a run config: a YAML file, merged with the command line's flags, checked for a command; a validation
error as one line that names each bad field and its flag."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from sluiceway.flows.config.run import RunConfig
from sluiceway.infra.errors import UserError


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """One line naming each bad field and what was expected."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "model_type":  # a group given as a scalar or a list
            msg = f"expected a mapping of its fields, got {type(e['input']).__name__}"
        elif e["type"].endswith("_type"):  # say what was given: a list or a mapping where a number goes, say
            msg += f", got {type(e['input']).__name__}"
        if len(e["loc"]) == 2 and e["type"] != "extra_forbidden":  # a group field: also name its flag
            loc += f" (--{str(e['loc'][1]).replace('_', '-')})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(parts) > 3:  # a list of a million wrong items is still a short line
        parts[3:] = [f"and {len(parts) - 3} more"]
    return f"{source}: " + "; ".join(parts)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise UserError(f"{p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise UserError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:  # an empty file: the defaults (a falsy [], 0 or false is a mistake, below)
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of config groups at the top level")
    return data


def build_config(
    base: dict, overrides: dict[tuple[str, str], object], source: str = "config", command: str = "run"
) -> RunConfig:
    """Merge CLI overrides (group, field) -> value into a YAML dict and validate, for `command`.

    The YAML's values and the flags' are each validated on their own first, so an error names where the bad
    value came from, and a wrong-typed YAML value is an error even when a flag overrides it (the file is
    still wrong, for the next command that reads it without that flag)."""
    flags: dict[str, dict] = {}
    for (group, field), value in overrides.items():
        flags.setdefault(group, {})[field] = value
    for values, where in ((base, source), (flags, "flags")):
        try:
            RunConfig.model_validate(values, context={"fields_only": True})
        except ValidationError as e:
            raise UserError(format_validation_error(e, where)) from None
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for (group, field), value in overrides.items():
        merged.setdefault(group, {})
        if not isinstance(merged[group], dict):
            raise UserError(f"{source}: '{group}' must be a mapping")
        merged[group][field] = value
    try:
        return RunConfig.model_validate(merged, context={"command": command})
    except ValidationError as e:
        raise UserError(format_validation_error(e, source)) from None


def flag(field: str) -> str:
    """A config field's command-line flag (`rollout_batch_size` -> `--rollout-batch-size`: slime's names)."""
    return "--" + field.replace("_", "-")


def field_flags() -> dict[str, tuple[str, str]]:
    """flag -> (part, field) for every field of every config part (the CLI's flags; slime's room reads them too)."""
    flags: dict[str, tuple[str, str]] = {}
    for part, info in RunConfig.model_fields.items():
        for name in info.annotation.model_fields:
            f = flag(name)
            assert f not in flags, f"config field {name} is defined in two parts"
            flags[f] = (part, name)
    return flags
