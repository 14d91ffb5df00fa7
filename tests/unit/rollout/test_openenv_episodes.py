"""Issue 43, OpenEnv: the protocol client (tasks/environments/openenv_client.py) against a real openenv 0.10 server
(tests/data/openenv_guess.py served by openenv's create_app in .venv-openenv), and whole episodes through the
agent endpoint with a scripted engine: the action offered as a tool or parsed from the text, the engine's tokens
verbatim and the observations masked out, the return as the reward; an environment that dies, hangs or gives a
reward beyond float32 fails its sample with the reason and the next session gets a new server. Through a real run:
tests/integration/test_openenv_run.py."""

import asyncio
import json
import random

import pytest
from agent_helpers import PARAMS, ScriptedEngine, check_tokens_match_engine
from paths import DATA
from websockets.asyncio.server import serve

from sluiceway.infra.errors import UserError
from sluiceway.tasks.environments.openenv_client import (
    ActionRefused,
    CapacityReached,
    OpenEnvSession,
    fetch_schema,
)
from sluiceway.tasks.environments.openenv_episode import EpisodeOptions, OpenEnvGenerate, action_tool
from sluiceway.tasks.environments.openenv_servers import (
    LocalServers,
    RemoteServer,
    check_openenv_source,
    openenv_python,
)
from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.rollout import PromptItem

GAME = f"{DATA / 'openenv_guess.py'}:GuessGame"
SOLO = f"{DATA / 'openenv_guess.py'}:SoloGuessGame"


def _python():
    try:
        return openenv_python()
    except UserError as e:
        pytest.skip(f"no interpreter with openenv (make install makes .venv-openenv): {e}")


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 8)  # as the game picks it


