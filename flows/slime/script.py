"""Read a slime launch script's flags: its `NAME=( ... )` arrays, the model files it `source`s, and the
`python3 train.py ...` (or `train_async.py`) command line that splices them together.

This is not a shell. It understands what slime's `scripts/` and `examples/` use: simple assignments
(`X=value`, `export X=...`, `X=${X:-default}`), `${VAR}` / `$VAR` / `${VAR:-default}` expansion from the script's
own assignments and the environment, `$((arithmetic))`, `$(seq A B C)`, `SCRIPT_DIR="$(cd ... dirname
"${BASH_SOURCE[0]}" ...)"`, `source FILE`, arrays across lines with comments and line continuations, and
`${NAME[@]}` in the command line. Control flow is not followed: the last assignment of a variable wins (a
variable assigned inside an `if` counts). Anything else a flag needs (a value computed by a loop, a command's
output) is one error line naming the file and line.

Reading is bounded, whatever the script says (issue 30 item 6): arithmetic is done on 64-bit integers and a value
outside them is refused, not computed with Python's unbounded integers; `$(seq)`, every expansion, every array and
the whole read have size limits (below); the read stops after `TIME_LIMIT_S`; and every failure, a fault this
reader did not foresee included, is one `UserError` line naming the file and line (`run.sh:12: $((1/0)):
division by zero`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluiceway.infra.errors import UserError

_UNKNOWN = object()  # a variable the script assigns from something this reader does not evaluate

# What one read may produce. slime's own scripts are far below all of these (the largest reads ~200 words and
# ~2,300 characters in ~10 ms); a script that reaches one is refused with its file and line.
MAX_SCRIPT_BYTES = 1 << 20  # one script or sourced file
MAX_CHARS = 200_000  # one expansion: the words of one line of an array, one assignment's value
MAX_WORDS = 100_000  # one array, the train.py command line, one $(seq ...)
MAX_TOTAL_CHARS = 1_000_000  # all the expansions of one read together
MAX_TOTAL_WORDS = 1_000_000  # all the arrays and the command line of one read together
MAX_ARITH_CHARS = 10_000  # one $((...)), variables substituted
MAX_NESTING = 32  # expansions inside expansions, parentheses inside $((...)), files sourcing files
TIME_LIMIT_S = 10.0  # wall clock for one read
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


class _Fault(UserError):
    """The script's own mistake (division by zero, a value beyond 64 bits) or one of the limits above: reported
    where it happens, even in an assignment whose value might go unused (bash stops there too), never taken for
    'computed by shell code this reader does not run'."""


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
        self.where = ""  # the file:line being read, for a failure this reader did not foresee
        self.deadline = time.monotonic() + TIME_LIMIT_S
        self.depth = 0  # expansions being expanded
        self.chars = 0  # characters expanded so far (MAX_TOTAL_CHARS)
        self.words = 0  # words of arrays and the command line so far (MAX_TOTAL_WORDS)
        self.reading: list[Path] = []  # the files being read, the outermost first

    def _tick(self, where: str) -> None:
        if time.monotonic() > self.deadline:
            raise _Fault(f"{where}: reading the script took more than {TIME_LIMIT_S:g} s; this reader stops there")

    # -- expansion -----------------------------------------------------------------------------------------
    def expand(self, text: str, where: str) -> str:
        self._tick(where)
        if self.depth >= MAX_NESTING:
            raise _Fault(f"{where}: expansions nested more than {MAX_NESTING} deep in {_show(text)}")
        self.depth += 1
        try:
            out = self._expand(text, where)
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.chars += len(out)
            if self.chars > MAX_TOTAL_CHARS:
                raise _Fault(f"{where}: the script's expansions come to more than {MAX_TOTAL_CHARS} characters")
        return out

    def _expand(self, text: str, where: str) -> str:
        out: list[str] = []
        n = 0

        def put(s: str, src: str) -> None:
            nonlocal n
            n += len(s)
            if n > MAX_CHARS:
                raise _Fault(f"{where}: {_show(src)} makes an expansion longer than {MAX_CHARS} characters")
            out.append(s)

        i = 0
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                put(text[i : i + 2], text[i : i + 2])
                i += 2
                continue
            if c == "'":  # single quotes: literal
                j = text.find("'", i + 1)
                j = len(text) - 1 if j < 0 else j
                put(text[i : j + 1], text[i : j + 1])
                i = j + 1
                continue
            if c != "$":
                put(c, c)
                i += 1
                continue
            if text.startswith("$((", i):
                j = _matching(text, i + 1, "(", ")", where)
                src = text[i : j + 1]
                expr = self._names(self.expand(text[i + 3 : j - 1], where), src, where)
                put(str(_arith(expr, src, where)), src)
                i = j + 1
                continue
            if text.startswith("$(", i):
                j = _matching(text, i + 1, "(", ")", where)
                src = text[i : j + 1]
                inner = self.expand(text[i + 2 : j], where).strip()
                put(_seq(inner, src, where), src)
                i = j + 1
                continue
            if text.startswith("${", i):
                j = _matching(text, i + 1, "{", "}", where)
                body = text[i + 2 : j]
                src = text[i : j + 1]
                i = j + 1
                m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=])(.*))?", body, re.S)
                if not m:
                    raise UserError(f"{where}: cannot expand {_show(src)} (not a shell)")
                name, op, default = m.groups()
                value = self.vars.get(name)
                if op is not None and (value is None or (op.startswith(":") and value == "")):
                    value = self.expand(default, where)
                    if op.endswith("="):
                        self.vars[name] = value
                put(self._value(name, value, where), src)
                continue
            m = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[i:])
            if m:
                put(self._value(m.group(1), self.vars.get(m.group(1)), where), m.group())
                i += m.end()
                continue
            put(c, c)
            i += 1
        return "".join(out)

    def _names(self, expr: str, src: str, where: str) -> str:
        """`$((...))` with its variables' values in place, each in parentheses: bash evaluates a variable's value
        as an expression of its own (N="2+3"; $((N*2)) is 10), and an unset or empty one as 0."""
        out, pos, n = [], 0, 0
        for m in _NAME.finditer(expr):
            value = self._value(m.group(), self.vars.get(m.group(), "0"), where).strip()
            out += [expr[pos : m.start()], f"({value})" if value else "0"]
            n += m.start() - pos + len(out[-1])
            if n > MAX_ARITH_CHARS:
                raise _Fault(f"{where}: {_show(src)}: longer than {MAX_ARITH_CHARS} characters with its variables")
            pos = m.end()
        out.append(expr[pos:])
        return "".join(out)

    def _value(self, name: str, value: object, where: str) -> str:
        if value is _UNKNOWN:
            raise UserError(f"{where}: ${name} is computed by shell code this reader does not run; set {name} in "
                            f"the environment or write the value in the script")  # fmt: skip
        return "" if value is None else str(value)

    # -- statements ----------------------------------------------------------------------------------------
    def read(self, path: Path) -> None:
        real = path.resolve()
        if real in self.reading:
            raise _Fault(f"{self.where}: sources {path}, which is being read already (it would be read for ever)")
        if len(self.reading) >= MAX_NESTING:
            raise _Fault(f"{self.where}: files sourcing files more than {MAX_NESTING} deep")
        self.reading.append(real)
        try:
            self._read(path)
        finally:
            self.reading.pop()

    def _read(self, path: Path) -> None:
        lines = _text(path, self.where or str(path)).splitlines()
        script_dir = str(path.parent.resolve())
        i = 0
        while i < len(lines):
            start = i
            parts = [lines[i]]
            while parts[-1].endswith("\\") and i + 1 < len(lines):  # line continuation
                i += 1
                parts[-1] = parts[-1][:-1]
                parts.append(lines[i])
            line = " ".join(parts)
            i += 1
            where = self.where = f"{path}:{start + 1}"
            self._tick(where)
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            m = re.match(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=\((.*)$", stripped)
            if m:  # an array: up to the line whose unquoted ')' closes it
                name, body = m.group(1), m.group(2)
                closed = _closes(body)
                while not closed:
                    self._tick(where)
                    if i >= len(lines):
                        raise UserError(f"{where}: the array {name}=( is never closed")
                    body += "\n" + lines[i]
                    closed = _closes(body) if ")" in lines[i] else 0  # only a line with a ')' can close it
                    i += 1
                body = body[: closed - 1]
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
                except _Fault:
                    raise
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
                else:
                    try:
                        out.extend(shlex.split(self.expand(part, where), comments=True))
                    except ValueError as e:
                        raise UserError(f"{where}: cannot split {_show(part.strip())!r}: {e}") from None
                if len(out) > MAX_WORDS:
                    raise _Fault(f"{where}: more than {MAX_WORDS} words in one array or command line")
        self.words += len(out)
        if self.words > MAX_TOTAL_WORDS:
            raise _Fault(f"{where}: the script's arrays and command line come to more than {MAX_TOTAL_WORDS} words")
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


def _text(path: Path, where: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as e:
        raise UserError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_SCRIPT_BYTES:
        raise _Fault(f"{path}: larger than {MAX_SCRIPT_BYTES} bytes, which no launch script is")
    return data.decode("utf-8", errors="replace")


def _show(text: str, limit: int = 60) -> str:
    """A fragment of the script for a message: a long one is cut."""
    return text if len(text) <= limit else text[:limit] + "..."


_NAME = re.compile(r"(?<![0-9A-Za-z_])[A-Za-z_][A-Za-z0-9_]*")  # a variable, not the x of 0x1F


def _seq(inner: str, src: str, where: str) -> str:
    """`$(seq LAST)`, `$(seq FIRST LAST)`, `$(seq FIRST STEP LAST)`: the only command substitution read here, of
    at most MAX_WORDS numbers, each within 64 bits (counted before any is made)."""
    m = re.fullmatch(r"seq\s+(-?\d+)(?:\s+(-?\d+))?(?:\s+(-?\d+))?", inner)
    if not m:
        raise UserError(f"{where}: cannot evaluate the command substitution {_show(src)} (not a shell)")
    groups = [g for g in m.groups() if g is not None]
    if any(len(g) > 40 or len(g.lstrip("-").lstrip("0")) > 19 or not _INT_MIN <= int(g) <= _INT_MAX for g in groups):
        raise _Fault(f"{where}: {_show(src)}: a number beyond 64 bits")
    nums = [int(g) for g in groups]
    first, step, last = (1, 1, nums[0]) if len(nums) == 1 else (
        (nums[0], 1, nums[1]) if len(nums) == 2 else tuple(nums))  # fmt: skip
    if step == 0:
        raise _Fault(f"{where}: {_show(src)}: an increment of 0 (seq refuses it)")
    numbers = range(first, last + (1 if step > 0 else -1), step)
    if len(numbers) > MAX_WORDS:
        raise _Fault(f"{where}: {_show(src)} makes {len(numbers)} numbers, more than the {MAX_WORDS} this reader "
                     f"expands")  # fmt: skip
    return " ".join(map(str, numbers))


def _matching(text: str, i: int, open_: str, close: str, where: str) -> int:
    """Index of the bracket closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise UserError(f"{where}: unbalanced {open_!r} in {_show(text)!r}")


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


