"""Real engines (`sluiceway engine`, tiny-llama) behind the real sglang-router, driven by EngineClient.

One pool of two engines serves the module (startup is the slow part on 2 cores); the SIGKILL test runs last
because it leaves the pool one engine short.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.tasks.rollout.client import EngineCallError, EngineClient, GenerateResult

VOCAB_GUARD = 1 << 20  # token ids must be plain non-negative ints below any real vocabulary size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # Resolve once here: two engines building the zoo model at the same time would only race for it.
    return resolve_checkpoint("tiny-llama", cache_dir=cache)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    env = {"SLUICEWAY_CACHE": str(model_dir.parent.parent)}
    with SGLangRouter(logs, health_check_interval_s=1) as router:
        with EngineGroup(str(model_dir), 2, logs, router=router, env=env, startup_timeout_s=120) as pool:
            yield router, pool


def run(coro):
    return asyncio.run(coro)


def finished_requests(url: str) -> int:
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    return sum(s.get("finished_requests", 0) for s in info.get("internal_states", []))


def in_flight(url: str) -> int:
    load = httpx.get(f"{url}/get_load", timeout=10).json()
    return load["num_running_reqs"] + load["num_waiting_reqs"]


async def rollout(client: EngineClient, rids: list[str], params: dict, concurrency: int = 8) -> list[GenerateResult]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, rid: str) -> GenerateResult:
        async with sem:
            return await client.generate([1, 5 + i % 7, 9, 11], dict(params, sampling_seed=i), rid=rid)

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(rids)))


def check_well_formed(res: GenerateResult, max_new_tokens: int) -> None:
    assert 1 <= len(res.token_ids) <= max_new_tokens
    assert all(isinstance(t, int) and 0 <= t < VOCAB_GUARD for t in res.token_ids)
    assert len(res.logprobs) == len(res.token_ids)
    assert all(lp <= 0.0 for lp in res.logprobs)
    assert res.finish_reason in ("stop", "length")
    assert res.prompt_tokens == 4
    assert res.latency_s > 0


def test_generate_through_router_uses_both_engines(stack):
    router, pool = stack
    before = {u: finished_requests(u) for u in pool.urls}
    served_before = router.worker_outcomes()
    params = {"max_new_tokens": 16, "temperature": 1.0}

    async def go():
        async with EngineClient(router.url, pool.urls) as client:
            return await rollout(client, [f"basic-{i}" for i in range(32)], params)

    results = run(go())
    assert sorted(r.rid for r in results) == sorted(f"basic-{i}" for i in range(32))
    for r in results:
        check_well_formed(r, 16)
    # Both the engines' own counters and the router's per-worker outcomes say both served.
    served = {u: finished_requests(u) - before[u] for u in pool.urls}
    assert sum(served.values()) == 32 and all(n > 0 for n in served.values()), served
    outcomes = router.worker_outcomes()
    for u in pool.urls:
        assert outcomes[u].get("success", 0) > served_before.get(u, {}).get("success", 0)


def test_a_group_key_keeps_a_group_on_one_engine_and_groups_spread(stack):
    """The manual policy (min_group): requests with one routing key go to one engine; new keys go to the engine
    with the fewest active keys, so 8 groups sent together split 4/4."""
    router, pool = stack
    # Long enough that all 8 groups are in flight when the last one is assigned (a finished key stops counting).
    params = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.0}

    async def groups(tag: str, keys: list[int]) -> list[GenerateResult]:
        async with EngineClient(router.url, pool.urls) as client:
            calls = [
                client.generate(
                    [1, 5 + k, 9, 11], dict(params, sampling_seed=i), f"{tag}-{k}-{i}", routing_key=f"{tag}/{k}"
                )
                for k in keys
                for i in range(4)
            ]
            return await asyncio.gather(*calls)

    for k in range(4):  # one group at a time: all 4 samples on one engine, whichever it is
        before = {u: finished_requests(u) for u in pool.urls}
        run(groups("one", [k]))
        assert sorted(finished_requests(u) - before[u] for u in pool.urls) == [0, 4]
    before = {u: finished_requests(u) for u in pool.urls}
    run(groups("eight", list(range(8))))
    assert [finished_requests(u) - before[u] for u in pool.urls] == [16, 16]


def test_remove_and_add_worker_at_runtime(stack):
    router, pool = stack
    kept, removed = pool.urls
    assert router.remove_worker(removed)
    assert router.worker_urls() == [kept]
    before = {u: finished_requests(u) for u in pool.urls}

    async def go(tag: str):
        async with EngineClient(router.url, pool.urls) as client:
            return await rollout(client, [f"{tag}-{i}" for i in range(8)], {"max_new_tokens": 4})

    assert len(run(go("solo"))) == 8
    assert finished_requests(removed) == before[removed]  # none went to the removed engine
    assert finished_requests(kept) == before[kept] + 8

    router.add_worker(removed)
    assert sorted(router.worker_urls()) == sorted(pool.urls)
    run(go("back"))
    assert finished_requests(removed) > before[removed]


def test_control_calls_reach_every_engine(stack, model_dir):
    router, pool = stack

    async def go():
        async with EngineClient(router.url, pool.urls) as client:
            assert await client.health() == {u: True for u in pool.urls}
            await client.pause()
            # Paused engines queue new work: nothing finishes until every engine continues (round robin
            # puts these four on both engines).
            tasks = [
                asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 4}, rid=f"paused-{i}"))
                for i in range(4)
            ]
            await asyncio.sleep(1.0)
            assert not any(t.done() for t in tasks)
            await client.resume()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert len(results) == 4

            await client.update_weights_from_disk(str(model_dir), 7)
            assert await client.weight_versions() == {u: 7 for u in pool.urls}
            res = await rollout(client, [f"v7-{i}" for i in range(4)], {"max_new_tokens": 4})
            assert {r.weight_version for r in res} == {7}

            # Aborts reach the engine that holds the request; it answers 200 with its tokens so far, and
            # the router passes that through (no retry elsewhere).
            long = {"max_new_tokens": 900, "ignore_eos": True}
            one = asyncio.create_task(client.generate([1, 2, 3], long, rid="to-abort"))
            rest = [asyncio.create_task(client.generate([1, 2, 3], long, rid=f"all-{i}")) for i in range(3)]
            while sum(in_flight(u) for u in pool.urls) < 4:  # abort only once the engines hold all four
                await asyncio.sleep(0.02)
            await client.abort("to-abort")
            await client.abort_all()
            for r in await asyncio.wait_for(asyncio.gather(one, *rest), 60):
                assert r.finish_reason == "abort" and len(r.token_ids) < 900
                assert len(r.logprobs) == len(r.token_ids)

            await client.flush_cache()
            await client.abort("no-such-rid")  # harmless on every engine

            with pytest.raises(EngineCallError, match="does-not-exist"):
                await client.update_weights_from_disk(str(model_dir.parent / "does-not-exist"), 8)

    run(go())


def test_client_retries_until_the_router_is_up(stack, tmp_path):
    """The client, not the router, covers a router that is not (yet) reachable: same rid, backoff."""
    _, pool = stack
    from sluiceway.infra.proc import free_port

    port = free_port()
    late = SGLangRouter(tmp_path, port=port)

    async def go():
        async with EngineClient(f"http://127.0.0.1:{port}", pool.urls, max_retries=8, retry_backoff_s=0.3) as client:
            task = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 4}, rid="late"))
            await asyncio.sleep(0.2)
            assert not task.done()
            await asyncio.to_thread(late.start)
            for u in pool.urls:
                await asyncio.to_thread(late.add_worker, u)
            return await asyncio.wait_for(task, 60)

    try:
        res = run(go())
    finally:
        late.close()
    assert res.rid == "late" and len(res.token_ids) >= 1


def test_external_engines_are_attached_not_owned(stack, tmp_path):
    _, pool = stack
    external = pool.urls[1]
    with SGLangRouter(tmp_path) as router:
        # slime passes bare host:port addresses
        with EngineGroup(None, 0, tmp_path, router=router, external_urls=[external.removeprefix("http://")]) as ext:
            assert ext.urls == [external] and router.worker_urls() == [external]
            with pytest.raises(RuntimeError, match="external"):
                ext.kill(0)
            assert ext.check() == []
        assert router.worker_urls() == []  # detached on stop ...
    assert httpx.get(f"{external}/health", timeout=10).status_code == 200  # ... and still running


def test_an_engine_that_loses_its_port_is_started_again_on_another(model_dir, tmp_path, monkeypatch):
    # free_port's answer can be taken by another process before the engine binds it (a busy machine): the engine
    # exits at start ("address already in use") and the pool starts it again on a new port, not a failed run.
    import socket

    from sluiceway.infra import engine_group

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = engine_group.free_port
    monkeypatch.setattr(engine_group, "free_port", lambda: next(ports, None) or real())
    env = {"SLUICEWAY_CACHE": str(model_dir.parent.parent)}
    try:
        with EngineGroup(str(model_dir), 1, tmp_path, env=env, startup_timeout_s=120) as pool:
            (url,) = pool.urls
            assert url != f"http://127.0.0.1:{taken.getsockname()[1]}" and pool.check() == []
        assert "address already in use" in (tmp_path / "engine-0.log").read_text().lower()
    finally:
        taken.close()


def test_sigkill_engine_mid_rollout(stack):
    """Runs last: engine 0 dies with requests in flight; every request still completes exactly once."""
    router, pool = stack
    victim = pool.urls[0]
    rids = [f"crash-{i}" for i in range(32)]
    params = {"max_new_tokens": 128, "ignore_eos": True, "temperature": 1.0}

    async def go():
        async with EngineClient(router.url, pool.urls) as client:
            task = asyncio.create_task(rollout(client, rids, params))
            deadline = time.monotonic() + 60
            async with httpx.AsyncClient(trust_env=False) as http:  # kill it while it is busy
                while (await http.get(f"{victim}/get_load")).json()["num_running_reqs"] == 0:
                    assert time.monotonic() < deadline and not task.done()
                    await asyncio.sleep(0.01)
            pool.kill(0)
            return await asyncio.wait_for(task, 120)

    results = run(go())
    got = [r.rid for r in results]
    assert len(got) == len(set(got)) == 32 and set(got) == set(rids)
    for r in results:
        assert len(r.token_ids) == 128 and r.finish_reason == "length"
        check_well_formed(r, 128)

    assert pool.check() == [victim]
    assert victim not in pool.urls and router.worker_urls() == pool.urls
