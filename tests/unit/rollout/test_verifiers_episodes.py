"""verifiers (v1) episodes as samples (tasks/rollout/agent/verifiers.py, tasks/environments/verifiers_env.py), on
the real agent endpoint and a scripted engine, with verifiers 0.4.0 itself (its null harness's chat program, its
interception server, the environment's MCP tool server: nothing of verifiers is mocked). The environment is
tests/data/verifiers_envs/sw_add_v1, written here against verifiers' v1 API.

Runs under .venv-verifiers (make test's verifiers pass): in .venv verifiers cannot be installed (openai pins)."""

import asyncio
import os
import sys

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers runs under .venv-verifiers (make test's verifiers pass)")

from agent_helpers import PARAMS, ScriptedEngine, check_tokens_match_engine  # noqa: E402
from paths import DATA  # noqa: E402

from sluiceway.infra.errors import UserError  # noqa: E402
from sluiceway.tasks.environments import verifiers_env  # noqa: E402
from sluiceway.tasks.rollout.agent.verifiers import VerifiersGenerate  # noqa: E402
from sluiceway.tasks.rollout.multiturn import GenerateContext  # noqa: E402
from sluiceway.tasks.rollout.rollout import PromptItem  # noqa: E402

# Each test builds its own environment and servers: they may run on either worker (the killed tool server's test
# waits about 20 s on verifiers' retries, while the other worker runs the rest).
pytestmark = pytest.mark.spread

ENVS = DATA / "verifiers_envs"
SRC = "verifiers:sw_add_v1"
NULL = {"agent": {"harness": {"id": "null"}}}
CALL = '<tool_call>{"name": "add_toolset_add", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.fixture(autouse=True)
def env_importable(monkeypatch):
    """sw_add_v1 importable here and in the processes verifiers starts (its tool server: python -m ...)."""
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS), *filter(None, [os.environ.get("PYTHONPATH")])]))


def args(**task) -> dict:
    return {"taskset": {"num_tasks": 2, "task": task}, **NULL}


def episode(tok, texts, env_args, budget=200):
    """One sample of task 0 through VerifiersGenerate: its TokenBuffer and the scripted engine."""
    rec = verifiers_env.records(SRC, env_args, 1)[0]
    engine = ScriptedEngine(tok, texts)
    gen = VerifiersGenerate(SRC, env_args)
    item = PromptItem("p0", rec["input"], tok.encode(rec["input"]), None, rec["metadata"], rec["input"])
    ctx = GenerateContext(engine, tok, "run/0/0/0", budget, routing_key="run/0/0", max_prompt_len=400)
    try:
        return asyncio.run(gen(ctx, item, dict(PARAMS, max_new_tokens=budget))), engine
    finally:
        gen.close()


def test_tasks_become_rows():
    rows = verifiers_env.records(SRC, args(), 5)
    assert len(rows) == 2  # the taskset's two tasks, though 5 were asked for
    assert rows[1]["input"].startswith("What is 4 + 6?")
    assert rows[1]["metadata"]["verifiers"]["idx"] == 1 and rows[1]["metadata"]["verifiers"]["id"] == "add-1"


def test_an_episode_with_the_tool_is_two_turns_and_the_rubric_is_the_reward(tiny):
    _, tok = tiny
    res, engine = episode(tok, [CALL, "The answer is 7"], args())
    assert res.abort_reason is None, res.abort_reason
    assert res.turns == 2 and res.finish_reason == "stop"
    spans = check_tokens_match_engine(res, engine)  # the engine's ids, mask 1; between turns the tool's, mask 0
    assert "7" in tok.decode(spans[0]) and "tool" in tok.decode(spans[0])  # the tool server's answer, masked out
    assert res.reward == pytest.approx(1.0 * 1.0 + 0.5 * 1.0)  # correct (weight 1) + used_tool (weight 0.5)
    d = res.reward_details
    assert d["source"] == "verifiers" and d["env"] == "sw_add_v1" and d["turns"] == 2
    assert d["rewards"] == {"correct": {"score": 1.0, "weight": 1.0}, "used_tool": {"score": 1.0, "weight": 0.5}}
    assert d["metrics"] == {"turns": 2.0}
    assert res.row_metadata["verifiers"]["idx"] == 0 and res.row_metadata["verifiers"]["trace_id"] == d["trace_id"]


def test_a_reward_that_is_not_a_number_fails_the_sample(tiny):
    _, tok = tiny
    res, _ = episode(tok, ["42"], args(reward_kind="text"))
    assert res.finish_reason == "abort" and res.reward is None
    assert res.abort_reason.startswith("the verifiers episode failed: TaskError:"), res.abort_reason
    assert "\n" not in res.abort_reason


def test_a_nan_reward_fails_the_sample(tiny):
    _, tok = tiny
    res, _ = episode(tok, ["42"], args(reward_kind="nan"))
    assert res.finish_reason == "abort" and res.reward is None
    assert res.abort_reason == "the verifiers reward 'correct' is a non-finite reward nan"


def test_an_environment_that_raises_fails_the_sample(tiny):
    _, tok = tiny
    res, engine = episode(tok, ["42"], args(setup_raises=True))
    assert res.finish_reason == "abort" and engine.calls == []
    assert "the environment's setup failed on purpose" in res.abort_reason and "\n" not in res.abort_reason


def test_an_environment_that_hangs_times_out(tiny):
    _, tok = tiny
    res, _ = episode(tok, ["42"], {**args(setup_sleep_s=600), "timeout": {"episode": 3}})
    assert res.finish_reason == "abort"
    assert res.abort_reason.startswith("the verifiers episode timed out:"), res.abort_reason


