"""A scripted engine client for the rollout's unit tests: what tasks/rollout/pool_target.py's RolloutClient asks.

Each request's answer comes from ``script(rid)`` (default: ``Reply()``): how many tokens, why it finished,
how long it takes, whether it hangs until ``abort_all`` (then it returns the tokens it had, like an engine),
or fails. A ``dead`` client fails every request the way EngineClient does when a pool's router is gone.
Token ids are ``100 + k`` for the k-th token of the call, log-probs ``-0.01 * (k + 1)``: a continued sample's
new tokens are told from its old ones by the call that made them (see ``calls``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluiceway.tasks.rollout.client import EngineCallError, GenerateResult, WeightVersionRefused


@dataclass
class Reply:
    tokens: int = 4  # generated unless the request's max_new_tokens is smaller (then finish_reason "length")
    finish_reason: str = "stop"
    delay_s: float = 0.0
    hang: bool = False  # until abort_all: then `partial` tokens come back with finish_reason "abort"
    partial: int = 2
    error: str | None = None  # raise EngineCallError(error)
    first_token: int = 100


@dataclass
class Call:
    rid: str
    input_ids: list[int]
    params: dict
    routing_key: str | None
    outcome: str = "running"  # answered | aborted | cancelled | failed | refused
    min_weight_version: int | None = None


@dataclass
class FakeEngine:
    name: str = "fake"
    script: Callable[[str], Reply] | None = None
    version: int = 0  # the weight version the answers report
    dead: bool = False
    enforces_pin: bool = True  # False: as an SGLang engine, which ignores min/max_weight_version
    calls: list[Call] = field(default_factory=list)
    aborts: int = 0

    def __post_init__(self) -> None:
        self.router_url = f"http://{self.name}.invalid"
        self._abort = asyncio.Event()

    def call(self, rid: str) -> Call:
        """The last call with this rid."""
        return [c for c in self.calls if c.rid == rid][-1]

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        rid: str,
        return_logprob: bool = True,
        routing_key: str | None = None,
        min_weight_version: int | None = None,
        max_weight_version: int | None = None,
    ) -> GenerateResult:
        call = Call(rid, list(input_ids), dict(sampling_params), routing_key, min_weight_version=min_weight_version)
        self.calls.append(call)
        start = time.monotonic()
        if self.dead:
            call.outcome = "failed"
            raise EngineCallError(f"rid {rid}: {self.router_url}/generate failed 5 times; last: ConnectError")
        lo, hi = min_weight_version, max_weight_version
        outside = (lo is not None and self.version < lo) or (hi is not None and self.version > hi)
        if self.enforces_pin and outside:
            call.outcome = "refused"  # as the embedded engine: before any token, a 409 (WeightVersionRefused)
            raise WeightVersionRefused(f"rid {rid}: refused, serving {self.version}", self.version, lo, hi)
        reply = self.script(rid) if self.script else Reply()
        abort = self._abort  # an abort_all from now on cuts this request
        try:
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.error is not None:
                call.outcome = "failed"
                raise EngineCallError(f"rid {rid}: {reply.error}")
            n, reason = min(reply.tokens, sampling_params["max_new_tokens"]), reply.finish_reason
            if reply.tokens > sampling_params["max_new_tokens"]:
                reason = "length"
            if reply.hang:
                await abort.wait()
                n, reason = min(reply.partial, sampling_params["max_new_tokens"]), "abort"
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        call.outcome = "aborted" if reason == "abort" else "answered"
        return GenerateResult(
            rid=rid,
            token_ids=[reply.first_token + k for k in range(n)],
            logprobs=[-0.01 * (k + 1) for k in range(n)],
            finish_reason=reason,
            weight_version=self.version,
            prompt_tokens=len(input_ids),
            latency_s=time.monotonic() - start,
        )

    async def abort_all(self) -> None:
        self.aborts += 1
        self._abort.set()
        self._abort = asyncio.Event()


def by_group(replies: dict[int, Reply], default: Reply | None = None) -> Callable[[str], Reply]:
    """A script answering each request by its group (rid ``run/step/group/sample``)."""

    def script(rid: str) -> Reply:
        return replies.get(int(rid.split("/")[2]), default or Reply())

    return script
