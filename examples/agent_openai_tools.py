"""A tool-using agent written with the official `openai` package, trained by sluiceway as it is.

    sluiceway run --prompt-data env:arithmetic --hf-checkpoint tiny-llama \\
        --agent-function-path examples/agent_openai_tools.py:agent --rollout-max-response-len 160 ...

The run calls `agent(base_url, api_key, prompt)` once per sample; the agent talks to the policy through the
run's OpenAI-compatible endpoint (docs/agents.md), which records every token. Three turns:

1. the question, with a `calculator` tool offered; the model's tool calls are run (`<tool_call>` blocks, parsed
   by the endpoint into `tool_calls`). An untrained model seldom writes one, so when it does not, the agent looks
   the expression up itself and sends the calculator's result as a `tool` message all the same;
2. a `user` message asking for the final answer;
3. the model's final answer, scored here: 1.0 when it holds the label, else a little credit for answering in
   digits at all. The reward is POSTed to the session's reward endpoint.

Only the model's own tokens are trained on; the tool's and the user's are masked out by the endpoint.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import httpx
import openai

SYSTEM = "Use the calculator tool, then answer as 'The answer is N.'"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
MAX_TOKENS = 8  # per model turn
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    """Arithmetic only (an AST walk, never eval)."""

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("unsupported expression")

    try:
        value = walk(ast.parse(str(expression)[:200].strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def score(answer: str, label: str | None) -> float:
    numbers = re.findall(r"-?\d+", answer or "")
    if label is not None and numbers and numbers[-1] == str(label).strip():
        return 1.0
    return 0.2 * sum(c.isdigit() for c in answer or "") / max(len(answer or ""), 1)


def agent(base_url: str, api_key: str, prompt: dict) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    question = prompt["prompt"] if isinstance(prompt["prompt"], str) else prompt["prompt"][-1]["content"]
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    def ask():
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS)
        message = reply.choices[0].message
        messages.append(message)  # sent back as it came: the session's history only grows
        return message

    # Turn 1: the question; run what the model asked for, or the calculator on the question's expression.
    message = ask()
    calls = message.tool_calls or []
    for call in calls:
        try:
            expression = json.loads(call.function.arguments).get("expression", "")
        except (ValueError, AttributeError):
            expression = ""
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(expression)})
    if not calls:
        found = re.search(r"\d[\d\s+\-*/().]*\d|\d", question)
        result = calculator(found.group(0)) if found else "error: no expression"
        messages.append({"role": "tool", "tool_call_id": "agent-lookup", "content": result})
    # Turn 2: the model sees the tool's result; then the user asks for the final answer.
    ask()
    messages.append({"role": "user", "content": "So, the final answer?"})
    # Turn 3: the answer, scored and reported.
    final = ask().content or ""
    reward_url = base_url.removesuffix("/v1") + "/reward"
    r = httpx.post(reward_url, json={"reward": score(final, prompt.get("label"))},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=30)  # fmt: skip
    r.raise_for_status()
