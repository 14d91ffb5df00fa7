"""The agent endpoint's session assembly (tasks/rollout/agent/proxy.py) with a scripted fake engine: the token
list is the rendered first prompt, then the engine's ids verbatim (mask 1, the engine's log-probs) and the
encoded new messages (mask 0), never re-tokenized; tool calls parsed; the session protocol over HTTP with the
real `openai` client; an abandoned session is aborted. Through a real run: tests/integration/test_agent_openai.py.
"""

import asyncio
from dataclasses import dataclass, field

import pytest

from sluiceway.infra.errors import UserError
from sluiceway.models.chat import encode_prompt
from sluiceway.tasks.rollout.agent.openai import chat, complete
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate, load_agent_function
from sluiceway.tasks.rollout.agent.render import ChatRenderer, SessionError, parse_tool_calls
from sluiceway.tasks.rollout.agent.session import AgentSession
from sluiceway.tasks.rollout.client import GenerateResult
from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.rollout import PromptItem

EOS = 2  # tiny-llama's <|im_end|>
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip


@dataclass
class ScriptedEngine:
    """Answers turn k with the k-th scripted text's ids (+ EOS), log-prob -(i+1)/100 for token i."""

    tokenizer: object
    texts: list[str]
    delay_s: float = 0.0
    calls: list[dict] = field(default_factory=list)

    async def generate(
        self, input_ids, params, rid, routing_key=None, min_weight_version=None, max_weight_version=None
    ):
        await asyncio.sleep(self.delay_s)
        k = len(self.calls)
        ids = self.tokenizer.encode(self.texts[k % len(self.texts)], add_special_tokens=False)[
            : params["max_new_tokens"] - 1
        ] + [EOS]
        self.calls.append({"rid": rid, "input_ids": list(input_ids), "params": dict(params), "output_ids": ids})
        lps = [-(i + 1) / 100 for i in range(len(ids))]
        return GenerateResult(rid, ids, lps, "stop", 7, len(input_ids), 0.01)


PARAMS = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [EOS], "sampling_seed": 5}


def session(tok, engine, budget=200) -> AgentSession:
    ctx = GenerateContext(engine, tok, "run/0/1/2", budget, routing_key="run/0/1")
    return AgentSession("s1", ctx, dict(PARAMS, max_new_tokens=budget), ChatRenderer(tok))


def test_tool_calls_are_parsed_from_hermes_blocks():
    content, calls = parse_tool_calls(
        'Let me add. <tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
    )
    assert content == "Let me add." and len(calls) == 1
    assert calls[0]["function"] == {"name": "calc", "arguments": '{"expr": "1+2"}'} and calls[0]["type"] == "function"
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_three_chat_turns_keep_engine_tokens_and_mask_the_rest(tiny):
    _, tok = tiny
    texts = ['<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>', "hmm", "The answer is 4."]
    engine = ScriptedEngine(tok, texts)
    s = session(tok, engine)
    msgs = [{"role": "user", "content": "What is 2+2?"}]

    async def go():
        turns = []
        r = await chat(s, {"messages": msgs, "tools": TOOLS})
        turns.append(r)
        msg = r["choices"][0]["message"]
        assert r["choices"][0]["finish_reason"] == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "calc"
        msgs.append(msg)
        msgs.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "4"})
        r = await chat(s, {"messages": msgs, "tools": TOOLS})
        msgs.append(r["choices"][0]["message"])
        msgs.append({"role": "user", "content": "Sure?"})
        r = await chat(s, {"messages": msgs, "tools": TOOLS})
        assert r["choices"][0]["message"]["content"] == "The answer is 4."
        return turns

    asyncio.run(go())
    res = s.result()
    renderer = ChatRenderer(tok)
    first = renderer.render(msgs[:1], TOOLS)
    assert "<tools>" in first and res.prompt_ids == encode_prompt(tok, first) and res.prompt_text == first
    # The engine was asked for exactly the session's running token list, and answered verbatim.
    ids, mask, lps = res.token_ids, res.loss_mask, res.logprobs
    assert len(ids) == len(mask) == len(lps) and res.turns == 3 and res.finish_reason == "stop"
    pos = 0
    for k, call in enumerate(engine.calls):
        assert call["rid"] == f"run/0/1/2#{k}"
        assert call["input_ids"] == res.prompt_ids + ids[:pos]
        n = len(call["output_ids"])
        assert ids[pos : pos + n] == call["output_ids"] and mask[pos : pos + n] == [1] * n
        assert lps[pos : pos + n] == [-(i + 1) / 100 for i in range(n)]
        pos += n
        if k + 1 < len(engine.calls):
            nxt = len(engine.calls[k + 1]["input_ids"]) - len(res.prompt_ids)
            assert mask[pos:nxt] == [0] * (nxt - pos) and lps[pos:nxt] == [0.0] * (nxt - pos) and nxt > pos
            pos = nxt
    assert pos == len(ids)
    # The new messages were encoded after the model's own <|im_end|>: the whole sequence is the conversation as
    # the template writes it, with the model's raw text as the assistant turns.
    convo = [msgs[0], {"role": "assistant", "content": texts[0]}, msgs[2], {"role": "assistant", "content": texts[1]},
             msgs[4], {"role": "assistant", "content": texts[2]}]  # fmt: skip
    want = renderer.render(convo, TOOLS, add_generation_prompt=False)
    assert tok.decode(res.prompt_ids + ids, skip_special_tokens=False) == want.rstrip("\n")
    assert "tool\n4<|im_end|>" in tok.decode([t for t, m in zip(ids, mask) if m == 0])
    assert all("tool\n4" not in tok.decode(ids[i : i + 1]) for i in range(len(ids)) if mask[i])


