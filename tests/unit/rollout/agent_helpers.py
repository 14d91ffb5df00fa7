"""The agent endpoint's unit tests' shared parts: a scripted engine that answers turn k with the k-th text, agent
modules written to files, and running agent functions through `AgentGenerate` (the real endpoint, on loopback)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sluiceway.tasks.rollout.agent.proxy import AgentGenerate, load_agent_function
from sluiceway.tasks.rollout.client import GenerateResult
from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.rollout import PromptItem

EOS = 2  # tiny-llama's <|im_end|>
PARAMS = {"max_new_tokens": 200, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [EOS], "sampling_seed": 5}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip
ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'


@dataclass
class ScriptedEngine:
    """Answers turn k with the k-th scripted text's ids (+ EOS), log-prob -(i+1)/100 for token i; cut at
    max_new_tokens with finish_reason "length"; a text holding a stop string is answered up to and with it,
    finish_reason "stop" (as an engine with `stop` does)."""

    tokenizer: object
    texts: list[str]
    delay_s: float = 0.0
    calls: list[dict] = field(default_factory=list)

    async def generate(
        self, input_ids, params, rid, routing_key=None, min_weight_version=None, max_weight_version=None
    ):
        await asyncio.sleep(self.delay_s)
        k = len(self.calls)
        text = self.texts[k % len(self.texts)]
        eos = [EOS]
        for s in params.get("stop") or []:
            if s in text:
                text, eos = text[: text.index(s) + len(s)], []
        ids, reason = self.tokenizer.encode(text, add_special_tokens=False) + eos, "stop"
        if len(ids) > params["max_new_tokens"]:  # cut at the cap: no stop token
            ids, reason = ids[: params["max_new_tokens"]], "length"
        self.calls.append({"rid": rid, "input_ids": list(input_ids), "params": dict(params), "output_ids": ids})
        lps = [-(i + 1) / 100 for i in range(len(ids))]
        return GenerateResult(rid, ids, lps, reason, 7, len(input_ids), 0.01)


def agent_module(tmp_path, body: str, name: str = "agent_mod") -> str:
    f = tmp_path / f"{name}.py"
    f.write_text(body)
    return f"{f}:agent"


def prompt_item(pid: str = "p0", prompt: str = "What is 2+2?", tok=None) -> PromptItem:
    return PromptItem(pid, prompt, tok.encode(prompt) if tok is not None else [1], "4", {"env": "x"}, prompt)


async def run_agent_async(
    tok, path, engine, rid="run/0/0/0", prompt="What is 2+2?", max_prompt_len=None, budget=200, endpoint=None
):
    """`endpoint`: an AgentProxy to share with other agents' sessions (else the agent's own, stopped after)."""
    gen = AgentGenerate(load_agent_function(path), endpoint=endpoint)
    ctx = GenerateContext(engine, tok, rid, budget, routing_key=rid.rsplit("/", 1)[0], max_prompt_len=max_prompt_len)
    try:
        return await gen(ctx, prompt_item(rid, prompt, tok), dict(PARAMS, max_new_tokens=budget))
    finally:
        gen.close()


def run_agent(tok, path, engine, **kw):
    return asyncio.run(run_agent_async(tok, path, engine, **kw))


def check_tokens_match_engine(res, engine) -> list[list[int]]:
    """The session's tokens are, turn by turn, what the engine was sent and answered: the engine's ids verbatim
    (mask 1, its log-probs) and between turns the new messages (mask 0, log-prob 0.0). Returns the masked-out
    spans between turns."""
    ids, mask, lps = res.token_ids, res.loss_mask, res.logprobs
    assert len(ids) == len(mask) == len(lps) and res.turns == len(engine.calls)
    pos, env = 0, []
    for k, call in enumerate(engine.calls):
        start = len(call["input_ids"]) - len(res.prompt_ids)
        assert call["input_ids"] == res.prompt_ids + ids[:start]
        if k:
            assert start > pos and mask[pos:start] == [0] * (start - pos) and lps[pos:start] == [0.0] * (start - pos)
            env.append(ids[pos:start])
        n = len(call["output_ids"])
        assert ids[start : start + n] == call["output_ids"] and mask[start : start + n] == [1] * n
        assert lps[start : start + n] == [-(i + 1) / 100 for i in range(n)]
        pos = start + n
    assert pos == len(ids)
    return env
