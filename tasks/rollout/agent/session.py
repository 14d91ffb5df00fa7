"""One agent session: a trajectory's token list, grown turn by turn whatever API shape the agent speaks.

Token in, token out: the first call's messages are rendered by the chat template and encoded (the prompt); every
model turn appends the engine's ids verbatim (loss mask 1, the engine's log-probs); a later call must repeat the
history it was given and add messages after it, and only those new messages are rendered and encoded (loss mask
0, log-prob 0.0). Earlier turns are never re-tokenized. The adapters (api.py and one module per API shape) turn
their API's requests into a `TurnRequest` of neutral messages (render.py) and a `ModelTurn` back into their API's
answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from sluiceway.models.chat import encode_prompt
from sluiceway.storage.trajectories import reward_problem
from sluiceway.tasks.rollout.agent.render import (
    ChatRenderer,
    SessionError,
    check_messages,
    message_key,
    parse_tool_calls,
)
from sluiceway.tasks.rollout.multiturn import GenerateContext, TokenBuffer

DROPPED = "the agent dropped its connection during a model call"


@dataclass
class TurnRequest:
    """One model call in the neutral form: the whole conversation so far (the session checks it only grows)."""

    messages: list[dict] | None = None  # chat-shaped messages; None for a legacy completions call
    tools: list[dict] | None = None  # chat function tools
    max_tokens: int | None = None  # a cap on this turn's tokens
    stop: list[str] | None = None  # stop strings
    parse_tools: bool = True  # False (tool_choice "none"): the model's text stays text
    prompt: Any = None  # legacy completions: a string or a list of token ids


@dataclass
class ModelTurn:
    """What the engine answered, as text and tool calls; the session already holds its tokens."""

    text: str  # the model's text (special tokens skipped), less a matched stop string
    content: str | None  # the text less its tool calls
    tool_calls: list[dict]  # neutral (OpenAI chat) tool calls
    finish_reason: str  # "stop" | "length"
    stop_sequence: str | None  # the stop string that ended the turn, when one did
    token_ids: list[int]
    prompt_tokens: int  # the session's tokens before this turn

    @property
    def message(self) -> dict:
        m: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


@dataclass
class AgentSession:
    """One trajectory (see module doc); `result()` is its row's content."""

    sid: str
    ctx: GenerateContext
    params: dict
    renderer: ChatRenderer | None
    loop: asyncio.AbstractEventLoop | None = None  # the rollout's loop: model turns run there
    key: str = ""  # the session's own API key: opens this session's routes and no other
    # Other names an `X-Session-Id` header may give this session: a client that sends its own id there (verifiers
    # sends its trace's id, tasks/rollout/agent/verifiers.py) registers it; any other id is still a 404.
    aliases: set[str] = field(default_factory=set)
    gateway: bytes | None = None  # sha256 of the gateway key that may open it by an alias (server.py)
    ctx_prompt_ids: list[int] = field(default_factory=list)
    buf: TokenBuffer | None = None
    prompt_text: str = ""
    kind: str | None = None  # "messages" (chat, responses, messages) or "completion", fixed by the first call
    seen: list[tuple] = field(default_factory=list)  # keys of the messages the token list holds
    history: list[dict] = field(default_factory=list)  # those messages
    text_seen: str = ""  # completions: the prompt and completion text so far
    reward: float | None = None
    aborted: str | None = None  # why the session is stored as aborted
    refused: Exception | None = None  # WeightVersionRefused by the pool: the group goes elsewhere (proxy.py)
    closed: bool = False
    turns: list[dict] = field(default_factory=list)  # per model turn: rid, input length, ids, log-probs
    last_stop_token: int | None = None  # the stop token id that ended the last turn, when one did
    state: dict = field(default_factory=dict)  # the adapters' own (e.g. the Responses API's response ids)
    _pending: tuple | None = None  # messages and keys of the call being answered
    _lock: asyncio.Lock | None = None

    @property
    def tokenizer(self):
        return self.ctx.tokenizer

    @property
    def lock(self) -> asyncio.Lock:
        """One call at a time: taken for a call's whole turn (the endpoint's loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def check_open(self) -> None:
        if self.closed:
            raise SessionError(f"session {self.sid} is closed", 409)
        if self.aborted:
            raise SessionError(f"session {self.sid} was aborted: {self.aborted}", 409)

    # -------------------------------------------------------------------------------- before the engine
    def begin(self, req: TurnRequest) -> None:
        """Checks the request against the session and appends its new tokens (the caller holds the lock)."""
        self.check_open()
        if req.messages is None:
            self._begin_text(req.prompt)
        else:
            self._begin_messages(req.messages, req.tools)

    def _start(self, prompt_ids: list[int], text: str, kind: str) -> None:
        limit = self.ctx.max_prompt_len
        if limit is not None and len(prompt_ids) > limit:  # refused here, never sent to an engine
            raise SessionError(
                f"the first request is {len(prompt_ids)} tokens, more than the run's --rollout-max-prompt-len {limit}"
            )
        self.buf = self.ctx.new_buffer(prompt_ids)
        self.prompt_text = text
        self.kind = kind

    def _add_env(self, ids: list[int]) -> bool:
        """Appends the environment's tokens; False (and the session truncated) when they exceed the budget."""
        room = self.ctx.remaining(self.buf)
        self.buf.add_env(ids[: max(room, 0)])
        if len(ids) > room:
            self.buf.finish_reason = "length"
            return False
        return True

    def _begin_messages(self, messages: list[dict], tools: list | None) -> None:
        if self.renderer is None:
            raise SessionError("the tokenizer has no chat template: only the completions API works here")
        check_messages(messages)  # every adapter's neutral messages: a role, tool calls as calls (else a 400)
        keys = [message_key(m) for m in messages]
        if self.kind is None:
            text = self.renderer.render(messages, tools)
            self._start(encode_prompt(self.tokenizer, text), text, "messages")
        elif self.kind != "messages":
            raise SessionError(f"session {self.sid} is a completions session: chat calls cannot continue it")
        else:
            n = len(self.seen)
            for i, (a, b) in enumerate(zip(keys[:n], self.seen)):
                if a != b:
                    raise SessionError(
                        f"messages[{i}] differs from the session's history: a session only appends messages "
                        "(its earlier turns are kept as token ids, never re-rendered)"
                    )
            if len(keys) < n:
                raise SessionError(f"the request holds {len(keys)} messages, fewer than the session's {n}: "
                                   "a session only appends messages")  # fmt: skip
            if len(keys) == n:
                raise SessionError("no new message after the assistant's last turn")
            new_text = self._closing_trimmed(self.renderer.new_messages_text(self.history, messages[n:], tools))
            self._add_env(self.ctx.encode(new_text))
        self._pending = (list(messages), keys)

    def _begin_text(self, prompt: Any) -> None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        token_in = isinstance(prompt, list) and bool(prompt)
        if not token_in and not isinstance(prompt, str):
            raise SessionError("prompt must be a string or a list of token ids")
        if token_in:  # ids the tokenizer and the engines know: 10**12 or -1 was a 500 (issue 40)
            vocab = len(self.tokenizer)
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise SessionError(f"prompt[{i}]: a token id must be an integer in [0, {vocab}), got {t!r}")
        if self.kind is None:
            if token_in:
                self._start(list(prompt), self.tokenizer.decode(prompt), "completion")
            else:
                self._start(encode_prompt(self.tokenizer, prompt), prompt, "completion")
        elif self.kind != "completion":
            raise SessionError(f"session {self.sid} is a chat session: completion calls cannot continue it")
        elif token_in:
            have = self.buf.input_ids()
            if list(prompt[: len(have)]) != have:
                raise SessionError("prompt token ids do not extend the session's token ids")
            self._add_env(list(prompt[len(have) :]))
        else:
            if not prompt.startswith(self.text_seen):
                raise SessionError("prompt does not extend the session's text (prompt + completions so far)")
            self._add_env(self.ctx.encode(prompt[len(self.text_seen) :]))
        self._pending = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt), None)

    def _closing_trimmed(self, text: str) -> str:
        """The template's closing of the last turn, less the stop token the model already wrote."""
        if self.last_stop_token is not None:
            tok = self.tokenizer.decode([self.last_stop_token], skip_special_tokens=False)
            if tok and text.startswith(tok):
                return text[len(tok) :]
        return text

    # -------------------------------------------------------------------------------- the engine
    async def _on_rollout_loop(self, coro):
        if self.loop is None or self.loop is asyncio.get_running_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def generate(self, req: TurnRequest) -> ModelTurn:
        """One model turn after `begin`, appended to the token list (the caller holds the lock)."""
        if self._pending is None:
            raise SessionError("no request to answer", 500)
        pending, self._pending = self._pending, None
        prompt_tokens = len(self.buf.input_ids())
        text, reason, ids, stop_seq = await self._model_turn(req)
        if req.messages is None:
            self.text_seen = pending[0] + text
            return ModelTurn(text, text, [], reason, stop_seq, ids, prompt_tokens)
        content, calls = parse_tool_calls(text) if req.parse_tools else (text, [])
        turn = ModelTurn(text, content, calls, reason, stop_seq, ids, prompt_tokens)
        messages, keys = pending
        self.seen = keys + [message_key(turn.message)]
        self.history = messages + [turn.message]
        return turn

    async def _model_turn(self, req: TurnRequest) -> tuple[str, str, list[int], str | None]:
        """(text, finish_reason, token ids, matched stop string) of one model turn, appended to the token list."""
        if self.ctx.remaining(self.buf) <= 0:
            self.buf.finish_reason = "length"
            return "", "length", [], None
        params = dict(self.params)
        if isinstance(req.max_tokens, int) and not isinstance(req.max_tokens, bool) and req.max_tokens > 0:
            params["max_new_tokens"] = min(params.get("max_new_tokens", req.max_tokens), req.max_tokens)
        if req.stop:
            params["stop"] = list(req.stop)
        start = len(self.buf.input_ids())
        rid = f"{self.ctx.rid}#{self.buf.turns}"
        res = await self._on_rollout_loop(self.ctx.generate(self.buf, params))
        self.turns.append({
            "rid": rid, "input_len": start, "token_ids": list(res.token_ids), "logprobs": list(res.logprobs),
            "finish_reason": res.finish_reason, "weight_version": res.weight_version,
        })  # fmt: skip
        if res.finish_reason == "abort":
            self.aborted = "the run cut the session short (the step had enough groups)"
            raise SessionError(self.aborted, 503)
        stops = set(params.get("stop_token_ids") or [])
        last = res.token_ids[-1] if res.token_ids else None
        self.last_stop_token = last if res.finish_reason == "stop" and last in stops else None
        text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        matched = None
        if res.finish_reason == "stop" and self.last_stop_token is None and req.stop:
            hits = [(text.find(s), s) for s in req.stop if s and s in text]
            if hits:  # the answer's text ends before the stop string, as the APIs do; the tokens stay verbatim
                at, matched = min(hits)
                text = text[:at]
        return text, res.finish_reason, list(res.token_ids), matched

    async def turn(self, req: TurnRequest) -> ModelTurn:
        """`begin` and `generate` under the session's lock."""
        async with self.lock:
            self.begin(req)
            return await self.generate(req)

    # -------------------------------------------------------------------------------- the row
    def set_reward(self, reward: Any) -> None:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise SessionError(f"reward must be a finite number, got {reward!r}")
        problem = reward_problem(reward)
        if problem is not None:
            raise SessionError(f"reward must be a finite number within float32's range, got a {problem}")
        self.check_open()
        self.reward = float(reward)

    def result(self) -> TokenBuffer:
        """The session as a sample, with its prompt text, reward and abort reason: finish_reason abort (status
        aborted, never trained) unless it had a turn and was neither abandoned nor cut short."""
        buf = self.buf
        reason = self.aborted
        if reason is None and (buf is None or buf.turns == 0):
            reason = "the agent made no model call"
        if buf is None:
            buf = TokenBuffer(list(self.ctx_prompt_ids))
        return TokenBuffer(
            prompt_ids=list(buf.prompt_ids), token_ids=list(buf.token_ids), logprobs=list(buf.logprobs),
            loss_mask=list(buf.loss_mask), weight_versions=list(buf.weight_versions),
            finish_reason="abort" if reason else buf.finish_reason,
            turns=buf.turns, latency_s=buf.latency_s, prompt_text=self.prompt_text or None,
            reward=None if reason else self.reward, abort_reason=reason,
        )  # fmt: skip
