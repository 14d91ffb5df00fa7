"""Read a slime launch script's flags: its `NAME=( ... )` arrays, the model files it `source`s, and the
`python3 train.py ...` (or `train_async.py`) command line that splices them together.

This is not a shell. It understands what slime's `scripts/` and `examples/` use: simple assignments
(`X=value`, `export X=...`, `X=${X:-default}`), `${VAR}` / `$VAR` / `${VAR:-default}` expansion from the script's
own assignments and the environment, `$((arithmetic))`, `$(seq A B C)`, `SCRIPT_DIR="$(cd ... dirname
"${BASH_SOURCE[0]}" ...)"`, `source FILE`, arrays across lines with comments and line continuations, and
`${NAME[@]}` in the command line. Control flow is not followed: the last assignment of a variable wins (a
variable assigned inside an `if` counts). Anything else a flag needs (a value computed by a loop, a command's
output) is one error line naming the file and line.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from sluiceway.infra.errors import UserError

_UNKNOWN = object()  # a variable the script assigns from something this reader does not evaluate


@dataclass
class SlimeScript:
    path: Path
    argv: list[str]  # the flags of the train.py command line, arrays spliced in, values expanded
    arrays: dict[str, list[str]] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)


class _Reader:
    def __init__(self, env: dict[str, str]):
        self.vars: dict[str, object] = dict(env)
        self.env = env  # a variable the script computes in a way not run here can be given in the environment
        self.arrays: dict[str, list[str]] = {}
        self.sources: list[Path] = []
        self.command: list[str] | None = None

    # -- expansion -----------------------------------------------------------------------------------------
    def expand(self, text: str, where: str) -> str:
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                out.append(text[i : i + 2])
                i += 2
                continue
            if c == "'":  # single quotes: literal
                j = text.find("'", i + 1)
                j = len(text) - 1 if j < 0 else j
                out.append(text[i : j + 1])
                i = j + 1
                continue
            if c != "$":
                out.append(c)
                i += 1
                continue
            if text.startswith("$((", i):
                j = _matching(text, i + 1, "(", ")")
                expr = self.expand(text[i + 3 : j - 1], where)
                expr = re.sub(r"[A-Za-z_][A-Za-z0-9_]*",
                              lambda v: self._value(v.group(), self.vars.get(v.group(), "0"), where), expr)  # fmt: skip
                out.append(str(_arith(expr, where)))
                i = j + 1
                continue
            if text.startswith("$(", i):
                j = _matching(text, i + 1, "(", ")")
                inner = self.expand(text[i + 2 : j], where).strip()
                m = re.fullmatch(r"seq\s+(-?\d+)(?:\s+(-?\d+))?(?:\s+(-?\d+))?", inner)
                if not m:
                    raise UserError(f"{where}: cannot evaluate the command substitution $({inner}) (not a shell)")
                nums = [int(g) for g in m.groups() if g is not None]
                first, step, last = (1, 1, nums[0]) if len(nums) == 1 else (
                    (nums[0], 1, nums[1]) if len(nums) == 2 else tuple(nums))  # fmt: skip
                out.append(" ".join(str(n) for n in range(first, last + (1 if step > 0 else -1), step)))
                i = j + 1
                continue
            if text.startswith("${", i):
                j = _matching(text, i + 1, "{", "}")
                body = text[i + 2 : j]
                i = j + 1
                m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=])(.*))?", body, re.S)
                if not m:
                    raise UserError(f"{where}: cannot expand ${{{body}}} (not a shell)")
                name, op, default = m.groups()
                value = self.vars.get(name)
                if op is not None and (value is None or (op.startswith(":") and value == "")):
                    value = self.expand(default, where)
                    if op.endswith("="):
                        self.vars[name] = value
                out.append(self._value(name, value, where))
                continue
            m = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[i:])
            if m:
                out.append(self._value(m.group(1), self.vars.get(m.group(1)), where))
                i += m.end()
                continue
            out.append(c)
            i += 1
        return "".join(out)

    def _value(self, name: str, value: object, where: str) -> str:
        if value is _UNKNOWN:
            raise UserError(f"{where}: ${name} is computed by shell code this reader does not run; set {name} in "
                            f"the environment or write the value in the script")  # fmt: skip
        return "" if value is None else str(value)

    # -- statements ----------------------------------------------------------------------------------------
    def read(self, path: Path) -> None:
        lines = path.read_text().splitlines()
        script_dir = str(path.parent.resolve())
        i = 0
        while i < len(lines):
            start = i
            line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):  # line continuation
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            where = f"{path}:{start + 1}"
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            m = re.match(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=\((.*)$", stripped)
            if m:  # an array: up to the line whose unquoted ')' closes it
                name, body = m.group(1), m.group(2)
                while not _closes(body):
                    if i >= len(lines):
                        raise UserError(f"{where}: the array {name}=( is never closed")
                    body += "\n" + lines[i]
                    i += 1
                body = body[: _closes(body) - 1]
                self.arrays[name] = self._words(body, where)
                continue
            m = re.match(r"(?:export\s+|local\s+|readonly\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", stripped)
            if m:
                name, raw = m.groups()
                if "BASH_SOURCE" in raw and "dirname" in raw:
                    self.vars[name] = script_dir
                    continue
                try:
                    words = self._words(raw, where)
                    self.vars[name] = " ".join(words)
                except UserError:
                    self.vars[name] = self.env.get(name, _UNKNOWN)
                continue
            m = re.match(r"(?:printf\s+-v|read(?:\s+-\S+)*)\s+([A-Za-z_][A-Za-z0-9_]*)", stripped)
            if m:  # assigned by a command this reader does not run
                self.vars[m.group(1)] = self.env.get(m.group(1), _UNKNOWN)
                continue
            m = re.match(r"(?:source|\.)\s+(.+)$", stripped)
            if m:
                words = self._words(m.group(1), where)
                target = Path(words[0]) if words else Path()
                if not target.is_absolute():
                    target = path.parent / target
                if not target.is_file() and "scripts/models/" in target.as_posix():
                    target = _in_checkout(path, target)  # /root/slime/scripts/models/X.sh: this checkout's
                if not target.is_file():
                    raise UserError(f"{where}: sources {words[0] if words else ''!r}, which is not a file ({target})")
                self.sources.append(target)
                self.read(target)
                continue
            m = re.search(r"(?:^|\s)(?:python3?|torchrun)\s+(?:\S+/)?train(?:_async)?\.py(?:\s+|$)(.*)$", stripped)
            if m:
                self.command = self._words(m.group(1), where)

    def _words(self, body: str, where: str) -> list[str]:
        """Split a shell fragment into words: `${NAME[@]}` splices an array, other `$` forms are expanded."""
        out: list[str] = []
        for line in body.split("\n"):
            line = re.sub(r"(^|\s)#.*$", r"\1", line) if "#" in line else line
            parts = re.split(r"""("?\$\{[A-Za-z_][A-Za-z0-9_]*\[[@*]\]\}"?)""", line)
            for part in parts:
                a = re.fullmatch(r"""("?)\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}\1""", part)
                if a:
                    out.extend(self.arrays.get(a.group(2), []))  # as in bash, an unset array splices nothing
                    continue
                try:
                    out.extend(shlex.split(self.expand(part, where), comments=True))
                except ValueError as e:
                    raise UserError(f"{where}: cannot split {part.strip()!r}: {e}") from None
        return out


