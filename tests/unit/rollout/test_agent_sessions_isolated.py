"""Issue 32 item 1: sessions cannot touch each other. Each session has its own key; from inside session A, with the
key A was given, every route of a live session B answers 401 or 404, and B's row is what B made of it.

Before: one key served every session of a run, and A's POST /sessions/B/reward {"reward": 123} and
POST /sessions/B/abort both answered 200 (B's whole group was stored aborted)."""

import asyncio

from agent_helpers import ScriptedEngine, agent_module, run_agent_async

SHARED = """
import threading
B = {}                       # B's base URL, published for the attacker (a test's back channel, not the endpoint's)
b_ready, a_done = threading.Event(), threading.Event()
results = {}
"""

VICTIM = """
import httpx, openai
from shared_state import B, b_ready, a_done

def agent(base_url, api_key, prompt):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    B["base_url"], B["sid"] = base_url, base_url.rstrip("/").split("/")[-2]
    b_ready.set()
    assert a_done.wait(30)
    httpx.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.5},
               headers={"Authorization": f"Bearer {api_key}"}).raise_for_status()
"""

ATTACKER = """
import httpx, openai
from shared_state import B, b_ready, a_done, results

def agent(base_url, api_key, prompt):
    try:
        assert b_ready.wait(30)
        root = base_url.split("/sessions/")[0]
        b_session = B["base_url"].removesuffix("/v1")
        mine = {"Authorization": f"Bearer {api_key}"}
        tries = {
            "reward": ("POST", b_session + "/reward", mine, {"reward": 123}),
            "v1/reward": ("POST", b_session + "/v1/reward", mine, {"reward": 123}),
            "abort": ("POST", b_session + "/abort", mine, {"reason": "x"}),
            "v1/abort": ("POST", b_session + "/v1/abort", mine, {"reason": "x"}),
            "chat": ("POST", b_session + "/v1/chat/completions", mine,
                     {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}),
            "responses": ("POST", b_session + "/v1/responses", mine, {"model": "policy", "input": "hi"}),
            "messages": ("POST", b_session + "/v1/messages", {"x-api-key": api_key},
                         {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
            "models": ("GET", b_session + "/v1/models", mine, None),
            "header": ("POST", root + "/reward", dict(mine, **{"X-Session-Id": B["sid"]}), {"reward": 123}),
            "no key": ("POST", b_session + "/reward", {}, {"reward": 123}),
            "guessed key": ("POST", b_session + "/abort", {"Authorization": "Bearer sk-sluiceway-guess"}, {}),
            "x-api-key guessed": ("POST", b_session + "/v1/messages", {"x-api-key": "sk-sluiceway-guess"},
                                  {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}),
        }
        for name, (method, url, headers, body) in tries.items():
            r = httpx.request(method, url, headers=headers, json=body)
            results[name] = (r.status_code, r.json())
        # A's own key still opens A's own session.
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello"}])
    finally:
        a_done.set()
    return 1.0
"""


def test_a_session_key_opens_no_other_session(tiny, tmp_path, monkeypatch):
    _, tok = tiny
    (tmp_path / "shared_state.py").write_text(SHARED)
    monkeypatch.syspath_prepend(str(tmp_path))
    victim = agent_module(tmp_path, VICTIM, "victim")
    attacker = agent_module(tmp_path, ATTACKER, "attacker")
    eb, ea = ScriptedEngine(tok, ["b's answer"]), ScriptedEngine(tok, ["a's answer"])

    from sluiceway.tasks.rollout.agent.server import AgentProxy

    endpoint = AgentProxy()  # one endpoint, as a run's samples share one: the attacker's session beside the victim's

    async def both():
        return await asyncio.gather(
            run_agent_async(tok, victim, eb, rid="run/0/0/0", endpoint=endpoint),
            run_agent_async(tok, attacker, ea, rid="run/0/1/0", endpoint=endpoint),
        )

    try:
        res_b, res_a = asyncio.run(both())
    finally:
        endpoint.stop()
    import shared_state

    got = shared_state.results
    assert len(got) == 12, got
    for name in ("no key", "guessed key", "x-api-key guessed"):
        assert got[name][0] == 401, (name, got[name])
    for name in ("reward", "v1/reward", "abort", "v1/abort", "chat", "responses", "messages", "models", "header"):
        assert got[name][0] == 404, (name, got[name])
        assert shared_state.B["sid"] in str(got[name][1])  # "unknown session SID": nothing of B's is told
    assert got["messages"][1]["type"] == "error" and got["messages"][1]["error"]["type"] == "not_found_error"
    assert got["x-api-key guessed"][1]["error"]["type"] == "authentication_error"
    # B's row is B's own: its reward, not aborted, its one turn; A's attempts never reached B's engine.
    assert res_b.abort_reason is None and res_b.reward == 0.5 and res_b.turns == 1 and len(eb.calls) == 1
    assert res_a.abort_reason is None and res_a.reward == 1.0 and res_a.turns == 1 and len(ea.calls) == 1
    assert eb.calls[0]["output_ids"] == res_b.token_ids


def test_keys_are_per_session_and_gone_when_it_closes(tiny, tmp_path):
    """Each session gets a different key; a closed session's key opens nothing (401)."""
    _, tok = tiny
    path = agent_module(
        tmp_path,
        """
import httpx
seen = []

def agent(base_url, api_key, prompt):
    seen.append((base_url, api_key))
    if len(seen) == 2:  # the first session is closed: its key is refused
        old_url, old_key = seen[0]
        r = httpx.post(old_url + "/chat/completions", headers={"Authorization": f"Bearer {old_key}"},
                       json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401, r.text
        assert old_key != api_key and old_url != base_url
        r = httpx.post(base_url + "/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                       json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        return 1.0
    return None
""",
    )
    from agent_helpers import PARAMS, prompt_item

    from sluiceway.tasks.rollout.agent.proxy import AgentGenerate, load_agent_function
    from sluiceway.tasks.rollout.multiturn import GenerateContext

    gen = AgentGenerate(load_agent_function(path))  # one module: the agent remembers the first session's key

    def one(rid):
        ctx = GenerateContext(ScriptedEngine(tok, ["x"]), tok, rid, 200)
        return asyncio.run(gen(ctx, prompt_item(rid, "hi", tok), dict(PARAMS)))

    first = one("run/0/0/0")
    assert first.abort_reason == "the agent made no model call"
    second = one("run/0/1/0")
    assert second.abort_reason is None and second.reward == 1.0