def call(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>'


@pytest.fixture(scope="module")
def game():
    servers = LocalServers(GAME, _python(), 8, concurrent=True)
    yield servers
    servers.close()


async def play(tok, gen, engine, seed=7, rid="run/0/0/0", budget=400):
    ctx = GenerateContext(engine, tok, rid, budget, routing_key=rid.rsplit("/", 1)[0])
    item = PromptItem("p0", "x", [1], None, {"openenv": "t", "seed": seed}, "x")
    return await gen(ctx, item, dict(PARAMS, max_new_tokens=budget))


def run_episode(tok, servers, texts, seed=7, own_servers=False, **options):
    schema = check_openenv_source(f"openenv:{GAME}")
    gen = OpenEnvGenerate(servers, schema["action"], EpisodeOptions(**options))
    engine = ScriptedEngine(tok, texts)
    try:
        res = asyncio.run(play(tok, gen, engine, seed))
    finally:
        gen.close() if own_servers else gen.agent.close()
    return res, engine


def test_protocol_client_against_the_openenv_server(game):
    async def go():
        async with game.session() as url:
            schema = fetch_schema(url)
            assert schema["action"]["title"] == "GuessAction"
            assert check_openenv_source(f"openenv:{url}") == schema  # openenv:URL's preflight
            tool = action_tool(schema["action"])["function"]
            assert tool["name"] == "guess" and set(tool["parameters"]["properties"]) == {"number"}
            async with OpenEnvSession(url, timeout_s=30) as env:
                first = await env.reset(seed=7)
                assert "1 to 8" in first.observation["message"] and not first.done and first.reward is None
                wrong = 1 if secret(7) != 1 else 2
                r = await env.step({"number": wrong})
                assert (r.done, r.reward) == (False, 0.0) and "tries left" in r.observation["message"]
                with pytest.raises(ActionRefused, match="number: Field required"):
                    await env.step({"numbr": 3})
                assert (await env.state())["step_count"] == 1  # the refused action was no step
                r = await env.step({"number": secret(7)})
                assert (r.done, r.reward, r.observation["message"]) == (True, 1.0, "Right!")

    asyncio.run(go())


def test_a_class_served_one_session_at_a_time_refuses_a_second_connection_and_an_episode_waits(tiny):
    servers = LocalServers(SOLO, _python(), 4, concurrent=False)
    server = servers._start(1)  # one server, as openenv serves the class: one session

    async def go():
        async with OpenEnvSession(server.url, 30) as a:
            await a.reset(seed=1)
            async with OpenEnvSession(server.url, 30) as b:
                with pytest.raises(CapacityReached, match="CAPACITY_REACHED"):
                    await b.reset(seed=1)

    async def two_episodes(tok):  # a running server at its capacity: the second episode waits for a place
        gen = OpenEnvGenerate(RemoteServer(server.url), fetch_schema(server.url)["action"], EpisodeOptions())
        engine = ScriptedEngine(tok, [call(1), "no"], delay_s=0.3)
        try:
            return await asyncio.gather(
                play(tok, gen, engine, rid="run/0/0/0"), play(tok, gen, engine, rid="run/0/0/1")
            )
        finally:
            gen.close()

    try:
        assert server.capacity == 1
        asyncio.run(go())
        for res in asyncio.run(two_episodes(tiny[1])):
            assert res.abort_reason is None  # not CAPACITY_REACHED: it waited
    finally:
        server.stop()


def test_actions_as_tools_episode_records_engine_tokens_and_masks_observations(tiny, game):
    _, tok = tiny
    s = secret(7)
    wrong = 1 if s != 1 else 2
    res, engine = run_episode(tok, game, [call(wrong), call(s)])
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 2
    assert res.reward_details == {"source": "openenv", "rewards": [0.0, 1.0], "done": True, "steps": 2,
                                  "refused_actions": 0}  # fmt: skip
    (between,) = check_tokens_match_engine(res, engine)
    assert "tries left" in tok.decode(between)  # the observation: given to the model, masked out
    assert "guess" in res.prompt_text and "I picked a number from 1 to 8" in res.prompt_text  # tool + reset obs


def test_a_refused_action_is_told_to_the_model_and_a_turn_without_action_ends_the_episode(tiny, game):
    _, tok = tiny
    res, engine = run_episode(tok, game, ['<tool_call>{"name": "guess", "arguments": {"n": 1}}</tool_call>', "no"])
    assert res.abort_reason is None and res.reward == 0.0 and res.turns == 2
    assert res.reward_details["refused_actions"] == 1 and res.reward_details["steps"] == 0
    (between,) = check_tokens_match_engine(res, engine)
    assert "Field required" in tok.decode(between)


def test_parsed_actions_with_a_user_parser(tiny, game):
    _, tok = tiny
    s = secret(5)
    guesses = [g for g in (1, 2, 3) if g != s][:2] + [s]
    res, engine = run_episode(tok, game, [f"I say {g}" for g in guesses], seed=5,
                              action_parser=lambda text: {"number": int(text.split()[-1])})  # fmt: skip
    d = res.reward_details
    assert res.abort_reason is None and d["done"] and d["steps"] == res.turns
    assert res.reward == (1.0 if s in guesses[: d["steps"]] else 0.0)
    spans = check_tokens_match_engine(res, engine)
    assert len(spans) == res.turns - 1 and all("No:" in tok.decode(x) for x in spans)
    assert "<tools>" not in res.prompt_text  # no tool offered


def test_a_dying_hanging_raising_or_badly_rewarding_environment_fails_its_sample_and_the_next_gets_a_new_server(
    tiny, tmp_path, monkeypatch
):
    _, tok = tiny
    for name in ("DIE", "HANG", "HUGE", "RAISE"):
        monkeypatch.setenv(f"GUESS_{name}_ONCE", str(tmp_path / name))
    servers = LocalServers(GAME, _python(), 4, concurrent=True)
    try:
        reasons = []
        for _ in range(4):
            res, _ = run_episode(tok, servers, [call(1)], timeout_s=3)
            assert res.finish_reason == "abort" and res.reward is None
            reasons.append(res.abort_reason)
        assert "openenv: the environment server closed the connection during step 1" in reasons[0]
        assert "openenv: the environment did not answer step 1 within 3 s" in reasons[1]
        assert "openenv: the environment's reward at step 1 is a reward 1e+300 beyond float32's range" in reasons[2]
        assert reasons[3] == "openenv: the environment answered step 1 with an error (EXECUTION_ERROR): the game broke"
        res, _ = run_episode(tok, servers, [call(secret(7))])
        assert res.abort_reason is None and res.reward == 1.0
        assert servers.started == 3  # died: replaced; hung: retired and replaced; the third served both after
    finally:
        servers.close()


MOVE = {"title": "MoveAction", "properties": {"to": {"type": "string"}}}


def test_a_reward_that_is_not_a_number_from_a_protocol_server_fails_the_sample(tiny):
    """A server speaking the protocol without openenv's models (openenv:URL) can send anything."""
    _, tok = tiny

    async def handler(ws):
        async for raw in ws:
            kind = json.loads(raw)["type"]
            if kind == "close":
                return
            reward = None if kind == "reset" else "lots"
            await ws.send(json.dumps({"type": "observation", "data": {"observation": {"text": "go"}, "reward": reward,
                                                                      "done": False}}))  # fmt: skip

    async def go():
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            gen = OpenEnvGenerate(RemoteServer(f"http://127.0.0.1:{port}"), MOVE, EpisodeOptions())
            engine = ScriptedEngine(tok, ['<tool_call>{"name": "move", "arguments": {"to": "up"}}</tool_call>'])
            try:
                return await play(tok, gen, engine)
            finally:
                gen.close()

    res = asyncio.run(go())
    assert res.abort_reason == "openenv: the environment's reward at step 1 is not a number: 'lots'"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "openenv: the environment's answer to reset is JSON nested too deeply"),
        (b'{"type": "observation", "data": "' + b"x" * (17 << 20) + b'"}', "is over 16777216 bytes; it was not read"),
    ],
    ids=["100k-deep", "17-MB"],
)
def test_an_answer_too_deep_or_too_large_fails_the_sample_naming_openenv(tiny, answer, says):
    """Issue 52 point 13: these had read 'the agent function raised RecursionError / ReadError'."""
    _, tok = tiny

    async def handler(ws):
        async for raw in ws:
            if json.loads(raw)["type"] == "close":
                return
            await ws.send(answer.decode())

    async def go():
        async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
            port = server.sockets[0].getsockname()[1]
            gen = OpenEnvGenerate(RemoteServer(f"http://127.0.0.1:{port}"), MOVE, EpisodeOptions())
            engine = ScriptedEngine(tok, ["nothing"])
            try:
                return await play(tok, gen, engine)
            finally:
                gen.close()

    res = asyncio.run(go())
    assert says in res.abort_reason and res.abort_reason.startswith("openenv: "), res.abort_reason


