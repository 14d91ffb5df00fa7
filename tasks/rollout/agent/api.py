"""What an API shape is to the agent endpoint: one `Adapter` (openai.py, responses.py, anthropic.py).

An adapter converts its API's request into a `TurnRequest` of neutral messages (`parse`), and the session's
`ModelTurn` back into its API's answer: one JSON body (`reply`), or server-sent events (`stream_head` before the
engine answers, `stream_turn` after, `stream_error` when the turn fails, `keepalive` while it runs). The server
(server.py) does the rest: the route, the key, the body, the session's lock, the stream. Adding an API
shape is adding an adapter to `ADAPTERS` in server.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sluiceway.tasks.rollout.agent.render import SessionError
from sluiceway.tasks.rollout.agent.session import AgentSession, ModelTurn, TurnRequest

DELTA_CHARS = 24  # a streamed text is sent in pieces of this many characters


@dataclass
class Call:
    """One request as an adapter parsed it: the neutral request and what the answer needs of the body."""

    req: TurnRequest
    body: dict
    stream: bool = False
    model: str = "policy"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    extra: dict = field(default_factory=dict)


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (when named) and one `data:` line of JSON (ValueError for what JSON
    cannot carry: NaN, infinity)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"


def encode(data: Any) -> bytes:
    """An answer's body as it is sent: JSON in UTF-8, or ValueError (NaN, infinity, a lone surrogate): the server
    serialises every answer before the call counts as answered (server.py)."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def model_name(body: dict) -> str:
    """The request's `model`, echoed in the answer (not checked against anything): a string, or "policy"."""
    model = body.get("model")
    if model is None or model == "":
        return "policy"
    if not isinstance(model, str):
        raise SessionError(f"model must be a string, got {type(model).__name__}")
    return model


def pieces(text: str, n: int = DELTA_CHARS) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def int_or_none(body: dict, *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SessionError(f"{name} must be a positive integer, got {v!r}")
        return v
    return None


def stop_list(v: Any, name: str) -> list[str] | None:
    if v is None or v == []:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise SessionError(f"{name} must be a non-empty string or a list of them")
    return v


class Adapter:
    """One API shape (see module doc). `paths` are under `/v1` of a session's prefix or of the root."""

    name = "api"
    paths: tuple[str, ...] = ()

    def parse(self, session: AgentSession, body: dict) -> Call:
        raise NotImplementedError

    def reply(self, call: Call, turn: ModelTurn) -> dict:
        raise NotImplementedError

    def stream_head(self, call: Call, session: AgentSession) -> list[str]:
        return []

    def stream_turn(self, call: Call, turn: ModelTurn) -> list[str]:
        raise NotImplementedError

    def stream_error(self, call: Call, message: str, status: int) -> list[str]:
        return [sse({"error": self.error_body(message, status)["error"]})]

    def keepalive(self) -> str:
        return ": keepalive\n\n"  # an SSE comment: every client skips it

    def error_body(self, message: str, status: int) -> dict:
        """OpenAI's error shape; an adapter of another API overrides it."""
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