def test_history_must_only_grow(tiny):
    _, tok = tiny
    s = session(tok, ScriptedEngine(tok, ["a", "b"]))

    async def go():
        r = await chat(s, {"messages": [{"role": "user", "content": "hi"}]})
        with pytest.raises(SessionError, match=r"messages\[0\] differs"):
            await chat(s, {"messages": [{"role": "user", "content": "HI"}, r["choices"][0]["message"],
                                        {"role": "user", "content": "x"}]})  # fmt: skip
        with pytest.raises(SessionError, match="no new message"):
            await chat(s, {"messages": [{"role": "user", "content": "hi"}, r["choices"][0]["message"]]})
        with pytest.raises(SessionError, match="chat session"):
            await complete(s, {"prompt": "x"})

    asyncio.run(go())


def test_budget_spent_ends_the_session_with_length(tiny):
    _, tok = tiny
    s = session(tok, ScriptedEngine(tok, ["one two three four five six"]), budget=6)

    async def go():
        r = await chat(s, {"messages": [{"role": "user", "content": "hi"}]})
        assert r["choices"][0]["finish_reason"] == "stop"
        msgs = [{"role": "user", "content": "hi"}, r["choices"][0]["message"], {"role": "user", "content": "more " * 9}]
        return await chat(s, {"messages": msgs})

    r = asyncio.run(go())
    res = s.result()
    assert r["choices"][0]["finish_reason"] == "length" and len(res.token_ids) == 6 and res.finish_reason == "length"


def test_completions_extend_text_or_token_ids(tiny):
    _, tok = tiny
    engine = ScriptedEngine(tok, [" four", " five"])
    s = session(tok, engine)

    async def go():
        r = await complete(s, {"prompt": "Count: one two three"})
        text = "Count: one two three" + r["choices"][0]["text"]
        await complete(s, {"prompt": text + " and"})
        with pytest.raises(SessionError, match="does not extend"):
            await complete(s, {"prompt": "Count: something else"})

    asyncio.run(go())
    res = s.result()
    and_ids = tok.encode(" and", add_special_tokens=False)
    n0 = len(engine.calls[0]["output_ids"])
    assert res.token_ids[n0 : n0 + len(and_ids)] == and_ids and res.loss_mask[n0 : n0 + len(and_ids)] == [0] * len(
        and_ids
    )
    assert engine.calls[1]["input_ids"] == res.prompt_ids + res.token_ids[: n0 + len(and_ids)]


def _agent_module(tmp_path, body: str) -> str:
    f = tmp_path / "agent_mod.py"
    f.write_text(body)
    return f"{f}:agent"


def _run_agent(tok, path, engine, prompt="What is 2+2?", max_prompt_len=None):
    gen = AgentGenerate(load_agent_function(path))
    ctx = GenerateContext(engine, tok, "run/0/0/0", 200, routing_key="run/0/0", max_prompt_len=max_prompt_len)
    item = PromptItem("p0", prompt, tok.encode(prompt), "4", {"env": "x"}, prompt)
    return asyncio.run(gen(ctx, item, dict(PARAMS)))


