"""The OpenAI Responses API at `{base_url}/responses` (what the OpenAI Agents SDK's default model calls).

Request: `input` (a string, or a list of items: messages with text content, `function_call`,
`function_call_output`), `instructions` (the first message, a system one), function `tools`, `tool_choice`
(`"none"` leaves the text unparsed; the others are accepted, not enforced: the policy is sampled as it is),
`max_output_tokens`, `previous_response_id` (a response of the same session: its conversation, without its
instructions, comes before `input`), `stream`. Answer: a `response` object whose `output` is a `message` item
(`output_text`) and/or `function_call` items; `status` `incomplete` (`max_output_tokens`) when the turn ran out of
tokens. Streaming sends OpenAI's events: `response.created`, `response.in_progress`, per item
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done` (messages) or `response.function_call_arguments.delta`
..., `response.function_call_arguments.done` (calls), `response.output_item.done`, then `response.completed` (or
`response.incomplete`; `response.failed` when the turn failed). No `[DONE]`: the Responses API sends none.
"""

from __future__ import annotations

import copy
from typing import Any

from sluiceway.tasks.rollout.agent.api import Adapter, Call, int_or_none, model_name, pieces, sse
from sluiceway.tasks.rollout.agent.render import SessionError, content_text, function_tool, new_id
from sluiceway.tasks.rollout.agent.session import AgentSession, ModelTurn, TurnRequest

STATE = "responses"  # session.state[STATE]: response id -> its conversation (neutral messages, no instructions)
ROLES = ("user", "system", "developer", "assistant")
UNSUPPORTED = ("conversation", "background", "prompt")


