"""Issue 32 item 4 for chat completions, and LangChain: the `openai` client with stream=True (chunks with delta,
tool calls in pieces, stream_options.include_usage, [DONE]), legacy completions streamed, LangChain's
ChatOpenAI(...).bind_tools([...]) invoked and streamed, through the real endpoint with a scripted engine. What is
recorded is the same as without streaming; an agent hanging up mid-stream leaves its session aborted."""

import pytest
from agent_helpers import ADD_CALL, ScriptedEngine, agent_module, check_tokens_match_engine, run_agent

OPENAI_AGENT = """
import json, openai

STREAM = {stream}
TOOLS = [{{"type": "function", "function": {{"name": "add", "parameters": {{"type": "object"}}}}}}]

def ask(client, messages):
    if not STREAM:
        return client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                 stream_options={{"include_usage": True}}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == [] and chunks[-1].usage
    content, calls, finish = "", {{}}, None
    for c in chunks[:-1]:
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            empty = {{"id": t.id, "type": "function", "function": {{"name": "", "arguments": ""}}}}
            call = calls.setdefault(t.index, empty)
            call["function"]["name"] += (t.function.name or "") if t.function else ""
            call["function"]["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = c.choices[0].finish_reason or finish
    message = {{"role": "assistant", "content": content or None}}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return openai.types.chat.chat_completion.Choice(index=0, finish_reason=finish, message=message)

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{{"role": "user", "content": prompt["prompt"]}}]
    choice = ask(client, messages)
    m = choice.message
    assert choice.finish_reason == "tool_calls" and m.tool_calls[0].function.name == "add", choice
    assert json.loads(m.tool_calls[0].function.arguments) == {{"a": 2, "b": 2}}
    messages.append(m.model_dump(exclude_none=True))
    messages.append({{"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "4"}})
    choice = ask(client, messages)
    assert choice.finish_reason == "stop" and choice.message.content == "The answer is 4.", choice
    return 1.0
"""


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_streaming_with_tool_calls(tiny, tmp_path, stream):
    _, tok = tiny
    engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4."])
    res = run_agent(tok, agent_module(tmp_path, OPENAI_AGENT.format(stream=stream)), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 2
    env = check_tokens_match_engine(res, engine)
    assert tok.decode(env[0]).startswith("\n<|im_start|>tool\n4<|im_end|>")


def test_streamed_and_unstreamed_chat_sessions_record_the_same_tokens(tiny, tmp_path):
    _, tok = tiny
    rows = []
    for stream in (False, True):
        engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4."])
        rows.append(run_agent(tok, agent_module(tmp_path, OPENAI_AGENT.format(stream=stream), f"a{stream}"), engine))
    a, b = rows
    assert (a.prompt_ids, a.token_ids, a.loss_mask, a.logprobs) == (b.prompt_ids, b.token_ids, b.loss_mask, b.logprobs)


def test_legacy_completions_stream(tiny, tmp_path):
    _, tok = tiny
    path = agent_module(
        tmp_path,
        """
import openai

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    chunks = list(client.completions.create(model="policy", prompt="Count: one two", stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == " three four five six seven eight nine" and chunks[-1].choices[0].finish_reason == "stop", chunks
    return 1.0
""",
    )
    engine = ScriptedEngine(tok, [" three four five six seven eight nine"])
    res = run_agent(tok, path, engine)
    assert res.abort_reason is None and res.turns == 1 and res.token_ids == engine.calls[0]["output_ids"]


LANGCHAIN = """
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

STREAM = {stream}

@tool
def add(a: int, b: int) -> int:
    \"\"\"Adds two integers.\"\"\"
    return a + b

def agent(base_url, api_key, prompt):
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, streaming=STREAM)
    model = llm.bind_tools([add])
    messages = [SystemMessage("Use the add tool."), HumanMessage(prompt["prompt"])]
    ai = model.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "add" and ai.tool_calls[0]["args"] == {{"a": 2, "b": 2}}, ai
    messages.append(ai)
    messages.append(ToolMessage(str(add.invoke(ai.tool_calls[0]["args"])), tool_call_id=ai.tool_calls[0]["id"]))
    ai = model.invoke(messages)
    assert ai.content == "The answer is 4.", ai
    return 1.0
"""


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_chat_openai_bind_tools(tiny, tmp_path, stream):
    _, tok = tiny
    engine = ScriptedEngine(tok, [ADD_CALL, "The answer is 4."])
    res = run_agent(tok, agent_module(tmp_path, LANGCHAIN.format(stream=stream)), engine)
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 2
    env = check_tokens_match_engine(res, engine)
    assert tok.decode(env[0]).startswith("\n<|im_start|>tool\n4<|im_end|>")


def test_hanging_up_mid_stream_aborts_the_session(tiny, tmp_path):
    _, tok = tiny
    path = agent_module(
        tmp_path,
        """
import json, socket, time

def agent(base_url, api_key, prompt):
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    path = "/" + base_url.split("//")[1].split("/", 1)[1] + "/chat/completions"
    body = json.dumps({"model": "policy", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer {api_key}\\r\\n"
              f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n".encode() + body)
    assert b"200 OK" in s.recv(4096)  # the stream started (its first chunk), then the agent hangs up
    s.close()
    time.sleep(0.6)
    return 1.0
""",
    )
    res = run_agent(tok, path, ScriptedEngine(tok, ["hello"], delay_s=0.3))
    assert res.finish_reason == "abort" and "dropped its connection" in res.abort_reason and res.reward is None