def test_openai_client_session_with_reward_post(tiny, tmp_path):
    _, tok = tiny
    engine = ScriptedEngine(tok, ['<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>', "4"])
    path = _agent_module(
        tmp_path,
        """
import httpx, openai

def agent(base_url, api_key, prompt):
    bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
    try:
        bad.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError:
        pass
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    msgs = [{"role": "user", "content": prompt["prompt"]}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="policy", messages=msgs, tools=tools)
    m = r.choices[0].message
    assert m.tool_calls and m.tool_calls[0].function.name == "calc", m
    msgs.append(m)
    msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "4"})
    r = client.chat.completions.create(model="policy", messages=msgs, tools=tools)
    httpx.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.75},
               headers={"Authorization": f"Bearer {api_key}"}).raise_for_status()
""",
    )
    res = _run_agent(tok, path, engine)
    assert res.abort_reason is None and res.reward == 0.75 and res.turns == 2 and res.finish_reason == "stop"
    assert res.token_ids[: len(engine.calls[0]["output_ids"])] == engine.calls[0]["output_ids"]


def test_non_finite_rewards_never_reach_the_row(tiny, tmp_path):
    """Issue 30: POST {"reward": NaN} was answered 200 and stored; now a 400, and the row keeps no reward."""
    _, tok = tiny
    path = _agent_module(
        tmp_path,
        """
import httpx, openai

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    for bad in ("NaN", "Infinity", "-Infinity", "1e308", "1" + "0" * 400):  # the last two: beyond float32 (issue 40)
        r = httpx.post(base_url.removesuffix("/v1") + "/reward", content='{"reward": %s}' % bad,
                       headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text
""",
    )
    res = _run_agent(tok, path, ScriptedEngine(tok, ["hello"]))
    assert res.abort_reason is None and res.reward is None  # left to the run's reward function
    returning = _agent_module(tmp_path, "def agent(base_url, api_key, prompt):\n    return float('nan')\n")
    res = _run_agent(tok, returning, ScriptedEngine(tok, ["hello"]))
    assert res.reward is None and res.finish_reason == "abort" and "non-finite reward nan" in res.abort_reason
    returning = _agent_module(tmp_path, "def agent(base_url, api_key, prompt):\n    return 1e308\n")
    res = _run_agent(tok, returning, ScriptedEngine(tok, ["hello"]))
    assert res.reward is None and res.finish_reason == "abort" and "beyond float32's range" in res.abort_reason


def test_an_oversized_first_message_is_a_400_before_any_engine_call(tiny, tmp_path):
    """Issue 30: a 1 MB first message went to the engine and came back 502; now refused by the proxy."""
    _, tok = tiny
    path = _agent_module(
        tmp_path,
        """
import openai

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "ab " * 300_000}])
    except openai.BadRequestError as e:
        assert "--rollout-max-prompt-len 64" in str(e), e
        raise RuntimeError("refused") from None
    raise AssertionError("a 900 kB message was accepted")
""",
    )
    engine = ScriptedEngine(tok, ["hello"])
    res = _run_agent(tok, path, engine, max_prompt_len=64)
    assert engine.calls == [] and res.finish_reason == "abort" and "refused" in res.abort_reason


def test_agent_returning_a_number_and_sessions_by_user_field(tiny, tmp_path):
    _, tok = tiny
    path = _agent_module(
        tmp_path,
        """
import openai

async def agent(base_url, api_key, prompt):
    sid = base_url.rstrip("/").split("/")[-2]
    root = base_url.split("/sessions/")[0] + "/v1"
    client = openai.AsyncOpenAI(base_url=root, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], user=sid)
    return 1.0
""",
    )
    res = _run_agent(tok, path, ScriptedEngine(tok, ["hello"]))
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 1


def test_an_agent_giving_no_reward_leaves_the_row_to_the_reward_function(tiny, tmp_path):
    _, tok = tiny
    path = _agent_module(
        tmp_path,
        """
import openai

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.completions.create(model="policy", prompt=prompt["prompt"], max_tokens=3)
""",
    )
    engine = ScriptedEngine(tok, ["twelve"])
    res = _run_agent(tok, path, engine)
    assert res.abort_reason is None and res.reward is None and res.finish_reason == "stop" and res.turns == 1
    assert engine.calls[0]["params"]["max_new_tokens"] == 3 and res.loss_mask == [1] * len(res.token_ids)


