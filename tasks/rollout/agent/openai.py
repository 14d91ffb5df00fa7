"""OpenAI chat completions (`{base_url}/chat/completions`) and legacy completions (`{base_url}/completions`).

Streaming follows OpenAI's chunk format: `chat.completion.chunk` objects whose `delta` holds the role, then the
content in pieces, then each tool call (`index`, `id`, `type`, `function.name`, then `function.arguments` in
pieces); the last chunk has the `finish_reason`; with `stream_options.include_usage` one more chunk with empty
`choices` and the `usage`; then `data: [DONE]`.
"""

from __future__ import annotations

from sluiceway.tasks.rollout.agent.api import Adapter, Call, int_or_none, model_name, pieces, sse, stop_list
from sluiceway.tasks.rollout.agent.render import SessionError, check_messages, check_tools, new_id
from sluiceway.tasks.rollout.agent.session import AgentSession, ModelTurn, TurnRequest

DONE = "data: [DONE]\n\n"


def _common(body: dict) -> dict:
    if body.get("n") not in (None, 1):
        raise SessionError("n must be 1: a session is one trajectory")
    return {
        "max_tokens": int_or_none(body, "max_completion_tokens", "max_tokens"),
        "stop": stop_list(body.get("stop"), "stop"),
    }


def _usage(turn: ModelTurn) -> dict:
    n = len(turn.token_ids)
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n, "total_tokens": turn.prompt_tokens + n}


def _include_usage(call: Call) -> bool:
    opts = call.body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


class ChatCompletions(Adapter):
    name = "chat.completions"
    paths = ("/chat/completions",)

    def parse(self, session: AgentSession, body: dict) -> Call:
        messages = check_messages(body.get("messages"))
        choice = body.get("tool_choice")
        req = TurnRequest(messages=messages, tools=check_tools(body.get("tools")), parse_tools=choice != "none",
                          **_common(body))  # fmt: skip
        return Call(req, body, bool(body.get("stream")), model_name(body), new_id("chatcmpl-"))

    def _finish(self, turn: ModelTurn) -> str:
        return "tool_calls" if turn.tool_calls and turn.finish_reason == "stop" else turn.finish_reason

    def reply(self, call: Call, turn: ModelTurn) -> dict:
        return {
            "id": call.id,
            "object": "chat.completion",
            "created": call.created,
            "model": call.model,
            "choices": [{"index": 0, "message": turn.message, "finish_reason": self._finish(turn), "logprobs": None}],
            "usage": _usage(turn),
        }

    def _chunk(self, call: Call, delta: dict, finish: str | None = None) -> str:
        chunk = {"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}  # fmt: skip
        if _include_usage(call):
            chunk["usage"] = None
        return sse(chunk)

    def stream_head(self, call: Call, session: AgentSession) -> list[str]:
        return [self._chunk(call, {"role": "assistant", "content": ""})]

    def stream_turn(self, call: Call, turn: ModelTurn) -> list[str]:
        out = [self._chunk(call, {"content": p}) for p in pieces(turn.content or "")]
        for i, c in enumerate(turn.tool_calls):
            f = c["function"]
            head = {"index": i, "id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": ""}}
            out.append(self._chunk(call, {"tool_calls": [head]}))
            out += [self._chunk(call, {"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                    for p in pieces(f["arguments"])]  # fmt: skip
        out.append(self._chunk(call, {}, self._finish(turn)))
        if _include_usage(call):
            out.append(sse({"id": call.id, "object": "chat.completion.chunk", "created": call.created,
                            "model": call.model, "choices": [], "usage": _usage(turn)}))  # fmt: skip
        return out + [DONE]


class Completions(Adapter):
    name = "completions"
    paths = ("/completions",)

    def parse(self, session: AgentSession, body: dict) -> Call:
        req = TurnRequest(prompt=body.get("prompt"), **_common(body))
        return Call(req, body, bool(body.get("stream")), model_name(body), new_id("cmpl-"))

    def reply(self, call: Call, turn: ModelTurn) -> dict:
        return {
            "id": call.id,
            "object": "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [{"index": 0, "text": turn.text, "finish_reason": turn.finish_reason, "logprobs": None}],
            "usage": _usage(turn),
        }

    def _chunk(self, call: Call, text: str, finish: str | None = None) -> str:
        return sse({"id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]})  # fmt: skip

    def stream_turn(self, call: Call, turn: ModelTurn) -> list[str]:
        out = [self._chunk(call, p) for p in pieces(turn.text)]
        out.append(self._chunk(call, "", turn.finish_reason))
        if _include_usage(call):
            out.append(sse({"id": call.id, "object": "text_completion", "created": call.created,
                            "model": call.model, "choices": [], "usage": _usage(turn)}))  # fmt: skip
        return out + [DONE]


# ------------------------------------------------------------------------------------------ without the server
async def chat(session: AgentSession, body: dict) -> dict:
    """A chat completions call on `session` (the adapter's answer), for callers holding no server."""
    api = ChatCompletions()
    call = api.parse(session, body)
    return api.reply(call, await session.turn(call.req))


async def complete(session: AgentSession, body: dict) -> dict:
    """A completions call on `session` (the adapter's answer), for callers holding no server."""
    api = Completions()
    call = api.parse(session, body)
    return api.reply(call, await session.turn(call.req))
