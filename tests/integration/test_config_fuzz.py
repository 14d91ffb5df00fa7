"""A bounded, seeded fuzz of what a user hands `sluiceway run`: flag values, YAML config files, prompt files.

Every input generated here is wrong in a way the checks before anything starts must catch (flows/config/'s
validation, flows/preflight.py's file and length checks), so each must end `main` with exit 2 and one stderr line
"error: ..." and no traceback. `main` runs in process (about 10 ms an input); getting past the preflight to
configure_logging, the first step of a started run, fails the case, and no child process may appear.
"""

from __future__ import annotations

import json
import os
import random
import types
from datetime import datetime
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from annotated_types import Ge, Gt, Le, Lt

import sluiceway.flows.run as flows_run
from sluiceway.flows.cli import main
from sluiceway.flows.config import RunConfig

SEED = 20
GOOD_PROMPTS = '{"input": "1+1?", "label": "2"}\n{"input": "2+2?", "label": "4"}\n'
BASE = [
    "run", "--prompt-data", "data.jsonl", "--output-dir", "run", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "4", "--num-rollout", "1",
]  # fmt: skip


def _fields() -> list[tuple[str, str, object, list, bool]]:
    """(group, field, base type, bounds, optional) of every config field."""
    out = []
    for group, info in RunConfig.model_fields.items():
        for name, f in info.annotation.model_fields.items():
            ann = f.annotation
            args = [a for a in get_args(ann) if a is not type(None)] if isinstance(ann, types.UnionType) else [ann]
            out.append((group, name, args[0], f.metadata, isinstance(ann, types.UnionType)))
    return out


def _out_of_range(kind, bounds) -> list[str]:
    """Numbers just outside a field's bounds."""
    step = 1 if kind is int else 0.5
    out = []
    for b in bounds:
        if isinstance(b, Ge):
            out.append(b.ge - step)
        elif isinstance(b, Gt):
            out.append(b.gt)
        elif isinstance(b, Le):
            out.append(b.le + step)
        elif isinstance(b, Lt):
            out.append(b.lt)
    return [str(kind(v)) for v in out]


def flag_cases(rng: random.Random, n: int) -> list[tuple[str, list[str], dict]]:
    """A bad value for a random flag: garbage for its type, NaN/inf, a huge number, or just out of its range."""
    garbage = {
        int: ["abc", "1.5", "nan", "inf", "", "9" * 30, "-" + "9" * 30, "0x1f", "1e3", "[4]"],
        float: ["abc", "nan", "NaN", "inf", "-inf", "1e999", "-1e999", "", "1,5", "{}"],
    }
    cases = []
    candidates = [f for f in _fields() if f[2] in (int, float, bool, datetime) or get_origin(f[2]) in (Literal, list)]
    while len(cases) < n:
        group, name, kind, bounds, _ = rng.choice(candidates)
        flag = "--" + name.replace("_", "-")
        if kind in (int, float):
            value = rng.choice(garbage[kind] + _out_of_range(kind, bounds) * 3)
        elif kind is bool:
            value = rng.choice(["maybe", "yes", "1"])  # a BooleanOptionalAction takes no value
        elif kind is datetime:
            value = rng.choice(["yesterday", "2024-13-45", "1e999"])
        elif get_origin(kind) is Literal:
            value = rng.choice(["bogus", "", "CPU", "grpo "])
        elif get_args(kind) == (int,):
            value = rng.choice(["x", "1.5", "9" * 30])
        else:
            continue  # a list of strings takes any strings
        cases.append((f"flag {flag}={value!r}", [f"{flag}={value}"], {}))
    return cases


