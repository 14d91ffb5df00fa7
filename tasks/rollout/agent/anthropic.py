"""Anthropic's Messages API at `{session}/v1/messages` (what the `anthropic` SDK calls with `base_url={session}`).

Request: `system` (a string or text blocks), `messages` (`user`/`assistant`, content a string or blocks: `text`,
`tool_use`, `tool_result`), `tools` (`name`, `description`, `input_schema`), `tool_choice` (`{"type": "none"}`
leaves the text unparsed; `auto`/`any`/`tool` are accepted, not enforced), `stop_sequences`, `max_tokens`
(required, as in Anthropic's API), `stream`. Answer: a `message` whose `content` is a `text` block and/or
`tool_use` blocks, `stop_reason` `end_turn`, `tool_use`, `stop_sequence` or `max_tokens`. Errors have
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`). Streaming sends Anthropic's events:
`message_start`, per block `content_block_start`, `content_block_delta` (`text_delta` / `input_json_delta`)...,
`content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`; `ping` while the
engine works, `error` when the turn failed.

A `tool_result` block becomes a `tool` message (its `tool_use_id` the call id), a user message's text blocks one
user message after them; an assistant message's text blocks are its content and its `tool_use` blocks its calls.
"""

from __future__ import annotations

import json
from typing import Any

from sluiceway.tasks.rollout.agent.api import Adapter, Call, int_or_none, model_name, pieces, sse, stop_list
from sluiceway.tasks.rollout.agent.render import SessionError, content_text, function_tool, new_id
from sluiceway.tasks.rollout.agent.session import AgentSession, ModelTurn, TurnRequest

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise SessionError(f"{where}: expected a string or a list of content blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise SessionError(f"{where}[{j}]: expected a content block with a 'type'")
    return content


def input_messages(system: Any, messages: Any) -> list[dict]:
    """Anthropic's `system` and `messages` as neutral messages."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": content_text(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise SessionError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise SessionError(f"messages.{i}.role: expected 'user' or 'assistant', got {role!r}")
        blocks = _blocks(m.get("content"), f"messages.{i}.content")
        if role == "assistant":
            text, calls = [], []
            for j, b in enumerate(blocks):
                if b["type"] == "text":
                    text.append(str(b.get("text", "")))
                elif b["type"] == "tool_use":
                    if not isinstance(b.get("name"), str) or not b["name"] or not isinstance(b.get("input", {}), dict):
                        raise SessionError(f"messages.{i}.content.{j}: a tool_use block needs a string 'name' and an "
                                           "object 'input'")  # fmt: skip
                    calls.append(
                        {
                            "id": str(b.get("id", "")),
                            "type": "function",
                            "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))},
                        }
                    )
                else:
                    raise SessionError(f"messages.{i}.content.{j}: assistant blocks of type {b['type']!r} are not "
                                       "supported (text, tool_use)")  # fmt: skip
            msg: dict = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        text: list[str] = []
        for j, b in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            if b["type"] == "text":
                text.append(str(b.get("text", "")))
            elif b["type"] == "tool_result":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": content_text(b.get("content"), where)})  # fmt: skip
            else:
                raise SessionError(f"{where}: user blocks of type {b['type']!r} are not supported (text, tool_result)")
        if text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    return out


def neutral_tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise SessionError("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise SessionError(f"tools.{i}: only client tools with a name and an input_schema are supported, "
                               f"got type {kind!r}")  # fmt: skip
        out.append(function_tool(t["name"], t.get("description"), t.get("input_schema")))
    return out


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class Messages(Adapter):
    name = "messages"
    paths = ("/messages",)

    def parse(self, session: AgentSession, body: dict) -> Call:
        max_tokens = int_or_none(body, "max_tokens")
        if max_tokens is None:
            raise SessionError("max_tokens: Field required")
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
            raise SessionError("thinking is not supported: the policy's turns are its text and tool calls")
        choice = body.get("tool_choice")
        req = TurnRequest(messages=input_messages(body.get("system"), body.get("messages")),
                          tools=neutral_tools(body.get("tools")), max_tokens=max_tokens,
                          stop=stop_list(body.get("stop_sequences"), "stop_sequences"),
                          parse_tools=not (isinstance(choice, dict) and choice.get("type") == "none"))  # fmt: skip
        return Call(req, body, bool(body.get("stream")), model_name(body), new_id("msg_"))

    def _stop_reason(self, turn: ModelTurn) -> str:
        if turn.finish_reason != "stop":
            return "max_tokens"
        if turn.tool_calls:
            return "tool_use"
        return "stop_sequence" if turn.stop_sequence is not None else "end_turn"

    def _content(self, turn: ModelTurn) -> list[dict]:
        out: list[dict] = []
        if turn.content:
            out.append({"type": "text", "text": turn.content})
        for c in turn.tool_calls:
            out.append({"type": "tool_use", "id": _tool_use_id(c["id"]), "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])})  # fmt: skip
        return out

    def _message(self, call: Call, content: list, turn: ModelTurn | None, prompt_tokens: int) -> dict:
        done = turn is not None
        return {
            "id": call.id, "type": "message", "role": "assistant", "model": call.model, "content": content,
            "stop_reason": self._stop_reason(turn) if done else None,
            "stop_sequence": turn.stop_sequence if done else None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(turn.token_ids) if done else 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }  # fmt: skip

    def reply(self, call: Call, turn: ModelTurn) -> dict:
        return self._message(call, self._content(turn), turn, turn.prompt_tokens)

    def stream_head(self, call: Call, session: AgentSession) -> list[str]:
        start = self._message(call, [], None, len(session.buf.input_ids()) if session.buf else 0)
        return [sse({"type": "message_start", "message": start}, "message_start"), self.keepalive()]

    def stream_turn(self, call: Call, turn: ModelTurn) -> list[str]:
        out = []
        for i, block in enumerate(self._content(turn)):
            if block["type"] == "text":
                opening, deltas = (
                    dict(block, text=""),
                    [{"type": "text_delta", "text": p} for p in pieces(block["text"])],
                )
            else:
                opening = dict(block, input={})
                deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces(json.dumps(block["input"]))]
            out.append(
                sse({"type": "content_block_start", "index": i, "content_block": opening}, "content_block_start")
            )
            out += [sse({"type": "content_block_delta", "index": i, "delta": d}, "content_block_delta") for d in deltas]
            out.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
        delta = {"stop_reason": self._stop_reason(turn), "stop_sequence": turn.stop_sequence}
        out.append(sse({"type": "message_delta", "delta": delta, "usage": {"output_tokens": len(turn.token_ids)}},
                       "message_delta"))  # fmt: skip
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

    def stream_error(self, call: Call, message: str, status: int) -> list[str]:
        return [sse(self.error_body(message, status), "error")]

    def keepalive(self) -> str:
        return sse({"type": "ping"}, "ping")

    def error_body(self, message: str, status: int) -> dict:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
