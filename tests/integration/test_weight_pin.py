"""A /generate pinned to weight versions, through the real sglang-router to one real embedded engine (tiny-llama).

What the router does with a pin (infra/weight_pin.py): it drops the top-level ``min_weight_version`` /
``max_weight_version`` fields, keeps their ``custom_labels`` copy, and hands the engine's 409 and its JSON body
back unchanged without retrying it. The test checks each of these on the real binary.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.infra.weight_pin import pin_body
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.tasks.rollout.client import EngineClient, WeightVersionRefused

PARAMS = {"max_new_tokens": 3, "temperature": 0.0}
PROMPT = [1, 5, 9, 11]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
    logs = tmp_path_factory.mktemp("logs")
    env = {"SLUICEWAY_CACHE": str(model_dir.parent.parent)}
    with SGLangRouter(logs, health_check_interval_s=1) as router:
        with EngineGroup(str(model_dir), 1, logs, router=router, env=env, startup_timeout_s=120) as pool:
            yield router, pool.urls[0]


def test_a_pin_reaches_the_engine_through_the_router_and_its_refusal_comes_back(stack):
    router, engine_url = stack

    async def scenario() -> None:
        async with EngineClient(router.url, [engine_url], max_retries=1) as client:
            served = (await client.weight_versions())[engine_url]
            free = await client.generate(PROMPT, PARAMS, rid="unpinned")
            assert free.weight_version == served and len(free.token_ids) == 3
            same = await client.generate(PROMPT, PARAMS, rid="same", min_weight_version=served,
                                         max_weight_version=served)  # fmt: skip
            assert same.weight_version == served and same.token_ids == free.token_ids
            with pytest.raises(WeightVersionRefused) as e:
                await client.generate(PROMPT, PARAMS, rid="ahead", min_weight_version=served + 1)
            assert (e.value.serving, e.value.min_version, e.value.max_version) == (served, served + 1, None)
            with pytest.raises(WeightVersionRefused) as e:
                await client.generate(PROMPT, PARAMS, rid="behind", max_weight_version=served - 1)
            assert e.value.serving == served and e.value.max_version == served - 1

            # The engine moves on to the pinned version: the same pin now runs.
            r = httpx.post(f"{engine_url}/update_weight_version", json={"new_version": str(served + 1)}, timeout=30)
            assert r.status_code == 200, r.text
            ahead = await client.generate(PROMPT, PARAMS, rid="ahead-again", min_weight_version=served + 1)
            assert ahead.weight_version == served + 1
            with pytest.raises(WeightVersionRefused) as e:  # and the old one is refused
                await client.generate(PROMPT, PARAMS, rid="old", max_weight_version=served)
            assert e.value.serving == served + 1

    asyncio.run(scenario())


def test_what_the_router_does_with_the_pin_fields_and_the_409(stack):
    router, engine_url = stack
    served = int(httpx.get(f"{engine_url}/model_info", timeout=10).json()["weight_version"])
    body = {"input_ids": PROMPT, "sampling_params": PARAMS}
    failures = router.worker_outcomes().get(engine_url, {}).get("failure", 0)
    with httpx.Client(base_url=router.url, timeout=60, trust_env=False) as http:
        # The bare fields do not survive the router (0.3.2 re-serialises /generate into its typed request): an
        # unsatisfiable pin sent only that way runs. If this starts failing, the router forwards them now.
        dropped = http.post("/generate", json=body | {"min_weight_version": served + 5, "rid": "bare"})
        assert dropped.status_code == 200, "sglang-router now forwards min_weight_version: custom_labels may go"
        # Their custom_labels copy does, and the engine's 409 comes back with its JSON body unchanged,
        # streamed or not (a streamed one keeps the event-stream Content-Type, with the JSON as its body).
        for stream in (False, True):
            r = http.post(
                "/generate", json=body | pin_body(served + 5, None) | {"rid": f"pin-{stream}", "stream": stream}
            )
            assert r.status_code == 409, r.text
            assert r.json() == {"error": {
                "type": "weight_version_mismatch", "message": r.json()["error"]["message"], "serving": str(served),
                "min": served + 5, "max": None,
            }}  # fmt: skip
        # A malformed pin is a 400, also passed through.
        bad = http.post("/generate", json=body | pin_body(served + 2, served + 1) | {"rid": "bad"})
        assert bad.status_code == 400 and "above max_weight_version" in bad.json()["message"]
    # Refused and bad requests were not retried: the router counted one failed attempt each (4xx pass through).
    assert router.worker_outcomes()[engine_url]["failure"] == failures + 3
    load = httpx.get(f"{engine_url}/get_load", timeout=10).json()
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
