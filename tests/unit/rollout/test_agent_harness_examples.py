"""Every harness of examples/agent_harnesses.py (the issue's table, and the black-box process configured only by
its environment) runs a session through the real endpoint on a scripted engine whose turns are cut at 8 tokens,
as an untrained model's are: each session is kept (not aborted), turn by turn the engine's tokens. The same
harnesses train on tiny-llama in tests/integration/test_agent_harnesses.py."""

import pytest
from agent_helpers import ScriptedEngine, check_tokens_match_engine, run_agent
from paths import ROOT

HARNESSES = ROOT / "examples" / "agent_harnesses.py"
NAMES = ["agents_sdk", "agents_sdk_chat", "openai_stream", "responses_stream", "langchain", "langchain_stream",
         "anthropic_tools", "anthropic_stream", "blackbox_openai", "blackbox_anthropic"]  # fmt: skip
TURNS = {"agents_sdk": 1}  # the SDK raises on a cut turn (status incomplete): the session ends there


@pytest.mark.parametrize("name", NAMES)
def test_harness_session_on_cut_turns(tiny, name):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["The answer is probably four, or so I think, let me see."])
    res = run_agent(tok, f"{HARNESSES}:{name}", engine, prompt="What is 2 + 2?", max_prompt_len=384, budget=128)
    assert res.abort_reason is None and res.reward is not None, res.abort_reason
    assert res.turns == TURNS.get(name, 2) and res.finish_reason == "length"
    assert all(c["params"]["max_new_tokens"] == 8 for c in engine.calls)
    check_tokens_match_engine(res, engine)
