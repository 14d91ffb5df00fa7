"""The slime script reader evaluates only bounded arithmetic and expansions (issue 30 item 6): numbers within 64
bits, expansions, words and the time of a read limited, and every failure one `UserError` naming the file and line.

The reproductions ran for ever (`$((9**9**9))`), took gigabytes (`$(seq 1 100000000000)`) or escaped as a Python
exception (`$((1/0))`). Those that could hang or eat the machine's memory again run in a child process with a
timeout and a 1 GiB address space: a regression stuck in one C call (Python's big-integer power holds the GIL)
is out of reach of pytest-timeout, whose signal and thread methods both wait for the GIL (tried: the old reader
ran past 120 s under `timeout(20, method="thread")`).
"""

import re
import resource
import shutil
import subprocess
import sys

import pytest

from sluiceway.flows.slime import script as slime_script
from sluiceway.flows.slime.script import read_slime_script
from sluiceway.infra.errors import UserError


def script(tmp_path, text: str, name: str = "run.sh"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _bounded() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def bounded_run(args: list[str], **kw) -> subprocess.CompletedProcess:
    """A child process of at most 15 s and 1 GiB, its output as text."""
    return subprocess.run(args, capture_output=True, text=True, timeout=15, preexec_fn=_bounded, **kw)


READ = """import sys
from sluiceway.flows.slime.script import read_slime_script
from sluiceway.infra.errors import UserError
try:
    read_slime_script(sys.argv[1], env={})
except UserError as e:
    print(e)
"""


def refused_in_child(path) -> str:
    """What `read_slime_script(path)` raised, read in a bounded child process."""
    proc = bounded_run([sys.executable, "-c", READ, str(path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1, proc.stdout
    return proc.stdout.strip()


def refused(path, match: str) -> str:
    with pytest.raises(UserError, match=match) as e:
        read_slime_script(path, env={})
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.timeout(20)
def test_a_huge_power_is_refused_before_it_is_computed(tmp_path):
    path = script(tmp_path, "N=4\nARGS=(\n  --seed $((9**9**9))\n)\n")
    msg = refused_in_child(path)
    assert msg.startswith(f"{path}:2: $((9**9**9)): 9 ** 387420489 is beyond 64-bit integers"), msg
    refused(path, r"beyond 64-bit integers")  # and in this process, now that it is known to end


@pytest.mark.timeout(20)
def test_a_huge_seq_is_refused_before_it_is_made(tmp_path):
    path = script(tmp_path, "ARGS=(--seed $(seq 1 100000000000))\n")
    msg = refused_in_child(path)
    assert msg.startswith(f"{path}:1: $(seq 1 100000000000) makes 100000000000 numbers, more than the 100000"), msg
    refused(path, r"100000000000 numbers")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("expr", ["1/0", "5 % (2-2)"])
def test_division_by_zero_names_file_and_line(tmp_path, expr):
    path = script(tmp_path, f"# a comment\nN=3\nARGS=(--seed $(({expr})))\n")
    assert refused(path, "division by zero") == f"{path}:3: $(({expr})): division by zero"


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "line, needle",
    [("$((9**9**9))", "9 ** 387420489 is beyond 64-bit integers"),
     ("$(seq 1 100000000000)", "makes 100000000000 numbers"),
     ("$((1/0))", "$((1/0)): division by zero")],
)  # fmt: skip
def test_the_cli_prints_one_line_and_exits_2(tmp_path, line, needle):
    path = script(tmp_path, f"MODEL_ARGS=(--num-layers 2)\nARGS=(\n  --seed {line}\n)\n")
    proc = bounded_run([sys.executable, "-m", "sluiceway.flows.cli", "run", "--from-slime-script", str(path)],
                       cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {path}:2: ") and needle in lines[0]


# -- arithmetic as bash does it ------------------------------------------------------------------------------

# (expression, what bash 5.2 prints): unary minus binds tighter than ** and ** is right-associative, / truncates
# toward zero and % takes the dividend's sign (Python's // and % floor), a leading 0 is octal and 0x hexadecimal,
# an unset or empty variable is 0 and a variable's value is an expression of its own.
BASH = [
    ("-2**2", 4), ("2**3**2", 512), ("-7/2", -3), ("-7%2", -1), ("7%-2", 1), ("010", 8), ("0x1F", 31),
    ("", 0), ("- - 3", 3), ("+-3", -3), ("2**62", 4611686018427387904), ("0**0", 1), ("(-1)**(2**62)", 1),
    ("9223372036854775807", 9223372036854775807), ("-9223372036854775808", -9223372036854775808),
    ("-9223372036854775807-1", -9223372036854775808), ("-9223372036854775808%-1", 0), ("(-2)**63", -(2**63)),
    ("N*2", 10), ("UNSET+1", 1), ("EMPTY+1", 1), ("((((1+2))))*3", 9), ("  12 / 5 ", 2),
]  # fmt: skip
VARS = 'N="2+3"\nEMPTY=\n'


@pytest.mark.parametrize("expr, value", BASH)
def test_arithmetic_is_bashs(tmp_path, expr, value):
    path = script(tmp_path, f"{VARS}ARGS=(--x $(({expr})))\n")
    assert read_slime_script(path, env={}).argv == ["--x", str(value)]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_the_table_is_what_bash_prints():
    for expr, value in BASH:
        out = subprocess.run(["bash", "-c", f"{VARS}echo $(({expr}))"], capture_output=True, text=True, timeout=10)
        assert out.stdout.strip() == str(value), expr


# Where bash wraps around silently (it prints $((2**63)) as -9223372036854775808 and $((9**9**9)) as
# -2123029214124047543) the reader refuses: a flag value that wrapped is a mistake, better named than passed on.
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "expr, why",
    [("2**63", "2 ** 63 is beyond 64-bit"), ("9223372036854775807+1", "9223372036854775807 + 1 is beyond"),
     ("-9223372036854775808/-1", "-9223372036854775808 / -1 is beyond"), ("3*9223372036854775807", "beyond"),
     ("99999999999999999999", "beyond 64-bit"), ("-(-9223372036854775807-1)", "beyond 64-bit"),
     ("2**-1", "exponent less than 0"), ("08", "value too great for base"), ("2**2**2**2**2**2", "beyond 64-bit"),
     ("(" * 40 + "1" + ")" * 40, "parentheses nested more than 32 deep"), ("2**" * 4000 + "2", "longer than")],
)  # fmt: skip
def test_what_bash_wraps_or_refuses_is_refused(tmp_path, expr, why):
    path = script(tmp_path, f"ARGS=(\n  --seed $(({expr}))\n)\n")
    msg = refused_in_child(path)  # a tower of powers is what hung the old reader
    assert msg.startswith(f"{path}:1: $((") and why in msg, msg


@pytest.mark.parametrize("expr", ["1 +", "1<<2", "2 ? 3 : 4", "(1", "1)+(2", "10#12", "x y"])
def test_arithmetic_this_reader_does_not_do_is_one_line(tmp_path, expr):
    path = script(tmp_path, f"A=1\nARGS=(--x $(({expr})))\n")
    refused(path, rf"^{re.escape(str(path))}:2: ")


def test_an_unused_assignment_it_cannot_evaluate_is_still_tolerated_but_not_a_fault(tmp_path):
    """As before, a variable set by code the reader does not run is an error only where it is used; a division
    by zero or an overflow stops the read where it is, as it stops bash."""
    assert read_slime_script(script(tmp_path, "X=$((1<<2))\nARGS=(--a)\n"), env={}).argv == ["--a"]
    refused(script(tmp_path, "X=$((1/0))\nARGS=(--a)\n"), r"run.sh:1: \$\(\(1/0\)\): division by zero")
    refused(script(tmp_path, "X=$((2**64))\nARGS=(--a)\n"), r"run.sh:1: .*beyond 64-bit")


# -- sizes and time -----------------------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_seq_limits(tmp_path):
    argv = read_slime_script(script(tmp_path, "ARGS=($(seq 5 -2 1) $(seq 3))\n"), env={}).argv
    assert argv == "5 3 1 1 2 3".split()
    refused(script(tmp_path, "ARGS=($(seq 1 0 5))\n"), r"run.sh:1: \$\(seq 1 0 5\): an increment of 0")
    refused(script(tmp_path, "ARGS=($(seq 1 99999999999999999999999))\n"), "a number beyond 64 bits")
    refused(script(tmp_path, "ARGS=($(seq 1 100000))\n"), "makes an expansion longer than 200000 characters")


@pytest.mark.timeout(20)
def test_a_value_doubled_line_after_line_is_stopped(tmp_path):
    path = script(tmp_path, "A=xxxxxxxxxx\n" + "A=$A$A\n" * 40 + "ARGS=($A)\n")
    msg = refused_in_child(path)  # the old reader went on doubling, to 10 TB at line 41
    assert msg == f"{path}:16: $A makes an expansion longer than 200000 characters"


@pytest.mark.timeout(20)
def test_an_array_doubled_line_after_line_is_stopped(tmp_path):
    path = script(tmp_path, "A=(x y)\n" + "A=(${A[@]} ${A[@]})\n" * 40)
    msg = refused_in_child(path)
    assert msg == f"{path}:17: more than 100000 words in one array or command line"


@pytest.mark.timeout(20)
def test_the_whole_read_has_budgets(tmp_path, monkeypatch):
    words = "A=(" + "x " * 20000 + ")\n" + "".join(f"B{i}=(${{A[@]}})\n" for i in range(60))
    refused(script(tmp_path, words), r"run.sh:51: the script's arrays and command line come to more than 1000000")
    monkeypatch.setattr(slime_script, "MAX_TOTAL_CHARS", 50_000)
    chars = "A=" + "x" * 20_000 + "\n" + "".join(f"B{i}=$A\n" for i in range(5))
    refused(script(tmp_path, chars), r"run.sh:3: the script's expansions come to more than 50000 characters")


def test_the_time_of_a_read_is_limited(tmp_path, monkeypatch):
    monkeypatch.setattr(slime_script, "TIME_LIMIT_S", -1.0)  # spent before the read starts
    refused(script(tmp_path, "ARGS=(--a)\n"), r"run.sh:1: reading the script took more than -1 s")


def test_nesting_and_sourcing_are_limited(tmp_path):
    deep = "${X:-" * 40 + "a" + "}" * 40
    refused(script(tmp_path, f"ARGS=({deep})\n"), r"run.sh:1: expansions nested more than 32 deep")
    ok = "${X:-" * 20 + "a" + "}" * 20
    assert read_slime_script(script(tmp_path, f"ARGS=({ok})\n"), env={}).argv == ["a"]
    script(tmp_path, "source ./b.sh\nB_ARGS=(--b)\n", "a.sh")
    path = script(tmp_path, "ARGS=(--a)\nsource ./a.sh\n", "b.sh")
    refused(path, r"a.sh:1: sources \S*/b.sh, which is being read already")


def test_files_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setattr(slime_script, "MAX_SCRIPT_BYTES", 100)
    refused(script(tmp_path, "# " + "x" * 200 + "\n"), r"run.sh: larger than 100 bytes")
    (tmp_path / "latin1.sh").write_bytes(b"# caf\xe9\nARGS=(--a)\n")  # not UTF-8: read, the byte replaced
    assert read_slime_script(tmp_path / "latin1.sh", env={}).argv == ["--a"]
    (tmp_path / "dir.sh").mkdir()
    refused(script(tmp_path, "source ./dir.sh\n"), r"run.sh:1: sources './dir.sh', which is not a file")


def test_an_unexpected_failure_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(slime_script, "_seq", boom)
    path = script(tmp_path, "N=1\nARGS=(\n  --a $(seq 3)\n)\n")
    assert refused(path, "boom") == f"{path}:2: this line could not be read (RuntimeError: boom)"