_TOKEN = re.compile(r"\s*(?:(0[xX][0-9A-Fa-f]+|[0-9]+)(?![0-9A-Za-z_])|(\*\*|[-+*/%()]))")
_BLANK = re.compile(r"\s*\Z")


def _arith(expr: str, src: str, where: str) -> int:
    """`$((expr))` after its variables are substituted: integers, + - * / % **, unary + -, parentheses.

    As bash (checked against bash 5.2): unary minus binds tighter than ** (-2**2 is 4) and ** is right-associative
    (2**3**2 is 512); / truncates toward zero and % takes the dividend's sign (-7/2 is -3, -7%2 is -1; Python's
    // and % floor); a leading 0 is octal and 0x hexadecimal (010 is 8, 08 an error); $(( )) is 0; a negative
    exponent and a division by zero are errors. Unlike bash, a value outside 64-bit signed integers is refused,
    not wrapped around: bash prints $((2**63)) as -9223372036854775808 and $((9**9**9)) as -2123029214124047543,
    and a flag value that wrapped is a mistake better named here than passed on. Every value is checked as it is
    made, so nothing larger than 64 bits is ever computed (an exponent of 64 or more is refused before the power).
    """
    shown = _show(src)
    if len(expr) > MAX_ARITH_CHARS:
        raise _Fault(f"{where}: {shown}: longer than {MAX_ARITH_CHARS} characters")
    tokens: list[str] = []
    pos = 0
    while not _BLANK.match(expr, pos):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise UserError(f"{where}: cannot evaluate {shown} (this reader does integers, + - * / % ** and "
                            f"parentheses; {expr[pos:].strip()[:20]!r} is not one of them)")  # fmt: skip
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        return 0
    return _Arith(tokens, shown, where).parse()


