"""The command line's help (issue 33): `run --help` lists sluiceway's own flags grouped by config part and fits in
450 lines; slime's flags are accepted but listed only by `run --help-slime`; `eval --help` has no architecture flag;
the package starts as the `sluiceway` script and as `python -m sluiceway.flows.cli`, its signal handlers first."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from sluiceway.flows import cli, slime
from sluiceway.flows.cli.parser import PARTS
from sluiceway.flows.slime.architecture import ARCH_FLAGS


def help_of(argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width: count lines at a fixed one
    with pytest.raises(SystemExit) as stop:
        cli.make_parser().parse_args(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


def lists(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_run_help_is_short_grouped_and_says_where_slimes_flags_are(monkeypatch, capsys):
    out = help_of(["run", "--help"], monkeypatch, capsys)
    assert len(out.splitlines()) <= 450
    for part in PARTS:
        if part != "replay":  # run does not use the replay part: accepted, not listed
            assert f"\n{part}:\n" in out, part
    assert "\nreplay:\n" not in out
    assert not any(lists(out, f) for f in slime.SLIME_FLAGS), "slime's flags belong to --help-slime"
    last_paragraph = out.strip().split("\n\n")[-1]  # the epilog, wrapped to the width
    assert "sluiceway run --help-slime" in " ".join(last_paragraph.split())


def test_eval_help_has_no_architecture_flags(monkeypatch, capsys):
    out = help_of(["eval", "--help"], monkeypatch, capsys)
    assert not [f for f in ARCH_FLAGS if lists(out, f)]
    assert not lists(out, "--num-experts") and "--moe-" not in out
    assert "\nalgorithm:\n" not in out and "\neval:\n" in out


def test_help_slime_lists_every_slime_flag(monkeypatch, capsys):
    out = help_of(["run", "--help-slime"], monkeypatch, capsys)
    assert [f for f in slime.SLIME_FLAGS if not lists(out, f)] == []
    assert lists(out, "--num-experts") and "[architecture, checked against config.json]" in out


@pytest.mark.parametrize("command", ["run", "sft", "replay", "eval", "config", "plan"])
def test_slime_flags_are_still_accepted(command):
    args = cli.make_parser().parse_args([command, "--num-experts", "8", "--colocate", "--save", "d"])
    given = slime.take(args)
    assert given.flags == {"--num-experts": "8", "--colocate": True, "--save": "d"}
    assert vars(args)["storage.output_dir"] == "d"


def test_a_hidden_part_is_still_accepted():
    args = cli.make_parser().parse_args(["eval", "--eps-clip", "0.3", "--replay-run-id", "r"])
    assert vars(args)["algorithm.eps_clip"] == "0.3"  # pydantic converts it
    assert vars(args)["replay.replay_run_id"] == "r"


def test_config_accepts_a_slime_flag_end_to_end(capsys):
    words = ["--prompt-data", "env:arithmetic", "--n-samples-per-prompt", "8", "--colocate", "--save", "out/x"]
    assert cli.main(["config", *words]) == 0
    assert "output_dir: out/x" in capsys.readouterr().out


# The handlers are installed by the package's __init__ before its slow imports, for both ways of starting.
_EARLY = """
import sys
sys.argv[:] = [sys.argv[1], "run"]
import signal
import sluiceway.infra.proc as proc
seen = []
real = proc.exit_on_signals
proc.exit_on_signals = lambda argv: (seen.append(("sluiceway.flows.config" in sys.modules, argv)), real(argv))
import sluiceway.flows.cli
print(seen == [(False, ["run"])], signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
"""


@pytest.mark.parametrize("argv0", ["-m", "/usr/local/bin/sluiceway"])
def test_signal_handlers_come_before_the_slow_imports(argv0):
    out = subprocess.run([sys.executable, "-c", _EARLY, argv0], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_python_m_runs_the_package():
    out = subprocess.run([sys.executable, "-m", "sluiceway.flows.cli", "models"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and "tiny-llama" in out.stdout, out.stderr


def test_the_slime_room_does_not_import_the_cli():
    import ast
    from pathlib import Path

    room = Path(slime.__file__).parent
    for path in room.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("sluiceway.flows.cli")], path.name