def input_messages(items: Any) -> list[dict]:
    """Responses `input` as neutral messages. A run of `function_call` items joins the assistant message before
    it (one model turn's output is a message item and/or call items), or makes one."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise SessionError("input must be a string or a list of items")
    out: list[dict] = []
    prev_assistant = False  # the last message came from a model turn's output items
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise SessionError(f"input[{i}]: expected an object")
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ROLES:
                raise SessionError(f"input[{i}]: role must be one of {', '.join(ROLES)}, got {role!r}")
            out.append({"role": role, "content": content_text(it.get("content"), f"input[{i}].content")})
            prev_assistant = role == "assistant"
        elif kind == "function_call":
            if not isinstance(it.get("name"), str):
                raise SessionError(f"input[{i}]: a function_call needs a string 'name'")
            args = it.get("arguments")
            if args is not None and not isinstance(args, str):
                raise SessionError(f"input[{i}]: a function_call's 'arguments' must be a JSON string")
            call = {"id": str(it.get("call_id") or it.get("id") or ""), "type": "function",
                    "function": {"name": it["name"], "arguments": args if isinstance(args, str) else "{}"}}  # fmt: skip
            if not prev_assistant:
                out.append({"role": "assistant", "content": ""})
                prev_assistant = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = it.get("output")
            text = output if isinstance(output, str) else content_text(output, f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": str(it.get("call_id") or ""), "content": text})
            prev_assistant = False
        else:
            raise SessionError(f"input[{i}]: items of type {kind!r} are not supported (messages, function_call, "
                               "function_call_output)")  # fmt: skip
    return out


def neutral_tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise SessionError("tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise SessionError(f"tools[{i}]: only function tools ({{'type': 'function', 'name', 'parameters'}}) "
                               f"are supported, got {kind!r}")  # fmt: skip
        out.append(function_tool(t["name"], t.get("description"), t.get("parameters")))
    return out


class Responses(Adapter):
    name = "responses"
    paths = ("/responses",)

    def parse(self, session: AgentSession, body: dict) -> Call:
        for k in UNSUPPORTED:
            if body.get(k):
                raise SessionError(f"{k} is not supported: a session's conversation is its input and "
                                   "previous_response_id")  # fmt: skip
        if "input" not in body:
            raise SessionError("input is required")
        known = session.state.setdefault(STATE, {})
        prev = body.get("previous_response_id")
        before: list[dict] = []
        if prev is not None:
            if not isinstance(prev, str):  # a list or an object was a 500, a number a 404 (issue 40)
                raise SessionError(f"previous_response_id must be a string, got {type(prev).__name__}")
            if prev not in known:
                raise SessionError(f"previous response {prev!r} not found in this session", 404)
            before = known[prev]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise SessionError("instructions must be a string")
        metadata = body.get("metadata")  # echoed in the answer: string keys and values, as OpenAI's API takes
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise SessionError("metadata must be an object of string values")
        conversation = before + input_messages(body["input"])
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
        req = TurnRequest(messages=messages, tools=neutral_tools(body.get("tools")),
                          max_tokens=int_or_none(body, "max_output_tokens"),
                          parse_tools=body.get("tool_choice") != "none")  # fmt: skip
        call = Call(req, body, bool(body.get("stream")), model_name(body), new_id("resp_"))
        call.extra.update(conversation=conversation, session=session)
        return call

    # ---------------------------------------------------------------------------- the response object
    def _items(self, call: Call, turn: ModelTurn) -> list[dict]:
        if "items" in call.extra:
            return call.extra["items"]
        status = "completed" if turn.finish_reason == "stop" else "incomplete"
        items = []
        if turn.content or not turn.tool_calls:
            part = {"type": "output_text", "text": turn.content or "", "annotations": [], "logprobs": []}
            items.append({"id": new_id("msg_"), "type": "message", "role": "assistant", "status": status,
                          "content": [part]})  # fmt: skip
        for c in turn.tool_calls:
            items.append({"id": new_id("fc_"), "type": "function_call", "call_id": c["id"],
                          "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                          "status": "completed"})  # fmt: skip
        call.extra["items"] = items
        return items

    def _response(self, call: Call, status: str, output: list, turn: ModelTurn | None = None) -> dict:
        body = call.body
        out = {
            "id": call.id, "object": "response", "created_at": call.created, "status": status,
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": call.model, "output": output,
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "previous_response_id": body.get("previous_response_id"), "reasoning": None, "store": True,
            "temperature": None, "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": None, "truncation": "disabled", "usage": None,
            "user": None, "metadata": body.get("metadata") or {},
        }  # fmt: skip
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if turn is not None:
            n = len(turn.token_ids)
            out["usage"] = {"input_tokens": turn.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": turn.prompt_tokens + n}  # fmt: skip
        return out

    def _done(self, call: Call, turn: ModelTurn) -> dict:
        """The finished response; its conversation is kept for a later `previous_response_id`."""
        session: AgentSession = call.extra["session"]
        session.state.setdefault(STATE, {})[call.id] = call.extra["conversation"] + [turn.message]
        status = "completed" if turn.finish_reason == "stop" else "incomplete"
        return self._response(call, status, self._items(call, turn), turn)

    def reply(self, call: Call, turn: ModelTurn) -> dict:
        return self._done(call, turn)

    # ---------------------------------------------------------------------------- streaming
    def _event(self, call: Call, kind: str, **fields) -> str:
        seq = call.extra.get("seq", 0)
        call.extra["seq"] = seq + 1
        return sse({"type": kind, "sequence_number": seq, **fields}, kind)

    def stream_head(self, call: Call, session: AgentSession) -> list[str]:
        started = self._response(call, "in_progress", [])
        return [self._event(call, "response.created", response=started),
                self._event(call, "response.in_progress", response=started)]  # fmt: skip

    def stream_turn(self, call: Call, turn: ModelTurn) -> list[str]:
        final = self._done(call, turn)
        ev = self._event
        out = []
        for idx, item in enumerate(final["output"]):
            iid = item["id"]
            opening = copy.deepcopy(item)
            opening["status"] = "in_progress"
            if item["type"] == "message":
                opening["content"] = []
                part = item["content"][0]
                text = part["text"]
                empty = dict(part, text="")
                out.append(ev(call, "response.output_item.added", output_index=idx, item=opening))
                out.append(ev(call, "response.content_part.added", item_id=iid, output_index=idx, content_index=0,
                              part=empty))  # fmt: skip
                out += [ev(call, "response.output_text.delta", item_id=iid, output_index=idx, content_index=0,
                           delta=p, logprobs=[]) for p in pieces(text)]  # fmt: skip
                out.append(ev(call, "response.output_text.done", item_id=iid, output_index=idx, content_index=0,
                              text=text, logprobs=[]))  # fmt: skip
                out.append(ev(call, "response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                              part=part))  # fmt: skip
            else:
                opening["arguments"] = ""
                out.append(ev(call, "response.output_item.added", output_index=idx, item=opening))
                out += [ev(call, "response.function_call_arguments.delta", item_id=iid, output_index=idx, delta=p)
                        for p in pieces(item["arguments"])]  # fmt: skip
                out.append(ev(call, "response.function_call_arguments.done", item_id=iid, output_index=idx,
                              name=item["name"], arguments=item["arguments"]))  # fmt: skip
            out.append(ev(call, "response.output_item.done", output_index=idx, item=item))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(ev(call, kind, response=final))
        return out

    def stream_error(self, call: Call, message: str, status: int) -> list[str]:
        failed = self._response(call, "failed", [])
        failed["error"] = {"code": "server_error" if status >= 500 else "invalid_request", "message": message}
        return [self._event(call, "response.failed", response=failed)]