@pytest.mark.parametrize("how", ["dropped", "left", "raised", "no_call"])
def test_abandoned_sessions_are_aborted(tiny, tmp_path, how):
    _, tok = tiny
    path = _agent_module(
        tmp_path,
        f"""
import json, socket, time

def agent(base_url, api_key, prompt):
    how = {how!r}
    if how == "no_call":
        return None
    if how == "raised":
        raise RuntimeError("the agent crashed")
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    path = "/" + base_url.split("//")[1].split("/", 1)[1] + "/chat/completions"
    body = json.dumps({{"model": "policy", "messages": [{{"role": "user", "content": "hi"}}]}}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {{path}} HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer {{api_key}}\\r\\n"
              f"Content-Type: application/json\\r\\nContent-Length: {{len(body)}}\\r\\n\\r\\n".encode() + body)
    time.sleep(0.1)
    s.close()  # hangs up while the model generates: no answer read, no reward
    if how == "dropped":
        time.sleep(0.6)  # ("left": returns at once, the call still running)
""",
    )
    res = _run_agent(tok, path, ScriptedEngine(tok, ["hello"], delay_s=0.3))
    assert res.finish_reason == "abort" and res.reward is None
    want = {"dropped": "dropped its connection", "raised": "RuntimeError", "no_call": "no model call"}
    assert how == "left" or want[how] in res.abort_reason


def test_agent_function_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_agent_function("nope.py:agent")
    path = _agent_module(tmp_path, "def agent(x):\n    pass\n")
    with pytest.raises(UserError, match=r"must take \(base_url, api_key, prompt\)"):
        load_agent_function(path)


def test_config_checks_the_agent_function(tmp_path):
    from sluiceway.flows.config import RolloutConfig

    with pytest.raises(ValueError, match="not found"):
        RolloutConfig(agent_function_path="nope.py:agent")
    ok = _agent_module(tmp_path, "def agent(base_url, api_key, prompt):\n    pass\n")
    assert RolloutConfig(agent_function_path=ok).agent_function_path == ok


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--agent-function-path", "nope.py:agent"], "not found"),
        (["--agent-function-path", "AGENT", "--custom-generate-function-path", "AGENT"], "both replace the generate"),
        (["--agent-function-path", "AGENT", "--partial-rollout"], "cannot continue agent sessions"),
    ],
)
def test_run_flags_refuse_a_bad_agent_in_one_line(tmp_path, extra, message):
    from sluiceway.flows.cli import make_parser, resolve_config

    ok = _agent_module(tmp_path, "def agent(base_url, api_key, prompt):\n    pass\n")
    argv = ["run", "--prompt-data", "env:arithmetic", *[ok if a == "AGENT" else a for a in extra]]
    with pytest.raises(UserError, match=message) as e:
        resolve_config(make_parser().parse_args(argv))
    assert "\n" not in str(e.value)


def test_the_endpoint_leaves_the_process_logging_alone(monkeypatch):
    """Issue 30: uvicorn's default logging config ran dictConfig, which closes every handler of the process under
    logging's lock (the start-up hang with Prefect's API log handler). Starting and stopping the endpoint must not
    reconfigure logging: the root's handlers stay the same objects, open."""
    import logging
    import logging.config

    from sluiceway.tasks.rollout.agent.server import AgentProxy

    calls = []
    monkeypatch.setattr(logging.config, "dictConfig", lambda *a, **k: calls.append(a))
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        before = list(logging.getLogger().handlers)
        p = AgentProxy()
        p.start()
        port = p.port
        p.stop()
        assert calls == [] and logging.getLogger().handlers == before and handler.stream is not None
        assert p.port is None and port
        p.start()  # a stopped endpoint starts again
        assert p.port
        p.stop()
    finally:
        logging.getLogger().removeHandler(handler)


def test_a_turn_refused_for_its_weight_version_sends_the_group_elsewhere(tiny, tmp_path):
    # A pool serving an older version than the step allows refuses the pinned turn; the agent sees a failed call,
    # but the sample is not stored as the agent's failure: the generate function raises the refusal, and the
    # dispatcher (tasks/rollout/dispatch.py) gives the group to a pool that is current.
    from sluiceway.tasks.rollout.client import WeightVersionRefused

    _, tok = tiny

    class Behind(ScriptedEngine):
        async def generate(self, input_ids, params, rid, routing_key=None, min_weight_version=None,
                           max_weight_version=None):  # fmt: skip
            raise WeightVersionRefused(f"rid {rid}: refused", serving=4, min_version=min_weight_version,
                                       max_version=max_weight_version)  # fmt: skip

    path = _agent_module(
        tmp_path,
        """
import openai

async def agent(base_url, api_key, prompt):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError:
        return 0.0
""",
    )
    gen = AgentGenerate(load_agent_function(path))
    ctx = GenerateContext(Behind(tok, ["x"]), tok, "run/0/0/0", 200, routing_key="run/0/0", min_weight_version=5)
    item = PromptItem("p0", "What is 2+2?", tok.encode("What is 2+2?"), "4", {"env": "x"}, "What is 2+2?")
    with pytest.raises(WeightVersionRefused) as refused:
        asyncio.run(gen(ctx, item, dict(PARAMS)))
    assert refused.value.serving == 4 and refused.value.min_version == 5
