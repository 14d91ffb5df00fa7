"""RemoteRewardModel against a real HTTP server on 127.0.0.1 that can turn slow, failing or down."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sluiceway.tasks.reward.remote import RemoteRewardModel
from sluiceway.tasks.reward.score import RewardSettings, score_rows
from sluiceway.tasks.reward.scorer_registry import remote_group_scorer

SECRET = "sk-test-SUPERSECRET-1234567890"


class Server:
    def __init__(self):
        self.mode = "ok"  # ok | slow | fail | echo_key | bare | nan
        self.fail_next = 0  # this many 500s, then healthy
        self.batches: list[int] = []
        self.auth: list[str | None] = []
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request):
            body = await request.json()
            items = body["items"]
            self.auth.append(request.headers.get("authorization"))
            self.batches.append(len(items))
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"detail": "transient"}, status_code=500)
            if self.mode == "slow":
                await asyncio.sleep(3)
            if self.mode == "fail":
                return JSONResponse({"detail": "broken"}, status_code=500)
            if self.mode == "echo_key":  # a careless server that echoes the credentials back
                return JSONResponse({"detail": f"bad auth {request.headers.get('authorization')}"}, status_code=503)
            rewards = [float(len(it["response"])) for it in items]
            if self.mode == "nan":  # the first item's reward NaN: JSON as Python writes it, which httpx reads back
                return Response(json.dumps({"rewards": [float("nan"), *rewards[1:]]}), media_type="application/json")
            return rewards if self.mode == "bare" else {"rewards": rewards}

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/score"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            time.sleep(0.01)
        assert self.server.started

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def _items(n):
    return [{"prompt": "p", "response": "x" * i, "label": None, "metadata": {"i": i}} for i in range(n)]


def test_healthy_batches_in_order(server):
    rm = RemoteRewardModel(server.url, batch_size=16, timeout_s=5)
    out = rm.score(_items(40))
    assert [r for r, _ in out] == [float(i) for i in range(40)]
    assert sorted(server.batches) == [8, 16, 16]
    server.mode = "bare"  # a bare JSON list is accepted too
    assert [r for r, _ in rm.score(_items(3))] == [0.0, 1.0, 2.0]
    assert rm.score([]) == []


def test_sync_facade_inside_a_running_loop(server):
    rm = RemoteRewardModel(server.url, timeout_s=5)

    async def main():
        direct = await rm.score_batch(_items(2))
        return direct, rm.score(_items(2))

    direct, via_thread = asyncio.run(main())
    assert [r for r, _ in direct] == [r for r, _ in via_thread] == [0.0, 1.0]


def test_retries_through_transient_500s(server):
    server.fail_next = 2
    rm = RemoteRewardModel(server.url, timeout_s=5, max_retries=3, backoff_s=0.05)
    out = rm.score(_items(3))
    assert [r for r, _ in out] == [0.0, 1.0, 2.0]
    assert out[0][1]["attempts"] == 3 and len(server.batches) == 3


def test_persistent_500_gives_none_per_item(server):
    server.mode = "fail"
    rm = RemoteRewardModel(server.url, timeout_s=5, max_retries=2, backoff_s=0.01)
    out = rm.score(_items(3))
    assert all(r is None and "HTTP 500" in d["error"] for r, d in out)
    assert len(server.batches) == 3  # 1 try + 2 retries


def test_too_slow_gives_none_per_item(server):
    server.mode = "slow"
    rm = RemoteRewardModel(server.url, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    out = rm.score(_items(2))
    assert all(r is None and "timed out" in d["error"] for r, d in out)


def test_down_gives_none_per_item_and_key_never_leaks(server, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("SLUICEWAY_TEST_RM_KEY", SECRET)
    rm = RemoteRewardModel(server.url, timeout_s=2, max_retries=1, backoff_s=0.01, api_key_env="SLUICEWAY_TEST_RM_KEY")
    assert [r for r, _ in rm.score(_items(2))] == [0.0, 1.0]
    assert server.auth[-1] == f"Bearer {SECRET}"
    server.mode = "echo_key"
    out = rm.score(_items(2))
    assert all(r is None for r, _ in out)
    assert "HTTP 503" in out[0][1]["error"] and SECRET not in str(out) and "***" in out[0][1]["error"]
    server.stop()
    out = rm.score(_items(3))
    assert all(r is None and "connection error" in d["error"] for r, d in out)
    assert SECRET not in str(out) and SECRET not in repr(rm)
    assert "timed out" in caplog.text or "connection error" in caplog.text
    assert SECRET not in caplog.text


def test_scorer_call_raises_scrubbed_error_when_down(server):
    rm = RemoteRewardModel(server.url, timeout_s=2, max_retries=0)
    assert rm("abc", None, {"prompt": "q"}) == (3.0, {"attempts": 1})
    server.stop()
    with pytest.raises(RuntimeError, match="connection error"):
        rm("abc", None, {"prompt": "q"})


def test_a_nan_reward_from_the_server_is_that_samples_failure(server):
    server.mode = "nan"
    rows = [{"group_id": 0, "sample_index": i, "response_text": "x" * i, "label": None} for i in range(3)]
    out = score_rows(rows, RewardSettings(remote_group_scorer(server.url, None, 5.0), timeout_s=20, group_rm=True))
    assert out[0] == (0.0, {"reward_status": "error", "message": "the scorer returned a non-finite reward nan"})
    assert [r for r, _ in out[1:]] == [1.0, 2.0]  # the rest of the group is scored as usual
