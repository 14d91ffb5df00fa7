"""The agent endpoint's text side: the neutral message form every API shape is converted to, tool calls parsed
from a model turn's text, and messages rendered with the tokenizer's chat template.

The neutral form is the OpenAI chat message: `{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}` with
`tool_calls` as `[{"id", "type": "function", "function": {"name", "arguments": json-string}}]`; tools are OpenAI
chat function tools `{"type": "function", "function": {"name", "description", "parameters"}}`. The adapters
(api.py and one module per API shape) convert their API's requests into it; the session (session.py) keeps its
history in it. See docs/agents.md.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from sluiceway.infra.errors import UserError

FLAG = "--agent-function-path"
# Stands in for the last assistant turn when a call's new messages are rendered: the text the template puts
# after it is the turn's closing, then the new messages, then the next assistant header.
_SENTINEL = "\u2063SLUICEWAY-ASSISTANT-TURN\u2063"
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
TOOLS_SYSTEM_PROMPT = (
    "# Tools\nYou may call these functions:\n<tools>\n{tools}\n</tools>\n"
    'To call one, write <tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>'
)
TEXT_PARTS = ("text", "input_text", "output_text")  # chat, Responses input, Responses output
MAX_JSON_DEPTH = 64  # objects and lists nested deeper in a body (or a model's tool call) are refused


class SessionError(Exception):
    """A request the session refuses: `status` is the HTTP status (the adapter gives the body its API's shape)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------------ strict JSON
def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number: numbers must be finite")


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = s[e.start]
            raise ValueError(f"a string holds a lone surrogate (\\u{ord(bad):04x}): not valid Unicode") from None


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """ValueError unless `value` is JSON that any client can read back: finite numbers, strings that are valid
    Unicode (no lone surrogate), at most `max_depth` objects and lists nested. Walked without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > max_depth:
                raise ValueError(f"objects and lists are nested more than {max_depth} deep")
            if isinstance(v, dict):
                for k, x in v.items():
                    _check_text(k)
                    stack.append((x, depth + 1))
            else:
                stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, str):
            _check_text(v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"the number {v} is out of range: numbers must be finite")


def loads_strict(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON as the agent endpoint reads it (a body, a model's tool call): ValueError naming what is wrong for
    anything `check_json_value` refuses (NaN, Infinity, 1e999, a lone surrogate, nesting beyond `max_depth`), as
    for text that is not JSON at all."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"objects and lists are nested more than {max_depth} deep") from None
    check_json_value(value, max_depth)
    return value


# ------------------------------------------------------------------------------------------ tool calls
def _arguments(obj: dict) -> dict | None:
    """A `<tool_call>` block's arguments as an object: absent is {}, a JSON string is parsed; else None."""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_strict(args) if args.strip() else {}
        except ValueError:
            return None
    return args if isinstance(args, dict) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a model turn's text: Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>`.

    Blocks that are not a JSON object with a string "name" and object "arguments" stay in the content as text."""
    calls, kept = [], []
    pos = 0
    for m in TOOL_CALL_RE.finditer(text):
        try:  # a block holding NaN or nested past MAX_JSON_DEPTH is text: no API answer could carry it
            obj = loads_strict(m.group(1))
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = _arguments(obj)
        if args is None:
            continue
        calls.append({"id": new_id("call_"), "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})  # fmt: skip
        kept.append(text[pos : m.start()])
        pos = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[pos:]).strip()
    return content or None, calls


def content_text(content: Any, where: str = "message content") -> str:
    """Content as text: a string, None, or a list of text parts ({"type": "text" | "input_text" | "output_text"}).
    Any other part (an image, a file, audio) is refused: the policy is a text model."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in TEXT_PARTS or not isinstance(p.get("text"), str):
                raise SessionError(f"{where}: only text parts are supported, got {kind or type(p).__name__!r}")
            out.append(p["text"])
        return "".join(out)
    raise SessionError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def tool_call_list(m: dict) -> list[tuple[str, Any]]:
    """(name, arguments) of a neutral message's tool calls, the arguments parsed when they are JSON."""
    out = []
    for c in m.get("tool_calls") or []:
        f = (c.get("function") if isinstance(c, dict) else None) or {}
        args = f.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((f.get("name"), args))
    return out


def message_key(m: dict) -> tuple:
    """What must stay equal when a message comes back in a later call (ids and extra fields may change)."""
    role = m.get("role")
    return ("system" if role == "developer" else role, content_text(m.get("content")),
            json.dumps(tool_call_list(m), sort_keys=True, default=str))  # fmt: skip


def check_tool_calls(calls: Any, where: str) -> None:
    """A neutral message's `tool_calls`: absent, or a list of `{"id"?, "type": "function", "function": {"name",
    "arguments"?: a JSON string}}` (anything else was trained as a call to nothing: issue 40)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise SessionError(f"{where}: expected a list of tool calls, got {type(calls).__name__}")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function":
            raise SessionError(f"{where}[{j}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}, "
                               f"got {type(c).__name__ if not isinstance(c, dict) else c.get('type')!r}")  # fmt: skip
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise SessionError(f"{where}[{j}].function.name: expected a non-empty string")
        if f.get("arguments") is not None and not isinstance(f["arguments"], str):
            raise SessionError(f"{where}[{j}].function.arguments: expected a JSON string")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise SessionError(f"{where}[{j}].id: expected a string")


def check_messages(messages: Any, where: str = "messages") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SessionError(f"{where} must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SessionError(f"{where}[{i}]: expected an object with a string 'role'")
        check_tool_calls(m.get("tool_calls"), f"{where}[{i}].tool_calls")
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise SessionError(f"{where}[{i}].{k}: expected a string, got {type(m[k]).__name__}")
    return messages


def check_tools(tools: Any) -> list[dict] | None:
    """OpenAI chat function tools, or None."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise SessionError("tools must be a list")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise SessionError(f"tools[{i}]: only function tools are supported, got {kind!r}")
        if not isinstance(f.get("name"), str):
            raise SessionError(f"tools[{i}]: a function tool needs a string 'name'")
    return tools


def function_tool(name: Any, description: Any, parameters: Any) -> dict:
    """A neutral (chat) function tool."""
    f: dict = {"name": name}
    if description:
        f["description"] = description
    f["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": f}


# ------------------------------------------------------------------------------------------ rendering
class ChatRenderer:
    """Messages to text with the tokenizer's chat template. A template that knows no `tools` gets them as the
    Hermes system block above; one that knows no `tool_calls` gets an assistant message's calls as
    `<tool_call>` text (the format the model is asked to write and the proxy parses)."""

    def __init__(self, tokenizer):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise UserError(f"{FLAG}: the tokenizer has no chat template; agents need one for chat calls")
        self.tokenizer = tokenizer
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template

    def normalize(self, messages: list[dict], tools: list | None) -> list[dict]:
        out = []
        for i, m in enumerate(check_messages(messages)):
            role = "system" if m["role"] == "developer" else m["role"]
            d = {"role": role, "content": content_text(m.get("content"), f"messages[{i}].content")}
            if m.get("tool_calls"):
                if self.native_tool_calls:
                    d["tool_calls"] = m["tool_calls"]
                else:
                    d["content"] += "".join(
                        "\n<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
                        for n, a in tool_call_list(m)
                    )
            for k in ("name", "tool_call_id"):
                if k in m:
                    d[k] = m[k]
            out.append(d)
        if tools and not self.native_tools:
            block = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, separators=(",", ":")) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + block)
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = True) -> str:
        kw = {"tools": tools} if tools and self.native_tools else {}
        normalized = self.normalize(messages, tools)
        try:
            return self.tokenizer.apply_chat_template(
                normalized, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
            )
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError and the like: the messages, not the run
            raise SessionError(f"the chat template refused the messages: {type(e).__name__}: {str(e)[:300]}") from None

    def new_messages_text(self, history: list[dict], new: list[dict], tools: list | None) -> str:
        """The text after the model's last turn (`history[-1]`, an assistant message): its closing as the
        template writes it, the new messages, the next assistant header."""
        stand_in = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]
        text = self.render(stand_in + list(new), tools)
        at = text.find(_SENTINEL)
        if at < 0:
            raise SessionError("the chat template does not render assistant content verbatim", 500)
        return text[at + len(_SENTINEL) :]
