"""A stand-alone agent that knows nothing of sluiceway: configured only through its environment, as coding agents
are run (examples/agent_harnesses.py runs it in a process of its own for each session).

    echo "What is 2 + 3?" | OPENAI_BASE_URL=... OPENAI_API_KEY=... python agent_blackbox.py openai
    echo "What is 2 + 3?" | ANTHROPIC_BASE_URL=... ANTHROPIC_API_KEY=... python agent_blackbox.py anthropic

The question is read from stdin; two model turns (the second after the `add` tool's result, or after a follow-up
question when the model called no tool); the last line printed is the answer.
"""

from __future__ import annotations

import json
import sys

SYSTEM = "Use the add tool, then answer as 'The answer is N.'"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def add(args) -> str:
    try:
        args = json.loads(args) if isinstance(args, str) else args
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, TypeError, KeyError):
        return "error: add takes two integers a and b"


def with_openai(question: str) -> str:
    import openai

    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY
    tools = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=8)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": add(call.function.arguments)})
    if not message.tool_calls:
        messages.append({"role": "user", "content": "So, the final answer?"})
    reply = client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=8)
    return reply.choices[0].message.content or ""


def with_anthropic(question: str) -> str:
    import anthropic

    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
    tools = [{"name": "add", "description": "Adds two integers.", "input_schema": SCHEMA}]
    messages = [{"role": "user", "content": question}]
    message = client.messages.create(model="policy", system=SYSTEM, messages=messages, tools=tools, max_tokens=8)
    messages.append({"role": "assistant", "content": message.content})
    uses = [b for b in message.content if b.type == "tool_use"]
    if uses:
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                      "content": add(b.input)} for b in uses]})  # fmt: skip
    else:
        messages.append({"role": "user", "content": "So, the final answer?"})
    message = client.messages.create(model="policy", system=SYSTEM, messages=messages, tools=tools, max_tokens=8)
    return "".join(b.text for b in message.content if b.type == "text")


if __name__ == "__main__":
    answer = (with_anthropic if sys.argv[1:] == ["anthropic"] else with_openai)(sys.stdin.read().strip())
    print(answer.replace("\n", " "))