class _Arith:
    """A precedence-climbing reader of `_arith`'s tokens; no recursion but one level per parenthesis."""

    def __init__(self, tokens: list[str], shown: str, where: str):
        self.tokens, self.k, self.shown, self.where, self.depth = tokens, 0, shown, where, 0

    def fault(self, why: str) -> _Fault:
        return _Fault(f"{self.where}: {self.shown}: {why}")

    def syntax(self) -> UserError:
        near = " ".join(self.tokens[self.k : self.k + 3]) or "the end"
        return UserError(f"{self.where}: cannot evaluate {self.shown} (a syntax error near {_show(near, 20)})")

    def fit(self, v: int, what: str) -> int:
        if not _INT_MIN <= v <= _INT_MAX:
            raise self.fault(f"{_show(what, 40)} is beyond 64-bit integers (bash would wrap it around; refused here)")
        return v

    def peek(self) -> str | None:
        return self.tokens[self.k] if self.k < len(self.tokens) else None

    def parse(self) -> int:
        v = self.sum()
        if self.peek() is not None:
            raise self.syntax()
        return v

    def sum(self) -> int:
        v = self.product()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.k]
            self.k += 1
            w = self.product()
            v = self.fit(v + w if op == "+" else v - w, f"{v} {op} {w}")
        return v

    def product(self) -> int:
        v = self.power()
        while self.peek() in ("*", "/", "%"):
            op = self.tokens[self.k]
            self.k += 1
            w = self.power()
            if op == "*":
                v = self.fit(v * w, f"{v} * {w}")
                continue
            if w == 0:
                raise self.fault("division by zero")
            q = abs(v) // abs(w) * (1 if (v < 0) == (w < 0) else -1)  # toward zero, as C and bash
            v = self.fit(q, f"{v} / {w}") if op == "/" else v - w * q
        return v

    def power(self) -> int:
        operands = [self.unary()]
        while self.peek() == "**":
            self.k += 1
            operands.append(self.unary())
        v = operands.pop()
        while operands:  # right to left: 2**3**2 is 2**9
            base = operands.pop()
            if v < 0:
                raise self.fault("exponent less than 0")
            if abs(base) >= 2 and v >= 64:  # |base|**64 >= 2**64: refused before it is computed
                raise self.fault(f"{base} ** {v} is beyond 64-bit integers (bash would wrap it around; refused here)")
            v = self.fit(base**v, f"{base} ** {v}")  # |base| <= 1, or an exponent under 64
        return v

    def unary(self) -> int:
        signs = []
        while self.peek() in ("+", "-"):
            signs.append(self.tokens[self.k])
            self.k += 1
        v = self.primary(negated=bool(signs) and signs[-1] == "-")
        for sign in reversed(signs):
            v = self.fit(-v, f"-({v})") if sign == "-" else v
        return v

    def primary(self, negated: bool) -> int:
        t = self.peek()
        if t == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise self.fault(f"parentheses nested more than {MAX_NESTING} deep")
            self.k += 1
            v = self.sum()
            if self.peek() != ")":
                raise self.syntax()
            self.k += 1
            self.depth -= 1
            return v
        if t is None or not t[0].isdigit():
            raise self.syntax()
        self.k += 1
        if len(t.lstrip("0")) > 20:
            raise self.fault(f"{_show(t, 24)} is beyond 64-bit integers")
        if t[:2] in ("0x", "0X"):
            v = int(t, 16)
        elif t.startswith("0") and len(t) > 1:
            if not set(t) <= set("01234567"):
                raise self.fault(f"{_show(t, 24)}: value too great for base (bash reads a leading 0 as octal)")
            v = int(t, 8)
        else:
            v = int(t)
        if v == _INT_MAX + 1 and negated:  # -9223372036854775808, the smallest 64-bit integer
            return v
        return self.fit(v, t)


