"""A rid still running on an engine (a killed run's request: a resume sends the same rids) is aborted on every
engine and the request sent again; other 400s are not retried. The real race: tests/integration/test_rollout.py
::test_sigkilled_rollout_resumes_only_missing_groups."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sluiceway.tasks.rollout.client import EngineCallError, EngineClient

OK = {"text": "", "output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0"}}
IN_USE = {"object": "error", "message": "rid 'r/0/3/0' is already in use by a running request"}


def run(answers: list[httpx.Response]) -> tuple[list[str], EngineClient]:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host} {request.url.path} {json.loads(request.content).get('rid')}")
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        return answers.pop(0)

    client = EngineClient("http://router.invalid", ["http://e1.invalid", "http://e2.invalid"], max_retries=2,
                          retry_backoff_s=0.0)  # fmt: skip
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return seen, client


def test_a_stale_rid_is_aborted_everywhere_then_sent_again():
    seen, client = run([httpx.Response(400, json=IN_USE), httpx.Response(200, json=OK)])
    out = asyncio.run(client.generate([1, 2], {"max_new_tokens": 1}, rid="r/0/3/0"))
    assert out.token_ids == [7]
    assert seen[0] == "router.invalid /generate r/0/3/0" and seen[-1] == "router.invalid /generate r/0/3/0"
    assert sorted(seen[1:3]) == ["e1.invalid /abort_request r/0/3/0", "e2.invalid /abort_request r/0/3/0"]


def test_a_rid_that_stays_in_use_and_other_400s_raise():
    seen, client = run([httpx.Response(400, json=IN_USE)] * 3)
    with pytest.raises(EngineCallError, match="already in use"):
        asyncio.run(client.generate([1], {"max_new_tokens": 1}, rid="r/0/3/0"))
    assert sum("/generate" in s for s in seen) == 3  # max_retries + 1 tries, then the engine's own words
    seen, client = run([httpx.Response(400, json={"object": "error", "message": "max_new_tokens must be >= 0"})])
    with pytest.raises(EngineCallError, match="max_new_tokens"):
        asyncio.run(client.generate([1], {"max_new_tokens": 1}, rid="x"))
    assert seen == ["router.invalid /generate x"]
