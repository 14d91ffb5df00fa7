"""A remote pool behind a WAN-like link (issue 21 item 5; benchmarks/bench_wan.py measures the same set-up).

The pool (`sluiceway pools up`: router, one tiny-llama engine, agent) runs in a network namespace this test makes,
joined by a veth pair shaped with tc; it reaches the SeaweedFS weight store only through a delaying proxy on the
home end, and the rollout reaches its router through another on the remote end (tests/wan_helpers.py). The link
is cut (every packet lost both ways) for a few seconds while the trainer publishes a delta: the pool keeps
serving its last good version, a rollout step offered the pool completes on the run's own engine, and once the
link is back the pool serves the new version. All traffic stays on this machine: loopback, and the namespace
made here. Skips, saying why, where namespaces cannot be made (not root, no iproute2, a locked-down kernel).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from wan_helpers import remote_pool

from sluiceway.infra.netns import DelayProxy, NetnsUnavailable, WanLink
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories
from sluiceway.storage.weights import safetensors_raw as st
from sluiceway.storage.weights.model_dir import read_model_dir
from sluiceway.storage.weights.pool_registry import PoolRegistry
from sluiceway.storage.weights.publish import WeightPublisher
from sluiceway.storage.weights.store import WeightStore
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_target import PoolTarget, own_engines


@pytest.fixture
def link():
    """A namespace and link of this test's own (name and subnet from the pid: parallel runs do not collide)."""
    tag = os.getpid() % 1000
    try:
        link = WanLink(f"swt{tag}", subnet=f"10.77.{100 + tag % 150}", rate="100mbit").start()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespace for the WAN link: {exc}")
    try:
        yield link
    finally:
        link.close()
    # Nothing left behind: no namespace, no veth, no process in it.
    assert not Path("/var/run/netns", link.name).exists()
    assert not Path("/sys/class/net", link.home_dev).exists()


def perturbed(base: dict[str, st.RawTensor], step: int) -> dict[str, st.RawTensor]:
    """A small training step: 5% of the elements of a few float tensors move a little."""
    gen = torch.Generator().manual_seed(step)
    out = dict(base)
    for name in sorted(n for n, t in base.items() if t.dtype in ("F32", "BF16", "F16"))[:4]:
        t = st.to_torch(base[name])
        mask = torch.rand(t.shape, generator=gen) < 0.05
        out[name] = st.from_torch((t.float() + 1e-3 * step * mask).to(t.dtype))
    return out


def served_through_link(url: str) -> str:
    body = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False)
    r.raise_for_status()
    return str(r.json()["meta_info"]["weight_version"])


def test_pool_behind_a_cut_link_keeps_serving_and_catches_up(s3_server, link, tmp_path, monkeypatch, caplog):
    from rollout_helpers import make_prompts, settings, start_stack

    from sluiceway.tasks.rollout.client import EngineClient
    from sluiceway.tasks.rollout.rollout import plan_step, run_rollout

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    model = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("SLUICEWAY_CACHE", str(tmp_path / "cache"))
    uri = f"s3://{s3_server.bucket}/wan-{uuid.uuid4().hex[:8]}/weights"
    wstore = WeightStore(ObjectStore.from_uri(uri))
    publisher = WeightPublisher(wstore, full_every=10, keep=5)
    base = read_model_dir(model)
    assert publisher.publish(1, perturbed(base, 1), model).kind == "full"

    store_proxy = DelayProxy((link.home_ip, 0), ("127.0.0.1", s3_server.s3_port), delay_s=0.02).start()
    pool_env = dict(s3_server.env(), AWS_ENDPOINT_URL=store_proxy.url)  # the pool's only way to the store
    router, engines = start_stack(tmp_path, model, 1)  # the run's own engine, at home
    try:
        with remote_pool(link, tmp_path / "pool", model=str(model), weights_uri=uri, store_env=pool_env,
                         poll_interval_s=0.2, delay_s=0.02) as pool:  # fmt: skip
            pool.wait_serving(1)
            assert pool.generate_inside() == "1"
            assert served_through_link(pool.url) == "1"
            before = store_proxy.stats["down"]
            assert before > 0  # the full version came through the proxy

            link.cut()  # every packet lost, both ways
            m2 = publisher.publish(2, perturbed(base, 2), model)
            assert m2.kind == "delta"
            time.sleep(3)  # several of the agent's polls (every 0.2 s) fall in the cut
            # The pool keeps serving its last good version: asked from inside its namespace.
            assert pool.generate_inside() == "1"
            assert pool.held() == 1 and pool.status()["version"] == 1

            # A rollout step offered the pool goes on the run's own engine: the pool's copy hangs in the cut.
            tok = load_tokenizer(model)
            tables = ObjectStore.from_uri(str(tmp_path / "tables"))
            s = settings(groups_needed=4, groups_submitted=4, max_concurrency=4)
            work = plan_step(tables, "r", 0, make_prompts(tok, 4), s, [])

            async def step():
                async with EngineClient(router.url, engines.urls) as local, EngineClient(pool.url, []) as far:
                    remote = PoolTarget("remote", far, capacity=4, version=1)
                    pools = PoolDispatcher([own_engines(local, s.max_concurrency), remote], min_version=0)
                    return await run_rollout(dispatcher=pools, store=tables, run_id="r", step=0, work=work,
                                             settings=s, decode=tok.decode)  # fmt: skip

            with caplog.at_level("INFO", logger="sluiceway"):
                result = asyncio.run(step())
            assert result.groups_completed == 4
            rows = read_trajectories(tables, "r", 0).to_pylist()
            assert len(rows) == 16 and {r["pool"] for r in rows} == {"local"}
            # It was given a group, which failed or, hanging in the cut, was hedged on the run's own engine.
            assert "pool remote failed" in caplog.text or "pool remote slow" in caplog.text

            link.restore()
            pool.wait_serving(2)  # catches up: the delta over the link
            assert pool.generate_inside() == "2"
            assert served_through_link(pool.url) == "2"
            assert store_proxy.stats["down"] > before
            assert pool.process.poll() is None  # the pool never went down
            # The pool's report reaches the store once the link is back (what a run elsewhere reads); when the
            # pool stops (SIGTERM) it drains and deregisters, so this is read while it serves.
            deadline = time.monotonic() + 60
            registry = PoolRegistry(wstore)
            while getattr(registry.record("remote"), "serving", None) != 2:
                assert time.monotonic() < deadline, registry.record("remote")
                time.sleep(0.1)
        assert registry.record("remote") is None  # drained and deregistered on the way out
    finally:
        store_proxy.stop()
        engines.close()
        router.close()