def read_slime_script(path: str | Path, env: dict[str, str] | None = None) -> SlimeScript:
    """The flags a slime launch script passes to train.py, in order (arrays spliced, variables expanded)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--from-slime-script: {path} is not a file")
    reader = _Reader(dict(os.environ if env is None else env))
    try:
        reader.read(p)
    except UserError:
        raise
    except Exception as e:  # a fault of this reader's: still one line naming the file and line it was reading
        raise UserError(f"{reader.where or p}: this line could not be read ({type(e).__name__}: "
                        f"{_show(str(e), 120)})") from e  # fmt: skip
    if reader.command is None:  # no train.py line: the arrays in the order the script defines them
        argv = [w for name, words in reader.arrays.items() if name.endswith("ARGS") for w in words]
    else:
        argv = reader.command
    return SlimeScript(p, argv, reader.arrays, reader.sources)


def _script_dir_importable(path: Path) -> None:
    """slime's launch scripts put their own directory on PYTHONPATH so that `--custom-generate-function-path
    generate_with_retool.generate` imports; so does running one here (this process and its children)."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


def splice_slime_script(argv: list[str]) -> list[str]:
    """`--from-slime-script FILE` on a command line: the script's train.py flags in its place (later flags override
    them), after printing how each is treated."""
    from sluiceway.flows.slime.translate import describe

    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--from-slime-script" or word.startswith("--from-slime-script="):
            if "=" in word:
                path, rest = word.split("=", 1)[1], argv[i + 1 :]
            elif i + 1 < len(argv):
                path, rest = argv[i + 1], argv[i + 2 :]
            else:
                raise UserError("--from-slime-script: expected a slime launch script")
            script = read_slime_script(path)
            _script_dir_importable(script.path)
            print(f"slime script {path}: {len(script.argv)} words from its train.py line"
                  + (f" (sourced: {', '.join(str(p) for p in script.sources)})" if script.sources else ""),
                  file=sys.stderr)  # fmt: skip
            for line in describe(script.argv):
                print(line, file=sys.stderr)
            return [*argv[:i], *script.argv, *rest]
    return argv