def _in_checkout(script: Path, target: Path) -> Path:
    """slime's examples source `/root/slime/scripts/models/X.sh` (slime's container layout): the same file in
    the slime checkout the script is in, when it is not at that path."""
    tail = target.as_posix().split("scripts/models/", 1)[1]
    for parent in script.resolve().parents:
        candidate = parent / "scripts" / "models" / tail
        if candidate.is_file():
            return candidate
    return target


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise UserError(f"unbalanced {open_!r} in {text!r}")


def _closes(body: str) -> int:
    """1 + the index of the unquoted ')' closing an array body (0: not closed yet)."""
    quote, depth = None, 0
    k = 0
    while k < len(body):
        c = body[k]
        if quote:
            if c == "\\" and quote == '"':
                k += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (k == 0 or body[k - 1].isspace()):
            nl = body.find("\n", k)
            if nl < 0:
                return 0
            k = nl
        elif c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                return k + 1
            depth -= 1
        k += 1
    return 0


def _arith(expr: str, where: str) -> int:
    if not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
        raise UserError(f"{where}: cannot evaluate $(({expr}))")
    return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only


def read_slime_script(path: str | Path, env: dict[str, str] | None = None) -> SlimeScript:
    """The flags a slime launch script passes to train.py, in order (arrays spliced, variables expanded)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--from-slime-script: {path} is not a file")
    reader = _Reader(dict(os.environ if env is None else env))
    reader.read(p)
    if reader.command is None:  # no train.py line: the arrays in the order the script defines them
        argv = [w for name, words in reader.arrays.items() if name.endswith("ARGS") for w in words]
    else:
        argv = reader.command
    return SlimeScript(p, argv, reader.arrays, reader.sources)