def _wrong_yaml_value(rng: random.Random, kind, bounds, optional):
    if kind in (int, float):
        bad = ["abc", [1, 2], {"a": 1}, 10**30, -(10**30), float("nan"), float("inf")]
        bad += [kind(v) for v in _out_of_range(kind, bounds)]
        if kind is int:
            bad.append(1.5)
    elif kind is bool:
        bad = ["maybe", [True], {"a": 1}, 2, 0.5]
    elif kind is str:
        bad = [123, [1, 2], {"a": 1}, 1.5, True, "nul\x00byte"]
    elif kind is datetime:
        bad = ["yesterday", [1], {"a": 1}]
    elif get_origin(kind) is Literal:
        bad = ["bogus", ["sync"], 1, {"a": 1}]
    else:  # a list
        bad = ["one string", {"a": 1}, [[1]], 7, list(range(10**5))]
    if not optional:
        bad.append(None)
    return rng.choice(bad)


MALFORMED_YAML = [
    "rollout: [1, 2\n", "rollout:\n  num_rollout: 3\n bad: 1\n", "{training: {lr: 1e-5}\n", "rollout: 'unclosed\n",
    "training:\n\t lr: 1\n", "!!python/object/apply:os.system ['echo hi']\n", "--- \na: 1\n---\nb: 2\n",
    "rollout: &a [*a]\n", "data: {prompt_data: @x}\n", "% not a directive\n",
]  # fmt: skip


def yaml_cases(rng: random.Random, n: int) -> list[tuple[str, list[str], dict]]:
    """A config file with a wrong-typed value (sometimes also set by a valid flag), an unknown key or group, a
    group that is not a mapping, malformed YAML, or binary garbage."""
    fields = _fields()
    groups = list(RunConfig.model_fields)
    cases = []
    kinds = ["typed"] * 4 + ["unknown key", "unknown group", "group not a mapping", "top level", "malformed", "binary"]
    for i in range(n):
        kind = kinds[i % len(kinds)]  # every kind, in turn
        extra: list[str] = []
        if kind == "typed":
            group, name, base, bounds, optional = rng.choice(fields)
            value = _wrong_yaml_value(rng, base, bounds, optional)
            text = json.dumps({group: {name: value}}, allow_nan=True).replace("NaN", ".nan").replace("Infinity", ".inf")
            if base in (int, float) and rng.random() < 0.5:  # a valid flag does not hide the file's mistake
                default = RunConfig.model_fields[group].annotation.model_fields[name].default
                extra = [f"--{name.replace('_', '-')}={default}"] if default is not None else []
            label = f"yaml {group}.{name}: {value!r}{' under a flag' if extra else ''}"
        elif kind == "unknown key":
            group = rng.choice(groups)
            text, label = f"{group}:\n  no_such_setting_{i}: 1\n", f"yaml unknown key in {group}"
        elif kind == "unknown group":
            text, label = f"grup{i}:\n  lr: 1\n", "yaml unknown group"
        elif kind == "group not a mapping":
            group = rng.choice(groups)
            text = f"{group}: {rng.choice(['[1, 2]', '3', 'abc', 'null', 'true'])}\n"
            label = f"yaml {text.strip()}"
        elif kind == "top level":
            text = rng.choice(["- rollout\n- training\n", "42\n", "a string\n", "[]\n", "true\n", "0\n", "false\n"])
            label = f"yaml top level {text.strip()!r}"
        elif kind == "malformed":
            text = rng.choice(MALFORMED_YAML)
            label = f"yaml malformed {text[:20]!r}"
        else:
            text = b"\xff" + rng.randbytes(rng.randint(0, 64))
            label = "yaml binary garbage"
        cases.append((label, ["bad.yaml", *extra], {"bad.yaml": text}))
    return cases


BAD_LINES = [
    '{"input": "3+3?", "label": ', "[1, 2]", "42", '"just a string"', "null", "1e999", "NaN",
    '{"prompt": "3+3?", "label": "6"}', '{"input": "3+3?"}', '{"input": "", "label": "6"}',
    '{"input": 7, "label": "6"}', '{"input": [], "label": "6"}', "{'input': 'single quotes'}",
    '{"input": "3+3?", "label": "6"} trailing',
]  # fmt: skip


