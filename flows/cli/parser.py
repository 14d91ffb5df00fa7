"""What the config-taking commands share: a parser that reports mistakes in one line, a flag per config field
grouped by config part, the config resolved from the YAML and the flags, slime's flags taken on the way."""

from __future__ import annotations

import argparse
import re
import types
import typing
from typing import Literal, get_args, get_origin

from sluiceway.flows import slime
from sluiceway.flows.config import RunConfig, build_config, flag, load_yaml
from sluiceway.infra.errors import UserError

PARTS = tuple(RunConfig.model_fields)  # resources, data, rollout, ...: the config's parts, each a help group
USAGE = "%(prog)s [CONFIG.yaml] [--flag value ...]"  # the flags are listed below it, not spelled out in it
SLIME_HELP = (
    "slime's flags that are not fields are accepted too: `sluiceway run --help-slime` lists them (docs/slime.md)."
)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No prefix matching: slime's --normalize-advantages would silently be --normalize-advantages-by-std.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # argparse would print usage and the message
        raise UserError(f"{self.prog}: {message}")


_ABBREVIATION = re.compile(r"(?:\b(?:e\.g|i\.e|etc|vs|cf)|\d)\.$")


def first_sentence(text: str | None) -> str | None:
    """A field's description up to its first full stop: --help stays short, docs/configuration.md has the rest."""
    if not text:
        return text
    for m in re.finditer(r"\.(?:\s|$)", text):
        head = text[: m.start() + 1]
        if not _ABBREVIATION.search(head):
            return head
    return text


def add_field_arguments(
    parser: argparse.ArgumentParser, listed: tuple[str, ...] = PARTS, source_options: bool = True
) -> None:
    """A flag per config field, in a help group per part; the parts not `listed` are accepted but not shown, and
    without `source_options` neither are the options of one prompt source (json_schema_extra source_option)."""
    for part, info in RunConfig.model_fields.items():
        section = parser.add_argument_group(part)
        for name, f in info.annotation.model_fields.items():
            ann = f.annotation
            inner = [a for a in get_args(ann) if a is not type(None)] if isinstance(ann, types.UnionType) else [ann]
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            unlisted = extra.get("slime_hook") or (extra.get("source_option") and not source_options)
            shown = first_sentence(f.description) if part in listed and not unlisted else argparse.SUPPRESS
            kwargs: dict = {"dest": f"{part}.{name}", "default": argparse.SUPPRESS, "help": shown}
            if inner == [bool]:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif get_origin(inner[0]) is list:
                kwargs["nargs"] = "+"
                kwargs["metavar"] = get_args(inner[0])[0].__name__.upper()
            elif get_origin(inner[0]) is Literal:
                kwargs["choices"] = list(get_args(inner[0]))
            else:
                kwargs["metavar"] = inner[0].__name__.upper()  # pydantic converts and checks the value
            section.add_argument(flag(name), **kwargs)


def add_config_command(sub, name: str, help_: str, hidden: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A command that takes a run config: the YAML, a flag per field (the `hidden` parts' unlisted: the command
    does not use them), and slime's flags (accepted, listed by `sluiceway run --help-slime`)."""
    epilog = SLIME_HELP
    if hidden:
        epilog = (f"The flags of the parts {name} does not use ({', '.join(hidden)}) and of verifiers: and "
                  "openenv: sources are accepted, not listed (`sluiceway config --help` lists every flag). "
                  + epilog)  # fmt: skip
    p = sub.add_parser(name, help=help_, usage=USAGE, epilog=epilog)
    p.add_argument("config_file", nargs="?", help="YAML run config (flags override it)")
    add_field_arguments(p, tuple(part for part in PARTS if part not in hidden), source_options=not hidden)
    slime.add_arguments(p)
    return p


def add_slime_script_flag(parser: argparse.ArgumentParser) -> None:
    # read by slime.splice_slime_script before parsing; declared here for --help and so that argparse accepts it
    parser.add_argument(
        "--from-slime-script",
        metavar="SCRIPT.sh",
        help="take the flags of a slime launch script (its *_ARGS arrays, the model files it sources, its "
        "train.py line), print how each is treated, then run; flags after it override the script's",
    )


# A command's own defaults, which the YAML and the flags override: replay corrects for its stored behaviour
# policy with truncated importance sampling (flows/replay.py says why).
COMMAND_DEFAULTS = {"replay": {("algorithm", "use_tis"): True}}


def resolve_config(args: argparse.Namespace) -> RunConfig:
    base = load_yaml(args.config_file) if args.config_file else {}
    overrides = {tuple(k.split(".", 1)): v for k, v in vars(args).items() if "." in k}
    command = getattr(args, "command", "run")
    for (part, field), value in COMMAND_DEFAULTS.get(command, {}).items():
        in_yaml = isinstance(base.get(part), dict) and field in base[part]
        if (part, field) not in overrides and not in_yaml:
            overrides[(part, field)] = value
    checked = command if command in ("replay", "eval", "plan") else "run"  # whose invariants apply
    return build_config(base, overrides, source=args.config_file or "flags", command=checked)


def configured(args: argparse.Namespace) -> RunConfig:
    """The run config of a config-taking command: slime's flags taken off `args` (the mapped ones as overrides),
    the YAML and the flags resolved, slime's architecture flags checked before anything expensive."""
    given = slime.take(args)
    if args.command == "sft":
        vars(args).setdefault("algorithm.loss_type", "sft_loss")  # what makes the config an SFT one
    cfg = resolve_config(args)
    slime.check_architecture(given, cfg.training.hf_checkpoint)
    slime.report(given, cfg)
    return cfg
