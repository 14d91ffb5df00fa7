"""Agents written with harnesses nobody in sluiceway wrote, each pointed at a run's session, trained as they are.

    sluiceway run --prompt-data env:arithmetic --hf-checkpoint tiny-llama \\
        --agent-function-path examples/agent_harnesses.py:anthropic_tools --rollout-max-prompt-len 320 ...

Every function here takes (base_url, api_key, prompt) and is an `--agent-function-path` of its own (function,
harness, how it is pointed at the session):

    agents_sdk          OpenAI Agents SDK, its default model OpenAIResponsesModel     AsyncOpenAI(base_url, key)
    agents_sdk_chat     OpenAI Agents SDK, OpenAIChatCompletionsModel                 AsyncOpenAI(base_url, key)
    openai_stream       openai client, chat completions, stream=True, tools           OpenAI(base_url, key)
    responses_stream    openai client, Responses API streamed, previous_response_id   OpenAI(base_url, key)
    langchain           LangChain ChatOpenAI(...).bind_tools([...])                   ChatOpenAI(base_url, key)
    langchain_stream    the same, streamed                                            ChatOpenAI(base_url, key)
    anthropic_tools     anthropic client, Messages API with tools                     Anthropic(base_url less /v1)
    anthropic_stream    the same, messages.stream(...)                                Anthropic(base_url less /v1)
    blackbox_openai     its own process (examples/agent_blackbox.py), openai client   OPENAI_BASE_URL/_API_KEY
    blackbox_anthropic  the same process, anthropic client                            ANTHROPIC_BASE_URL/_API_KEY

Each offers an `add` tool, runs what the model asks for (an untrained model seldom asks), asks once more, and
returns a reward for the last answer: 1.0 when it holds the label, else a little credit for digits. A harness that
raises on a cut-off turn (the Agents SDK with the Responses model raises on status `incomplete`, as against
OpenAI's API) ends the session there: the turns it had are the sample.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

MAX_TOKENS = 8  # per model turn
SYSTEM = "Use the add tool, then answer as 'The answer is N.'"
FOLLOW_UP = "So, the final answer?"
BLACKBOX = Path(__file__).with_name("agent_blackbox.py")
INT = {"type": "integer"}
ADD_SCHEMA = {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                                "parameters": ADD_SCHEMA}}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Adds two integers.", "parameters": ADD_SCHEMA}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "Adds two integers.", "input_schema": ADD_SCHEMA}]


def question(prompt: dict) -> str:
    p = prompt["prompt"]
    return p if isinstance(p, str) else p[-1]["content"]


def add(arguments) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, TypeError, KeyError):
        return "error: add takes two integers a and b"


def score(answer: str | None, label) -> float:
    numbers = re.findall(r"-?\d+", answer or "")
    if label is not None and numbers and numbers[-1] == str(label).strip():
        return 1.0
    return 0.2 * sum(c.isdigit() for c in answer or "") / max(len(answer or ""), 1)


# ------------------------------------------------------------------------------------------ OpenAI Agents SDK
def _sdk_agent(model):
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers otherwise

    @function_tool
    def add_tool(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    return Agent(name="calculator", instructions=SYSTEM, model=model, tools=[add_tool],
                 model_settings=ModelSettings(max_tokens=MAX_TOKENS))  # fmt: skip


async def agents_sdk(base_url: str, api_key: str, prompt: dict) -> float:
    """The Agents SDK's default model class, OpenAIResponsesModel: the Responses API."""
    from agents import OpenAIResponsesModel, Runner
    from agents.exceptions import ModelBehaviorError
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = _sdk_agent(OpenAIResponsesModel(model="policy", openai_client=client))
    try:
        first = await Runner.run(agent, question(prompt), max_turns=3)
        last = await Runner.run(agent, FOLLOW_UP, previous_response_id=first.last_response_id, max_turns=2)
    except ModelBehaviorError as e:  # a turn cut at max_tokens: status "incomplete", which the SDK raises on
        if "incomplete" not in str(e):
            raise
        return 0.0
    return score(str(last.final_output), prompt.get("label"))


async def agents_sdk_chat(base_url: str, api_key: str, prompt: dict) -> float:
    from agents import OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = _sdk_agent(OpenAIChatCompletionsModel(model="policy", openai_client=client))
    first = await Runner.run(agent, question(prompt), max_turns=3)
    last = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": FOLLOW_UP}], max_turns=2)
    return score(str(last.final_output), prompt.get("label"))