def test_mistakes_are_one_line_before_the_run_starts():
    _python()
    with pytest.raises(UserError, match="has no 'Nope'"):
        check_openenv_source(f"openenv:{DATA / 'openenv_guess.py'}:Nope")
    with pytest.raises(UserError, match="no OpenEnv server answers at http://127.0.0.1:9"):
        check_openenv_source("openenv:http://127.0.0.1:9")
    with pytest.raises(UserError, match="expected openenv:URL"):
        check_openenv_source("openenv:")


def test_an_mcp_environment_offers_its_mcp_tools(tiny):
    """openenv's MCPEnvironment (tests/data/openenv_mcp_counter.py): its action model is the base Action, so the
    episode lists the MCP tools (list_tools) and each call is a call_tool action whose text is the answer."""
    _, tok = tiny
    target = f"{DATA / 'openenv_mcp_counter.py'}:CounterEnv"
    schema = check_openenv_source(f"openenv:{target}")
    servers = LocalServers(target, _python(), 2, concurrent=schema["concurrent"])
    gen = OpenEnvGenerate(servers, schema["action"], EpisodeOptions())
    engine = ScriptedEngine(tok, ['<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>',
                                  '<tool_call>{"name": "add", "arguments": {"n": 3}}</tool_call>', "done"])  # fmt: skip
    try:
        res = asyncio.run(play(tok, gen, engine))
    finally:
        gen.close()
    assert res.abort_reason is None and res.turns == 3 and res.reward == 0.0
    assert res.reward_details["steps"] == 2 and not res.reward_details["done"]
    spans = check_tokens_match_engine(res, engine)
    assert [("total 2" in tok.decode(a), "total 5" in tok.decode(b)) for a, b in [spans]] == [(True, True)]
    assert "Add n to the counter" in res.prompt_text and "Bring the counter to 5" in res.prompt_text


