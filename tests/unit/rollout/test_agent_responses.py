"""Issue 32 item 2: the OpenAI Responses API at {base_url}/responses, through the real endpoint with a scripted
engine: the OpenAI Agents SDK's default model class (OpenAIResponsesModel) with a function tool, streamed and not;
the raw `openai` client with input items, instructions, previous_response_id, tool_choice and max_output_tokens;
history rewrites refused. Token in, token out as for chat: the engine's ids verbatim, the new items masked."""

import json

import pytest
from agent_helpers import ADD_CALL, ScriptedEngine, agent_module, check_tokens_match_engine, run_agent

AGENTS_SDK = """
import asyncio
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
STREAM = {stream}

@function_tool
def add(a: int, b: int) -> int:
    \"\"\"Adds two integers.\"\"\"
    return a + b

async def run(agent, inp, **kw):
    if not STREAM:
        return await Runner.run(agent, inp, **kw)
    result = Runner.run_streamed(agent, inp, **kw)
    async for _ in result.stream_events():
        pass
    return result

async def agent(base_url, api_key, prompt):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = OpenAIResponsesModel(model="policy", openai_client=client)
    agent = Agent(name="calc", instructions="Use the add tool.", model=model, tools=[add],
                  model_settings=ModelSettings(max_tokens=64))
    first = await run(agent, prompt["prompt"], max_turns=3)
    assert first.final_output == "The answer is 4.", first.final_output
    # A follow-up that sends only the new message: the session's earlier turns come from previous_response_id.
    second = await run(agent, "Sure?", previous_response_id=first.last_response_id, max_turns=1)
    assert second.final_output == "Yes, 4.", second.final_output
    return 1.0
"""


@pytest.mark.parametrize("stream", [False, True])
def test_agents_sdk_default_responses_model_with_a_function_tool(tiny, tmp_path, stream):
    _, tok = tiny
    engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4.", "Yes, 4."])
    res = run_agent(tok, agent_module(tmp_path, AGENTS_SDK.format(stream=stream)), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 3 and res.finish_reason == "stop"
    env = check_tokens_match_engine(res, engine)
    prompt = tok.decode(res.prompt_ids)
    assert "Use the add tool." in prompt and '"name":"add"' in prompt and "What is 2+2?" in prompt
    between = [tok.decode(e) for e in env]
    assert between[0].startswith("\n<|im_start|>tool\n4<|im_end|>"), between[0]  # the function's output
    assert "user\nSure?" in between[1], between[1]


def test_streamed_and_unstreamed_sessions_record_the_same_tokens(tiny, tmp_path):
    _, tok = tiny
    rows = []
    for stream in (False, True):
        engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4.", "Yes, 4."])
        rows.append(run_agent(tok, agent_module(tmp_path, AGENTS_SDK.format(stream=stream), f"a{stream}"), engine))
    a, b = rows
    assert (a.prompt_ids, a.token_ids, a.loss_mask, a.logprobs) == (b.prompt_ids, b.token_ids, b.loss_mask, b.logprobs)


RAW = """
import json, httpx, openai

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", "name": "add", "description": "Adds.", "parameters": {"type": "object"}}]
    # Unknown previous responses, and tools that are not functions, are refused before any model call.
    try:
        client.responses.create(model="policy", input="x", previous_response_id="resp_nope")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert "resp_nope" in str(e)
    try:
        client.responses.create(model="policy", input="x", tools=[{"type": "web_search"}])
        raise AssertionError("a web_search tool was accepted")
    except openai.BadRequestError as e:
        assert "only function tools" in str(e)
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": prompt["prompt"]}]}]
    r = client.responses.create(model="policy", input=items, instructions="You add.", tools=tools,
                                max_output_tokens=150)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 2} and call.call_id.startswith("call_")
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    # The whole history sent again (as the Agents SDK does), with the function's output.
    items += [o.model_dump(exclude_none=True) for o in r.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "4"})
    r2 = client.responses.create(model="policy", input=items, instructions="You add.", tools=tools,
                                 tool_choice="none", max_output_tokens=3)
    assert r2.status == "incomplete" and r2.incomplete_details.reason == "max_output_tokens", r2
    assert r2.output[0].type == "message" and r2.output_text == "{text2}", r2.output_text
    # A request that rewrites history is a 400 (the session keeps token ids, it never re-renders).
    bad = [dict(items[0], content="Be long.")] + items[1:] + [{"role": "user", "content": "again"}]
    try:
        client.responses.create(model="policy", input=bad, instructions="You add.", tools=tools)
        raise AssertionError("a rewritten history was accepted")
    except openai.BadRequestError as e:
        assert "differs from the session's history" in str(e)
    # Only the new items, after the last response: previous_response_id; the answer streamed.
    events = list(client.responses.create(model="policy", input=[{"role": "user", "content": "More?"}],
                                          instructions="You add.", tools=tools, previous_response_id=r2.id,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "{text3}" == events[-1].response.output_text
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert k in kinds, kinds
    return 1.0
"""


def test_raw_responses_items_instructions_previous_response_and_refusals(tiny, tmp_path):
    _, tok = tiny
    texts = [ADD_CALL, "It is four, surely.", "No more."]
    two = tok.decode(tok.encode(texts[1], add_special_tokens=False)[:3])
    engine = ScriptedEngine(tok, texts)
    res = run_agent(tok, agent_module(tmp_path, RAW.replace("{text2}", two).replace("{text3}", texts[2])), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 3
    env = check_tokens_match_engine(res, engine)
    assert engine.calls[1]["params"]["max_new_tokens"] == 3 and engine.calls[0]["params"]["max_new_tokens"] == 150
    prompt = tok.decode(res.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nYou add.\n\n# Tools\n") and '"name":"add"' in prompt
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?" in prompt  # developer: system
    assert tok.decode(env[0]).startswith("\n<|im_start|>tool\n4<|im_end|>")
    # Turn 2 was cut at 3 tokens (no stop token): the next messages follow the model's tokens directly.
    assert tok.decode(env[1]).startswith("<|im_end|>\n<|im_start|>user\nMore?")
    assert json.loads(json.dumps(res.loss_mask)) == res.loss_mask
