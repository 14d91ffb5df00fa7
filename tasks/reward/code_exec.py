"""Code-execution reward: run the response's Python against the label's tests, in the sandbox.

``code_reward(response, label, sample=None) -> (reward, details)``

* The program is the last fenced ```python (or ```py / ```python3) block of the response; failing that the
  last bare ``` block; failing that the whole response. An unterminated final fence is taken to the end.
* ``label`` is a JSON object (a string or an already-parsed dict), one of:

  - ``{"tests": ["assert f(1) == 2", ...]}``: the program runs once, then each test statement runs in the
    program's globals (each under its own ``test_timeout_s`` alarm); reward = fraction passed.
  - ``{"io": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``: one sandboxed run per case with ``input`` on
    stdin; the case passes when stdout equals ``output`` up to trailing whitespace on each line and trailing
    blank lines. Reward = fraction passed.

  Optional keys: ``"all_or_nothing": true`` (reward 1.0 only when every test passes, else 0.0; io runs stop
  at the first failure), ``"timeout_s"`` (per sandbox run, default 5), ``"memory_mb"`` (default 256),
  ``"test_timeout_s"`` (per assert, default = timeout_s).
* A timeout, memory blow-up, crash or unparsable label yields reward 0 (or the partial fraction of what
  passed) and ``details["reason"]``; details also carry ``passed``, ``total``, ``status`` and up to
  ``MAX_FAILURES`` failure entries. Never raises for bad responses; a malformed label gives reward 0 with a reason.

Grading caveat: for ``tests`` the asserts run in the same process as the model's code. Results come back on
stdout behind a random per-run nonce passed on stdin (not in the program text), which defeats naive cheats
(``print("PASS")``, ``exit(0)``, ``os._exit``: a missing report counts as all-failed), but code that
deliberately introspects the interpreter could forge it. Use ``io`` specs when that matters.

Register it as a built-in scorer with ``BUILTIN["code"] = code_reward`` (tasks/reward/scorer_registry.py).
"""

from __future__ import annotations

import json
import re
import secrets

from sluiceway.tasks.reward.sandbox import SandboxResult, run_sandboxed

MAX_FAILURES = 5
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

_HARNESS = r"""
import json, signal, sys
_nonce = sys.stdin.readline().strip()
_src = {src!r}
_tests = {tests!r}
_per = {per!r}

def _report(obj):
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.__stdout__.write("\n" + _nonce + json.dumps(obj) + "\n")
    sys.__stdout__.flush()

def _alarm(signum, frame):
    raise TimeoutError("test timed out after %ss" % _per)

signal.signal(signal.SIGALRM, _alarm)
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
try:
    exec(compile(_src, "solution.py", "exec"), _g)
except BaseException as e:
    _report({{"error": "%s: %s" % (type(e).__name__, str(e)[:300])}})
    raise
_res = []
for _t in _tests:
    try:
        signal.setitimer(signal.ITIMER_REAL, _per)
        exec(compile(_t, "test", "exec"), _g)
        signal.setitimer(signal.ITIMER_REAL, 0)
        _res.append(None)
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _res.append(("%s: %s" % (type(e).__name__, str(e)[:200])) if str(e) else type(e).__name__)
_report({{"results": _res}})
"""


def extract_code(response: str) -> str:
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response or "")]
    py = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    if py:
        return py[-1]
    bare = [b for lang, b in blocks if lang == ""]
    if bare:
        return bare[-1]
    return response or ""


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


def _parse_label(label) -> dict:
    spec = json.loads(label) if isinstance(label, str | bytes) else label
    if not isinstance(spec, dict) or not ("tests" in spec or "io" in spec):
        raise ValueError('label must be a JSON object with "tests" or "io"')
    return spec


def _run_reason(r: SandboxResult) -> str:
    return f"{r.status}: {r.reason}" if r.reason else r.status


def code_reward(response: str, label, sample: dict | None = None) -> tuple[float, dict]:
    try:
        spec = _parse_label(label)
    except (ValueError, TypeError) as e:
        return 0.0, {"reason": f"bad label: {e}", "passed": 0, "total": 0}
    code = extract_code(response)
    timeout_s = float(spec.get("timeout_s", 5))
    memory_mb = int(spec.get("memory_mb", 256))
    all_or_nothing = bool(spec.get("all_or_nothing", False))
    if "tests" in spec:
        passed, total, details = _grade_tests(code, list(spec["tests"]), spec, timeout_s, memory_mb)
    else:
        passed, total, details = _grade_io(code, list(spec["io"]), timeout_s, memory_mb, all_or_nothing)
    if total == 0:
        return 0.0, {**details, "reason": details.get("reason") or "no tests in label", "passed": 0, "total": 0}
    reward = (1.0 if passed == total else 0.0) if all_or_nothing else passed / total
    details.update(passed=passed, total=total, all_or_nothing=all_or_nothing)
    if passed < total and not details.get("reason"):
        details["reason"] = f"{total - passed} of {total} tests failed"
    return float(reward), details


def _grade_tests(code: str, tests: list[str], spec: dict, timeout_s: float, memory_mb: int):
    nonce = "@@sluiceway-" + secrets.token_hex(16) + "@@"
    per = float(spec.get("test_timeout_s", timeout_s))
    program = _HARNESS.format(src=code, tests=[str(t) for t in tests], per=per)
    r = run_sandboxed(program, stdin=nonce + "\n", timeout_s=timeout_s, memory_mb=memory_mb)
    details: dict = {"mode": "tests", "status": r.status}
    report = None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(nonce):
            try:
                report = json.loads(line[len(nonce) :])
            except ValueError:
                report = None
            break
    if report is None:
        details["reason"] = (
            "no test report: " + _run_reason(r) if r.status != "ok" else "no test report (the program exited early)"
        )
        details["stderr_tail"] = r.stderr[-500:]
        return 0, len(tests), details
    if "error" in report:
        details["reason"] = f"the program raised before the tests: {report['error']}" + (
            f" ({_run_reason(r)})" if r.status != "ok" else ""
        )
        return 0, len(tests), details
    results = report.get("results", [])
    passed = sum(1 for x in results if x is None)
    fails = [{"index": i, "reason": x} for i, x in enumerate(results) if x is not None]
    details["failures"] = fails[:MAX_FAILURES]
    if r.status != "ok":  # e.g. a report then a crash at exit: keep the results, note the status
        details["reason"] = _run_reason(r)
    return passed, len(tests), details


def _grade_io(code: str, cases: list[dict], timeout_s: float, memory_mb: int, all_or_nothing: bool):
    passed, fails, statuses = 0, [], []
    for i, case in enumerate(cases):
        r = run_sandboxed(code, stdin=str(case.get("input", "")), timeout_s=timeout_s, memory_mb=memory_mb)
        statuses.append(r.status)
        if r.status == "ok" and _norm(r.stdout) == _norm(str(case.get("output", ""))):
            passed += 1
            continue
        why = "wrong output" if r.status == "ok" else _run_reason(r)
        fails.append({"index": i, "reason": why, "stdout_head": r.stdout[:200], "stderr_tail": r.stderr[-300:]})
        if all_or_nothing:
            break
    details: dict = {"mode": "io", "statuses": statuses, "failures": fails[:MAX_FAILURES]}
    if fails:
        details["reason"] = f"case {fails[0]['index']}: {fails[0]['reason']}"
    return passed, len(cases), details