def test_preflight_refuses_what_an_openenv_source_cannot_be_combined_with(tmp_path):
    from sluiceway.flows.config import RunConfig
    from sluiceway.flows.preflight import preflight

    _python()
    base = {"data": {"prompt_data": f"openenv:{GAME}"}, "storage": {"output_dir": str(tmp_path / "run")}}
    agent = RunConfig(**base, rollout={"agent_function_path": "examples/agent_openai_tools.py:agent"})
    with pytest.raises(UserError, match="cannot be combined with --agent-function-path"):
        preflight(agent, "run")
    evals = RunConfig(**base, eval={"eval_prompt_data": ["env:arithmetic"], "eval_interval": 1})
    with pytest.raises(UserError, match="evaluation sets are not played as OpenEnv episodes"):
        preflight(evals, "run")
    parser = RunConfig(**{**base, "data": {**base["data"], "openenv_action_parser": "nope.py:parse"}})
    with pytest.raises(UserError, match="--openenv-action-parser nope.py:parse: nope.py not found"):
        preflight(parser, "run")


def test_a_served_environment_does_not_outlive_the_run(tmp_path):
    """A run killed without stopping its servers (they run in sessions of their own) takes them with it."""
    import os
    import subprocess
    import sys
    import time

    from sluiceway.tasks.environments.openenv_servers import SERVE

    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, os\n"
        f"p = subprocess.Popen([{_python()!r}, {str(SERVE)!r}, 'serve', {GAME!r}, '2'], stdout=subprocess.PIPE,\n"
        "                     text=True, start_new_session=True)\n"
        "print(p.stdout.readline().strip(), p.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == "PORT", out
    pid = int(out[-1])
    end = time.monotonic() + 60  # a wait for it to happen, not a timing check
    try:
        while _alive(pid):
            assert time.monotonic() < end, "the orphaned server is still serving"
            time.sleep(0.1)
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_union_annotated_class_and_an_app_made_by_create_app(tiny):
    """echo_env's form (a plain Environment, step taking EchoAction | CallToolAction) serves its own model; an app
    (server.app:app, made with create_app and one session) is served as it is, and a second episode waits for it."""
    _, tok = tiny
    union = check_openenv_source(f"openenv:{DATA / 'openenv_guess.py'}:UnionGuessGame")
    assert union["action"]["title"] == "GuessAction" and union["concurrent"] is True
    target = f"{DATA / 'openenv_guess.py'}:app"
    schema = check_openenv_source(f"openenv:{target}")
    assert schema["action"]["title"] == "GuessAction" and schema["app"] is True
    servers = LocalServers(target, _python(), 4, concurrent=None)
    gen = OpenEnvGenerate(servers, schema["action"], EpisodeOptions())
    engine = ScriptedEngine(tok, [call(secret(7))], delay_s=0.3)

    async def two():
        return await asyncio.gather(play(tok, gen, engine, rid="run/0/0/0"), play(tok, gen, engine, rid="run/0/0/1"))

    try:
        results = asyncio.run(two())
    finally:
        gen.close()
    assert [(r.abort_reason, r.reward) for r in results] == [(None, 1.0), (None, 1.0)]
    assert servers.started == 1