# ------------------------------------------------------------------------------------------ the openai client
def openai_stream(base_url: str, api_key: str, prompt: dict) -> float:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(prompt)}]

    def ask() -> dict:
        content, calls = "", {}
        stream = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS,
                                                max_tokens=MAX_TOKENS, stream=True)  # fmt: skip
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for t in choice.delta.tool_calls or []:
                    c = calls.setdefault(t.index, {"id": t.id, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})  # fmt: skip
                    c["function"]["name"] += t.function.name or ""
                    c["function"]["arguments"] += t.function.arguments or ""
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(message)  # sent back as it came: the session's history only grows
        return message

    message = ask()
    for c in message.get("tool_calls", []):
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": add(c["function"]["arguments"])})
    if not message.get("tool_calls"):
        messages.append({"role": "user", "content": FOLLOW_UP})
    return score(ask()["content"], prompt.get("label"))


def responses_stream(base_url: str, api_key: str, prompt: dict) -> float:
    """The Responses API streamed; the second call sends only its new items, after previous_response_id."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)

    def ask(items, previous=None):
        final = None
        for event in client.responses.create(model="policy", input=items, instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                             max_output_tokens=MAX_TOKENS, previous_response_id=previous,
                                             stream=True):  # fmt: skip
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        return final

    r = ask(question(prompt))
    calls = [o for o in r.output if o.type == "function_call"]
    new = [{"type": "function_call_output", "call_id": c.call_id, "output": add(c.arguments)} for c in calls]
    r = ask(new or [{"role": "user", "content": FOLLOW_UP}], previous=r.id)
    return score(r.output_text, prompt.get("label"))


# ------------------------------------------------------------------------------------------ LangChain
def _langchain(base_url: str, api_key: str, prompt: dict, streaming: bool) -> float:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add_tool(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, max_tokens=MAX_TOKENS,
                     streaming=streaming)  # fmt: skip
    model = llm.bind_tools([add_tool])
    messages = [SystemMessage(SYSTEM), HumanMessage(question(prompt))]
    ai = model.invoke(messages)
    messages.append(ai)
    for call in ai.tool_calls:
        messages.append(ToolMessage(add(call["args"]), tool_call_id=call["id"]))
    if not ai.tool_calls:
        messages.append(HumanMessage(FOLLOW_UP))
    return score(str(model.invoke(messages).content), prompt.get("label"))


def langchain(base_url: str, api_key: str, prompt: dict) -> float:
    return _langchain(base_url, api_key, prompt, streaming=False)


def langchain_stream(base_url: str, api_key: str, prompt: dict) -> float:
    return _langchain(base_url, api_key, prompt, streaming=True)


# ------------------------------------------------------------------------------------------ anthropic
def _anthropic(base_url: str, api_key: str, prompt: dict, stream: bool) -> float:
    import anthropic

    # Anthropic's base URL is the session's, without /v1: the SDK adds /v1/messages.
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": question(prompt)}]

    def ask():
        kw = dict(model="policy", max_tokens=MAX_TOKENS, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages)
        if stream:
            with client.messages.stream(**kw) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        return message

    message = ask()
    uses = [b for b in message.content if b.type == "tool_use"]
    if uses:
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                      "content": add(b.input)} for b in uses]})  # fmt: skip
    else:
        messages.append({"role": "user", "content": FOLLOW_UP})
    final = ask()
    return score("".join(b.text for b in final.content if b.type == "text"), prompt.get("label"))


def anthropic_tools(base_url: str, api_key: str, prompt: dict) -> float:
    return _anthropic(base_url, api_key, prompt, stream=False)


def anthropic_stream(base_url: str, api_key: str, prompt: dict) -> float:
    return _anthropic(base_url, api_key, prompt, stream=True)


# ------------------------------------------------------------------------------------------ a black box
def _blackbox(base_url: str, api_key: str, prompt: dict, api: str) -> float:
    """A separate process that knows nothing of sluiceway, configured only through its environment (as coding
    agents are run); its last line of output is its answer. `run_harness` starts it in namespaces of its own, where
    no other session's harness can read its key (docs/agents.md, Security)."""
    from sluiceway.tasks.rollout.agent.harness import run_harness

    proc = run_harness([sys.executable, str(BLACKBOX), api], base_url, api_key, input=question(prompt))
    if proc.returncode != 0:
        raise RuntimeError(f"{BLACKBOX.name} {api} exited {proc.returncode}: {proc.stderr[-1000:]}")
    lines = proc.stdout.strip().splitlines()
    return score(lines[-1] if lines else "", prompt.get("label"))


def blackbox_openai(base_url: str, api_key: str, prompt: dict) -> float:
    return _blackbox(base_url, api_key, prompt, "openai")


def blackbox_anthropic(base_url: str, api_key: str, prompt: dict) -> float:
    return _blackbox(base_url, api_key, prompt, "anthropic")


HARNESSES = {f.__name__: f for f in (agents_sdk, agents_sdk_chat, openai_stream, responses_stream, langchain,
                                     langchain_stream, anthropic_tools, anthropic_stream, blackbox_openai,
                                     blackbox_anthropic)}  # fmt: skip
