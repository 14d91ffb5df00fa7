"""The code sandbox and the code-execution reward: hostile programs end in bounded time with reward 0."""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest

from sluiceway.tasks.reward.code_exec import code_reward, extract_code
from sluiceway.tasks.reward.sandbox import UID_RANGE, namespaces_available, run_sandboxed

NS_OK, NS_WHY = namespaces_available()
needs_ns = pytest.mark.skipif(not NS_OK, reason=f"namespaces unavailable: {NS_WHY}")


def _fence(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


def _label(tests, **kw) -> str:
    return json.dumps({"tests": tests, **kw})


def _procs_where(pred) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/status") as f:
                uid = next(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        pgrp = int(stat.rsplit(")", 1)[1].split()[2])
        if pred(pgrp, uid):
            found.append(int(d))
    return found


def _assert_no_leftovers(res) -> None:
    assert res.pgid is not None
    assert _procs_where(lambda pgrp, uid: pgrp == res.pgid) == []
    assert _procs_where(lambda pgrp, uid: uid == res.details["uid"]) == []


# -- correct programs ---------------------------------------------------------------------------------------


@needs_ns
def test_tests_spec_full_and_partial_credit():
    code = "def add(a, b):\n    return a + b\n"
    r, d = code_reward(_fence(code), _label(["assert add(1, 2) == 3", "assert add(2, 2) == 4"]), {})
    assert (r, d["passed"], d["total"]) == (1.0, 2, 2)
    r, d = code_reward(_fence(code), _label(["assert add(1, 2) == 3", "assert add(2, 2) == 5"]), {})
    assert r == 0.5 and d["failures"][0]["index"] == 1 and "AssertionError" in d["failures"][0]["reason"]
    r, d = code_reward(_fence(code), _label(["assert add(1, 2) == 3", "assert add(2, 2) == 5"], all_or_nothing=True))
    assert r == 0.0 and d["reason"]


@needs_ns
def test_io_spec():
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    label = json.dumps({"io": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7", "output": "12"}]})
    r, d = code_reward(_fence(code), label, {})
    assert (r, d["passed"]) == (1.0, 2)
    wrong = json.dumps({"io": [{"input": "1 2\n", "output": "3"}, {"input": "5 7", "output": "13"}]})
    r, d = code_reward(_fence(code), wrong, {})
    assert r == 0.5 and "wrong output" in d["reason"]


def test_extract_code_and_bad_label():
    resp = "```python\nx = 1\n```\ntext\n```py\ny = 2\n```"
    assert extract_code(resp).strip() == "y = 2"
    assert extract_code("print(1)") == "print(1)"
    assert extract_code("```\nz = 3\n```").strip() == "z = 3"
    r, d = code_reward("print(1)", "not json", {})
    assert r == 0.0 and "bad label" in d["reason"]


@needs_ns
def test_naive_cheats_do_not_pass():
    for cheat in ("import os\nos._exit(0)", "raise SystemExit(0)", "print('{\"results\": [null]}')"):
        r, d = code_reward(_fence(cheat), _label(["assert f() == 1"]), {})
        assert r == 0.0 and d["reason"], cheat


# -- hostile programs ---------------------------------------------------------------------------------------


@needs_ns
def test_infinite_loop_times_out():
    r, d = code_reward(_fence("while True:\n    pass"), _label(["assert True"], timeout_s=2), {})
    assert r == 0.0 and d["status"] == "timeout" and "timeout" in d["reason"]
    res = run_sandboxed("while True:\n    pass", timeout_s=1.5)
    assert res.status == "timeout" and res.reason
    _assert_no_leftovers(res)


@needs_ns
def test_sleeping_child_in_own_session_is_killed_too():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)\n"
    res = run_sandboxed(code, timeout_s=1.5)
    assert res.status == "timeout"
    _assert_no_leftovers(res)


@needs_ns
def test_fork_bomb_is_capped_and_reaped():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r, d = code_reward(_fence(bomb), _label(["assert True"], timeout_s=3), {})
    assert r == 0.0 and d["status"] == "timeout" and d["reason"]
    res = run_sandboxed(bomb, timeout_s=2, max_processes=16)
    assert res.status == "timeout"
    _assert_no_leftovers(res)
    # the process cap is real: forking stops at max_processes (children sleep until the namespace dies)
    counter = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\nprint(n)\n"
    )
    res = run_sandboxed(counter, timeout_s=10, max_processes=16)
    assert res.status == "ok", res.reason
    assert int(res.stdout) < 16
    _assert_no_leftovers(res)


@needs_ns
def test_memory_hog():
    r, d = code_reward(_fence("x = bytearray(2 * 1024 ** 3)\n"), _label(["assert len(x) > 0"]), {})
    assert r == 0.0 and d["status"] == "memory" and "memory" in d["reason"]
    res = run_sandboxed("x = bytearray(2 * 1024 ** 3)", memory_mb=256)
    assert res.status == "memory" and "MemoryError" in res.stderr


@needs_ns
def test_no_network():
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(8)
    host.setblocking(False)
    port = host.getsockname()[1]
    code = (
        "import socket\n"
        "def reach(addr):\n"
        "    s = socket.socket()\n    s.settimeout(2)\n"
        "    try:\n        s.connect(addr)\n        return 'connected'\n"
        "    except OSError as e:\n        return repr(e)\n"
        f"LOCAL = reach(('127.0.0.1', {port}))\nREMOTE = reach(('1.1.1.1', 53))\n"
        "print(LOCAL, REMOTE)\n"
    )
    try:
        r, d = code_reward(_fence(code), _label(["assert LOCAL == 'connected'", "assert REMOTE == 'connected'"]), {})
        assert r == 0.0 and d["passed"] == 0 and d["reason"]
        res = run_sandboxed(code, timeout_s=10)
        assert res.status == "ok"
        assert "connected " not in res.stdout and res.stdout.count("Network is unreachable") == 2
        with pytest.raises(BlockingIOError):
            host.accept()  # nothing ever reached the host's loopback listener
    finally:
        host.close()


@needs_ns
def test_no_writes_outside_its_directory():
    name = f"/tmp/sluiceway_escape_{uuid.uuid4().hex}"
    etc = f"/etc/sluiceway_escape_{uuid.uuid4().hex}"
    code = (
        "import os\n"
        "def try_write(p):\n    try:\n        with open(p, 'w') as f:\n            f.write('x')\n        return True\n"
        "    except OSError as e:\n        print(p, e)\n        return False\n"
        f"OUT = [try_write(p) for p in ({name!r}, {etc!r}, '/etc/x', '/dev/shm/sluiceway_escape', '/var/tmp/x')]\n"
        "LOCAL = try_write('scratch.txt') and open('scratch.txt').read() == 'x'\n"
    )
    r, d = code_reward(_fence(code), _label(["assert any(OUT)", "assert LOCAL"]), {})
    assert r == 0.5 and d["failures"][0]["index"] == 0  # its own directory is writable, nothing else is
    for p in (name, etc, "/etc/x", "/dev/shm/sluiceway_escape"):
        assert not os.path.exists(p), p
    res = run_sandboxed(code + "print(os.getuid(), os.getcwd())\n")
    uid, cwd = res.stdout.split()[-2:]
    assert UID_RANGE[0] <= int(uid) <= UID_RANGE[1]
    assert not os.path.exists(cwd)  # the throw-away directory is gone
    assert "Read-only file system" in res.stdout


@needs_ns
def test_output_cap():
    res = run_sandboxed("while True:\n    print('x' * 1000)", max_output_bytes=10_000, timeout_s=10)
    assert res.status == "output_limit" and len(res.stdout) <= 10_000 and res.reason
    _assert_no_leftovers(res)
    r, d = code_reward(_fence("print('y' * 200_000)\nf = lambda: 1"), _label(["assert f() == 1"]), {})
    assert r == 0.0 and d["status"] == "output_limit"


def test_never_raises_and_refuses_unisolated_runs():
    res = run_sandboxed("print(1)", language="ruby")
    assert res.status == "error" and "unsupported" in res.reason
    res = run_sandboxed("print(1)", isolation="degraded")  # not allowed unless asked for
    assert res.status == "error" and "allow_degraded" in res.reason
    res = run_sandboxed(None)  # type: ignore[arg-type] - garbage in, a SandboxResult out
    assert res.status == "error"


def test_degraded_mode_blocks_sockets_best_effort():
    code = (
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "except OSError as e:\n    print(e)\n"
    )
    res = run_sandboxed(code, isolation="degraded", allow_degraded=True, timeout_s=10)
    if res.status == "error" and "not executable by an unprivileged uid" in res.reason:
        return  # as root with an interpreter under /root: degraded mode refuses rather than run code as root
    assert res.isolation == "degraded" and "degraded" in res.reason
    assert "not allowed" in res.stdout