def test_a_reward_that_exits_its_process_costs_the_sample_and_the_next_runs_on_a_new_worker(tiny):
    """Issue 52 point 5: a reward calling os._exit(1) had ended the run with no line."""
    _, tok = tiny
    env_args = args(reward_kind="exit")
    rec = verifiers_env.records(SRC, env_args, 1)[0]
    engine = ScriptedEngine(tok, ["42"])
    gen = VerifiersGenerate(SRC, env_args)
    item = PromptItem("p0", rec["input"], tok.encode(rec["input"]), None, rec["metadata"], rec["input"])

    async def sample(i):
        ctx = GenerateContext(engine, tok, f"run/0/0/{i}", 200, routing_key="run/0/0", max_prompt_len=400)
        return await gen(ctx, item, dict(PARAMS))

    async def main():
        first = await sample(0)
        pid = gen.worker._proc.pid if gen.worker._proc is not None else None
        second = await sample(1)
        return first, second, pid

    try:
        first, second, pid = asyncio.run(main())
    finally:
        gen.close()
    for res in (first, second):  # this process is alive to see both: the run would be too
        assert res.finish_reason == "abort" and res.reward is None
        assert res.abort_reason == ("the verifiers worker process exited with code 1 during the episode (the "
                                    "environment's code?)"), res.abort_reason  # fmt: skip


def test_a_reward_that_blocks_its_event_loop_costs_the_sample_not_the_run(tiny, monkeypatch):
    """Issue 52 point 6: a synchronous sleep in an async reward had hung the whole run (timeout.episode runs on the
    blocked loop and never fired). A worker whose loop gives no sign of life for timeout.episode + GRACE_S is
    killed. The episode's deadline leaves room for the environment's set-up (its servers: ~6 s here, more on a busy
    machine), which a short deadline would cut first: the blocked reward must be reached."""
    from sluiceway.tasks.rollout.agent import verifiers_worker

    monkeypatch.setattr(verifiers_worker, "GRACE_S", 1.0)
    _, tok = tiny
    res, _ = episode(tok, ["42"], {**args(reward_kind="block"), "timeout": {"episode": 20}})
    assert res.finish_reason == "abort" and res.reward is None
    assert res.abort_reason.startswith("the verifiers worker process was killed after 21 s without a sign of life"), (
        res.abort_reason
    )


def test_mistakes_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"verifiers:no_such_env_xyz: taskset 'no_such_env_xyz' not found") as e:
        verifiers_env.load_env("verifiers:no_such_env_xyz", {})
    assert "\n" not in str(e.value)
    (tmp_path / "old_v0_env.py").write_text("def load_environment(**kwargs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="v0 environment") as e:
        verifiers_env.load_env("verifiers:old_v0_env", {})
    assert "\n" not in str(e.value)
    (tmp_path / "broken_env.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(UserError, match="no_such_module_xyz"):
        verifiers_env.load_env("verifiers:broken_env", {})
    with pytest.raises(UserError, match="remote sandbox"):
        verifiers_env.load_env(SRC, {"agent": {"runtime": {"type": "prime"}}})
    with pytest.raises(UserError, match="data.verifiers_env refused"):
        verifiers_env.load_env(SRC, {"taskset": {"num_tasks": "many"}})


def test_a_python_without_verifiers_v1_is_one_line(tmp_path):
    """verifiers 0.3.x (no verifiers.v1): a stand-in package of that shape, in a fresh interpreter."""
    fake = tmp_path / "verifiers"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '0.3.1'\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from sluiceway.tasks.environments.verifiers_env import import_v1\n"
            "import_v1('verifiers:x')\n")  # fmt: skip
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "verifiers 0.3.1 has no v1 API" in proc.stderr and "not the v0 API of 0.3.x" in proc.stderr


def test_a_killed_tool_server_costs_its_samples_and_is_started_again(tiny):
    """The taskset's shared MCP server is SIGKILLed between two samples: the next sample fails with its reason, the
    environment's servers start again, and the sample after it is played as the first was."""
    import signal

    psutil = pytest.importorskip("psutil")
    _, tok = tiny
    env_args = args()
    rec = verifiers_env.records(SRC, env_args, 1)[0]
    engine = ScriptedEngine(tok, ["The answer is 7"])
    gen = VerifiersGenerate(SRC, env_args)
    item = PromptItem("p0", rec["input"], tok.encode(rec["input"]), None, rec["metadata"], rec["input"])

    def tool_servers():
        return [p for p in psutil.Process().children(recursive=True) if "sw_add_v1.tools" in " ".join(p.cmdline())]

    async def sample(i):
        ctx = GenerateContext(engine, tok, f"run/0/0/{i}", 200, routing_key="run/0/0", max_prompt_len=400)
        return await gen(ctx, item, dict(PARAMS))

    killed = []

    async def main():
        first = await sample(0)
        (server,) = tool_servers()
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        killed.append(server.pid)
        second = await sample(1)
        third = await sample(2)
        return first, second, third, tool_servers()

    try:
        first, second, third, servers = asyncio.run(main())
    finally:
        gen.close()
    assert first.abort_reason is None and first.reward == pytest.approx(1.0), first.abort_reason
    assert second.finish_reason == "abort" and second.abort_reason.startswith("the verifiers episode failed:")
    assert "\n" not in second.abort_reason and len(second.abort_reason) < 500
    assert third.abort_reason is None and third.reward == pytest.approx(1.0), third.abort_reason
    assert len(servers) == 1 and servers[0].pid not in killed
