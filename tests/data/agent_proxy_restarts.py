"""Issue 30's start-up hang, repeated: inside a Prefect flow whose logs go to the API (Prefect's APILogHandler),
start the agent endpoint, run one agent session through it, stop it; N times, agents written with the `openai`
client and with the OpenAI Agents SDK in turn, while the flow logs. Prints `done N` when every round finished.

Usage: python agent_proxy_restarts.py RUN_DIR ROUNDS (tests/integration/test_agent_proxy_restarts.py)
"""

import asyncio
import sys
import threading

from prefect import flow, get_run_logger

from sluiceway.infra.prefect_env import configure_prefect
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate
from sluiceway.tasks.rollout.client import GenerateResult
from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.rollout import PromptItem


class Engine:
    """Answers every turn with "4" and <|im_end|>."""

    def __init__(self, tok):
        self.ids = tok.encode("4", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]

    async def generate(
        self, input_ids, params, rid, routing_key=None, min_weight_version=None, max_weight_version=None
    ):
        return GenerateResult(rid, list(self.ids), [-0.5] * len(self.ids), "stop", 0, len(input_ids), 0.0)


def openai_agent(base_url, api_key, prompt):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt["prompt"]}])
    return 1.0


async def agents_sdk_agent(base_url, api_key, prompt):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        return a + b

    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    agent = Agent(name="calculator", instructions="Use the add tool.", model=model, tools=[add])
    await Runner.run(agent, prompt["prompt"], max_turns=2)
    return 1.0


@flow(name="agent-proxy-restarts")
def restarts(rounds: int) -> int:
    log = get_run_logger()
    tok = load_tokenizer(resolve_checkpoint("tiny-llama"))
    engine = Engine(tok)
    stop = threading.Event()

    def chatter():  # logs going to the API while servers start and stop
        i = 0
        while not stop.is_set():
            log.info("background line %d", i)
            i += 1
            stop.wait(0.005)

    threading.Thread(target=chatter, daemon=True).start()
    done = 0
    try:
        for k in range(rounds):
            fn = agents_sdk_agent if k % 2 else openai_agent
            ctx = GenerateContext(engine, tok, f"run/0/{k}/0", 32, routing_key=f"run/0/{k}")
            item = PromptItem(f"p{k}", "What is 2+2?", tok.encode("What is 2+2?"), "4", {}, "What is 2+2?")
            gen = AgentGenerate(fn)
            res = asyncio.run(gen(ctx, item, {"max_new_tokens": 32, "stop_token_ids": []}))
            assert res.abort_reason is None and res.reward == 1.0, (fn.__name__, res.abort_reason)
            gen.close()  # the endpoint stops, and the next round's starts
            log.info("round %d done", k)
            done += 1
    finally:
        stop.set()
    return done


if __name__ == "__main__":
    configure_prefect(sys.argv[1])  # waits for the server
    print("done", restarts(int(sys.argv[2])), flush=True)
