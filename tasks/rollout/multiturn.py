"""Custom and multi-turn generation: a user function drives the engine turn by turn.

    --custom-generate-function-path my_agent.py:generate

    async def generate(ctx: GenerateContext, prompt: PromptItem, params: dict) -> TokenBuffer:
        buf = ctx.new_buffer()
        res = await ctx.generate(buf, params)          # model tokens: trained on
        buf.add_env(ctx.encode("<result>12</result>")) # tool / environment tokens: masked out of the loss
        ...
        return buf

The buffer keeps exactly the token ids the engine produced, turn after turn; the text of a model turn is
never re-tokenized (re-tokenizing decoded text can change the ids and silently breaks the PPO ratio).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sluiceway.infra.errors import UserError
from sluiceway.infra.plugins import load_function


@dataclass
class TokenBuffer:
    """A multi-turn sample as it grows; what it holds at the end is its `Generation` (tasks/rollout/generation.py)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # the response: model and environment tokens
    logprobs: list[float] = field(default_factory=list)  # 0.0 for environment tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 model, 0 environment
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    latency_s: float = 0.0
    # What an agent session (tasks/rollout/agent/session.py) adds to its row: None leaves the row's default.
    prompt_text: str | None = None  # the prompt it rendered
    reward: float | None = None  # the agent's reward
    abort_reason: str | None = None  # why it was stored as aborted

    @property
    def weight_version(self) -> int:
        return self.weight_versions[-1] if self.weight_versions else 0

    def input_ids(self) -> list[int]:
        """What the engine sees next: the prompt and everything appended so far."""
        return self.prompt_ids + self.token_ids

    def add_model(self, result) -> None:
        self.token_ids += result.token_ids
        self.logprobs += result.logprobs
        self.loss_mask += [1] * len(result.token_ids)
        if result.weight_version not in self.weight_versions:
            self.weight_versions.append(result.weight_version)
        self.finish_reason = result.finish_reason
        self.turns += 1
        self.latency_s += result.latency_s

    def add_env(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)


@dataclass
class GenerateContext:
    """What a custom generate function may use: the engines, the tokenizer, and a request-id scheme."""

    client: object
    tokenizer: object
    rid: str  # base request id of this sample; turn k is sent as f"{rid}#k"
    max_new_tokens: int  # the sample's whole budget of response tokens, model and environment together
    routing_key: str | None = None  # the group's: every turn of every sample of a group goes to one engine
    max_prompt_len: int | None = None  # the longest prompt a sample may start from (--rollout-max-prompt-len)
    # The weight versions every turn may be sampled at (tasks/rollout/client.py EngineClient.generate): an engine
    # serving another refuses the turn with WeightVersionRefused.
    min_weight_version: int | None = None
    max_weight_version: int | None = None

    def new_buffer(self, prompt_ids: list[int]) -> TokenBuffer:
        return TokenBuffer(list(prompt_ids))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def remaining(self, buf: TokenBuffer) -> int:
        return self.max_new_tokens - len(buf.token_ids)

    async def generate(self, buf: TokenBuffer, params: dict):
        """One model turn from the buffer's current end; appends the result and returns it."""
        p = dict(params, max_new_tokens=min(params.get("max_new_tokens", self.max_new_tokens), self.remaining(buf)))
        result = await self.client.generate(
            buf.input_ids(),
            p,
            rid=f"{self.rid}#{buf.turns}",
            routing_key=self.routing_key,
            min_weight_version=self.min_weight_version,
            max_weight_version=self.max_weight_version,
        )
        buf.add_model(result)
        return result


CustomGenerate = Callable[[GenerateContext, object, dict], Awaitable[TokenBuffer]]


def load_custom_generate(path: str) -> CustomGenerate:
    """'pkg.module:fn' or 'path/to/file.py:fn' naming an async function."""
    import inspect

    fn = load_function(path, "--custom-generate-function-path")
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"--custom-generate-function-path {path}: '{fn.__name__}' must be an async function")
    return fn
