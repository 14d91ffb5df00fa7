"""EngineClient.generate pinned to weight versions: what it sends (the fields and their custom_labels copy, which
sglang-router keeps) and the 409 it turns into WeightVersionRefused; GenerateContext pins every turn."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_engine import FakeEngine

from sluiceway.tasks.rollout.client import EngineCallError, EngineClient, WeightVersionRefused
from sluiceway.tasks.rollout.multiturn import GenerateContext

OK = {"text": "", "output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "3"}}


def _client(answer: httpx.Response) -> tuple[EngineClient, list[dict]]:
    seen: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return answer

    client = EngineClient("http://router.invalid", [], max_retries=3, retry_backoff_s=0.0)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return client, seen


def test_a_pin_goes_in_the_body_and_in_custom_labels():
    client, seen = _client(httpx.Response(200, json=OK))
    asyncio.run(client.generate([1, 2], {"max_new_tokens": 1}, rid="a"))
    asyncio.run(client.generate([1, 2], {"max_new_tokens": 1}, rid="b", min_weight_version=3))
    asyncio.run(client.generate([1, 2], {"max_new_tokens": 1}, rid="c", min_weight_version=2, max_weight_version=0))
    assert not {"min_weight_version", "max_weight_version", "custom_labels"} & seen[0].keys()  # unpinned: as before
    assert seen[1]["min_weight_version"] == 3 and "max_weight_version" not in seen[1]
    assert seen[1]["custom_labels"] == {"sluiceway_min_weight_version": "3"}
    assert seen[2]["custom_labels"] == {"sluiceway_min_weight_version": "2", "sluiceway_max_weight_version": "0"}


@pytest.mark.parametrize(("serving", "version"), [("3", 3), ("default", None)])
def test_a_refusal_raises_weight_version_refused_once(serving, version):
    err = {"type": "weight_version_mismatch", "message": "serves 3", "serving": serving, "min": 4, "max": None}
    # Through the router a refused streamed request comes back with an event-stream Content-Type.
    answer = httpx.Response(409, content=json.dumps({"error": err}), headers={"content-type": "text/event-stream"})
    client, seen = _client(answer)
    with pytest.raises(WeightVersionRefused, match="refused it \\(409\\): serves 3") as e:
        asyncio.run(client.generate([1], {"max_new_tokens": 1}, rid="r", min_weight_version=4))
    assert (e.value.serving, e.value.min_version, e.value.max_version) == (version, 4, None)
    assert isinstance(e.value, EngineCallError) and len(seen) == 1  # not retried


def test_other_4xx_stay_plain_engine_call_errors():
    for answer in (
        httpx.Response(409, json={"error": {"type": "something_else", "message": "no"}}),
        httpx.Response(400, json={"object": "error", "message": "min_weight_version must be an integer"}),
    ):
        client, seen = _client(answer)
        with pytest.raises(EngineCallError) as e:
            asyncio.run(client.generate([1], {"max_new_tokens": 1}, rid="r", min_weight_version=4))
        assert type(e.value) is EngineCallError and len(seen) == 1


def test_a_generate_context_pins_every_turn():
    engine = FakeEngine(version=3)
    seen = []
    real = engine.generate

    async def spy(*args, **kw):
        seen.append((kw.get("min_weight_version"), kw.get("max_weight_version")))
        return await real(*args, **kw)

    engine.generate = spy
    ctx = GenerateContext(engine, None, "run/0/0/0", 20, min_weight_version=2, max_weight_version=3)
    buf = ctx.new_buffer([1, 2])
    asyncio.run(ctx.generate(buf, {"max_new_tokens": 4}))
    asyncio.run(ctx.generate(buf, {"max_new_tokens": 4}))
    assert seen == [(2, 3), (2, 3)] and buf.weight_versions == [3]
    ctx.min_weight_version = 4
    with pytest.raises(WeightVersionRefused):
        asyncio.run(ctx.generate(buf, {"max_new_tokens": 4}))
    assert engine.calls[-1].outcome == "refused" and buf.turns == 2
