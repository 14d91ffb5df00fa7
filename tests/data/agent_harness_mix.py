"""One `--agent-function-path` that runs every harness of examples/agent_harnesses.py in one run: session i runs
harness i mod 10 (in the order the sessions open), and appends {"harness", "reward", "error"} to the JSONL file
named by $AGENT_HARNESS_LOG (tests/integration/test_agent_harnesses.py)."""

import importlib.util
import inspect
import itertools
import json
import os
import threading
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "agent_harnesses", Path(__file__).resolve().parents[2] / "examples" / "agent_harnesses.py"
)
harnesses = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harnesses)
ORDER = list(harnesses.HARNESSES)
_next = itertools.count()
_lock = threading.Lock()


def _log(name, reward, error):
    with _lock, open(os.environ["AGENT_HARNESS_LOG"], "a") as f:
        f.write(json.dumps({"harness": name, "reward": reward, "error": error}) + "\n")


async def agent(base_url, api_key, prompt):
    with _lock:
        name = ORDER[next(_next) % len(ORDER)]
    fn = harnesses.HARNESSES[name]
    try:
        if inspect.iscoroutinefunction(fn):
            reward = await fn(base_url, api_key, prompt)
        else:  # a sync harness in a thread: the endpoint's loop (this one) must keep serving
            import asyncio

            reward = await asyncio.to_thread(fn, base_url, api_key, prompt)
    except Exception as e:
        _log(name, None, f"{type(e).__name__}: {e}"[:500])
        raise
    _log(name, reward, None)
    return reward
