"""Issue 32 item 3: Anthropic's Messages API at {session}/v1/messages, through the real endpoint with a scripted
engine and the real `anthropic` client: system, content blocks (text, tool_use, tool_result), tools with
input_schema, stop_sequences, max_tokens, streamed (message_start ... message_stop) and not; the key as
x-api-key or Bearer; errors in Anthropic's shape."""

import pytest
from agent_helpers import ADD_CALL, ScriptedEngine, agent_module, check_tokens_match_engine, run_agent

TOOL_AGENT = """
import anthropic

STREAM = {stream}
INT = {{"type": "integer"}}
TOOLS = [{{"name": "add", "description": "Adds two integers.",
          "input_schema": {{"type": "object", "properties": {{"a": INT, "b": INT}}}}}}]

def ask(client, **kw):
    if not STREAM:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text")
    return final

def agent(base_url, api_key, prompt):
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages = [{{"role": "user", "content": prompt["prompt"]}}]
    kw = dict(model="policy", max_tokens=200, system="Use the add tool.", tools=TOOLS)
    m = ask(client, messages=messages, **kw)
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use", m
    use = m.content[-1]
    assert use.name == "add" and use.input == {{"a": 2, "b": 2}} and use.id.startswith("toolu_")
    messages.append({{"role": "assistant", "content": m.content}})
    messages.append({{"role": "user", "content": [{{"type": "tool_result", "tool_use_id": use.id, "content": "4"}}]}})
    m = ask(client, messages=messages, **kw)
    assert m.stop_reason == "end_turn" and m.content[0].text == "The answer is 4.", m
    messages.append({{"role": "assistant", "content": m.content}})
    messages.append({{"role": "user", "content": [{{"type": "text", "text": "Sure? Say END after."}}]}})
    m = ask(client, messages=messages, stop_sequences=["END"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "END" and m.content[0].text == "Yes, 4. ", m
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    return 1.0
"""


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_client_with_tools(tiny, tmp_path, stream):
    _, tok = tiny
    engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4.", "Yes, 4. END and more"])
    res = run_agent(tok, agent_module(tmp_path, TOOL_AGENT.format(stream=stream)), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 3
    env = check_tokens_match_engine(res, engine)
    assert engine.calls[2]["params"]["stop"] == ["END"]
    prompt = tok.decode(res.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nUse the add tool.\n\n# Tools") and '"name":"add"' in prompt
    assert tok.decode(env[0]).startswith("\n<|im_start|>tool\n4<|im_end|>")
    assert "user\nSure? Say END after.<|im_end|>" in tok.decode(env[1])
    # The turn that ended at the stop string keeps the engine's tokens, the stop string's included.
    assert tok.decode(engine.calls[2]["output_ids"]).endswith("END")


def test_streamed_and_unstreamed_anthropic_sessions_record_the_same_tokens(tiny, tmp_path):
    _, tok = tiny
    rows = []
    for stream in (False, True):
        engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4.", "Yes, 4. END and more"])
        rows.append(run_agent(tok, agent_module(tmp_path, TOOL_AGENT.format(stream=stream), f"a{stream}"), engine))
    a, b = rows
    assert (a.prompt_ids, a.token_ids, a.loss_mask, a.logprobs) == (b.prompt_ids, b.token_ids, b.loss_mask, b.logprobs)


WIRE = """
import httpx, anthropic

def agent(base_url, api_key, prompt):
    root = base_url.removesuffix("/v1")
    body = {"model": "policy", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    h = {"anthropic-version": "2023-06-01"}
    r = httpx.post(root + "/v1/messages", json=body, headers=dict(h, **{"x-api-key": "wrong"}))
    assert r.status_code == 401 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "authentication_error", r.text
    r = httpx.post(root + "/v1/messages", json={"model": "policy", "messages": body["messages"]},
                   headers=dict(h, **{"x-api-key": api_key}))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(root + "/v1/messages", json=dict(body, tools=[{"type": "web_search_20250305", "name": "w"}]),
                   headers=dict(h, **{"x-api-key": api_key}))
    assert r.status_code == 400 and "client tools" in r.json()["error"]["message"], r.text
    # The key as x-api-key (what Anthropic's SDKs send) opens the session; the raw SSE has named events.
    with httpx.stream("POST", root + "/v1/messages", json=dict(body, stream=True),
                      headers=dict(h, **{"x-api-key": api_key})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    assert events[events.index("content_block_start") + 1] == "content_block_delta", events
    # A later call that rewrites the first message: the SDK's BadRequestError, in Anthropic's shape.
    client = anthropic.Anthropic(base_url=root, api_key=api_key, max_retries=0)
    try:
        client.messages.create(model="policy", max_tokens=50, messages=[
            {"role": "user", "content": "HI"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "y"}])
        raise AssertionError("a rewritten history was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error" and "differs" in e.body["error"]["message"]
    return 1.0
"""


def test_anthropic_wire_key_header_errors_and_events(tiny, tmp_path):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["hello there"])
    res = run_agent(tok, agent_module(tmp_path, WIRE), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 1


FAILING = """
import anthropic

def agent(base_url, api_key, prompt):
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    try:
        with client.messages.stream(model="policy", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as s:
            s.get_final_message()
        raise AssertionError("a failed turn streamed as a message")
    except anthropic.APIStatusError as e:
        assert "engine exploded" in str(e), e
    return 1.0
"""


class FailingEngine:
    async def generate(
        self, input_ids, params, rid, routing_key=None, min_weight_version=None, max_weight_version=None
    ):
        raise RuntimeError("engine exploded")


def test_a_failed_streamed_turn_is_an_error_event_and_aborts_the_session(tiny, tmp_path):
    _, tok = tiny
    res = run_agent(tok, agent_module(tmp_path, FAILING), FailingEngine())
    assert res.finish_reason == "abort" and "engine exploded" in res.abort_reason and res.reward is None