def data_cases(rng: random.Random, n: int) -> list[tuple[str, list[str], dict]]:
    """A prompt or eval file with one bad line among good ones, binary garbage, nothing in it, or a bad type."""
    cases = []
    kinds = ["line"] * 3 + ["binary", "empty", "blank", "suffix", "parquet", "odd name"]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        name = "prompts.jsonl"
        if kind == "line":
            lines = GOOD_PROMPTS.splitlines()
            lines.insert(rng.randint(0, len(lines)), rng.choice(BAD_LINES))
            content, label = "\n".join(lines) + "\n", f"bad line {lines!r}"
        elif kind == "binary":
            content, label = GOOD_PROMPTS.encode() + b"\xff" + rng.randbytes(rng.randint(0, 64)), "binary line"
        elif kind == "empty":
            content, label = "", "empty file"
        elif kind == "blank":
            content, label = "\n  \n\n", "blank lines only"
        elif kind == "suffix":
            name, content, label = "prompts.txt", GOOD_PROMPTS, "unsupported suffix"
        elif kind == "parquet":
            name, content, label = "prompts.parquet", rng.randbytes(rng.randint(0, 256)), "garbage parquet"
        else:  # a name with a newline or an escape sequence: still one line
            name, content, label = rng.choice(["a\nb.jsonl", "x\r\n.jsonl", "\x1b[2J.jsonl"]), None, "odd file name"
        if rng.random() < 0.5:
            argv = ["--prompt-data", name]
        else:  # an eval set: checked as the prompt data is
            argv, label = ["--eval-interval", "1", "--eval-prompt-data", name], "eval " + label
        cases.append((label, argv, {name: content}))
    return cases


def length_cases(rng: random.Random, n: int) -> list[tuple[str, list[str], dict]]:
    """Lengths past tiny-llama's 512 positions, and embedded-engine batches whose KV cache no machine holds."""
    cases = []
    for _ in range(n):
        flag, value = rng.choice([
            ("--rollout-max-response-len", rng.randint(300, 10**12)),
            ("--rollout-max-prompt-len", rng.randint(600, 10**12)),
            ("--engine-max-running-requests", rng.randint(10**10, 10**15)),
        ])  # fmt: skip
        cases.append((f"length {flag} {value}", [flag, str(value)], {}))
    return cases


def all_cases() -> list[tuple[str, list[str], dict]]:
    rng = random.Random(SEED)
    return flag_cases(rng, 30) + yaml_cases(rng, 30) + data_cases(rng, 20) + length_cases(rng, 6)


CASES = all_cases()


class Started(BaseException):  # not an Exception: main reports those as faults, one line and exit 1
    """A case got past the preflight: a run would start its engines and Prefect now."""


def _children() -> set[str]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    return {child for t in tasks.iterdir() for child in (t / "children").read_text().split()}


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    """The working directory with a good prompt file, and configure_logging (the first thing a run does after
    its preflight) replaced by a tripwire."""

    def tripwire(cfg):
        raise Started(cfg.storage.output_dir)

    monkeypatch.setattr(flows_run, "configure_logging", tripwire)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(GOOD_PROMPTS)
    return tmp_path


def test_the_base_arguments_get_past_the_preflight(guarded):
    """The tripwire works, and every fuzzed case fails because of its own mistake, not of the base arguments."""
    with pytest.raises(Started):
        main(BASE)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0][:80] for c in CASES])
def test_bad_input_is_one_line_before_anything_starts(guarded, capsys, case):
    label, argv, files = CASES[case]
    for name, content in files.items():
        if content is not None:  # None: a file that does not exist
            (guarded / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = _children()
    # The config file is the positional argument right after the command.
    args = [BASE[0], *argv[:1], *BASE[1:], *argv[1:]] if argv[0].endswith(".yaml") else [*BASE, *argv]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, (label, err)
    assert "Traceback" not in out + err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert _children() <= before  # no engine, router or Prefect server
