"""The Tinker server's journal (flows/tinker/journal.py, storage/tinker.py) on a local store: a finished request's
answer and its row are written before it is answered; a second FutureStore on the same store (a restarted server)
answers it; sampled sequences are rows of their own."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tinker")
from sluiceway.flows.tinker.futures import FutureStore, Result, TinkerUserError  # noqa: E402
from sluiceway.flows.tinker.journal import Journal  # noqa: E402
from sluiceway.storage.object_store import ObjectStore  # noqa: E402
from sluiceway.storage.tinker import read_requests, read_samples  # noqa: E402


def test_results_and_rows_outlive_the_store_object(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    futures = FutureStore(Journal(store, "srv"))
    fb = futures.new(type="forward_backward", model_id="s1:train:0", seq_id=1, loss_fn="ppo",
                     loss_fn_config={"clip_low_threshold": 0.9}, num_datums=2, num_tokens=7)  # fmt: skip
    futures.run(fb, lambda: Result(proto=b"\x01\x02", summary={"metrics": {"loss:sum": 1.5}}))
    bad = futures.new(type="optim_step", model_id="s1:train:0", seq_id=2)
    futures.run(bad, lambda: (_ for _ in ()).throw(TinkerUserError("no")))
    sample = {"request_id": "r", "sequence_id": "r:0", "sample_index": 0, "sampler_path": "tiny-llama",
              "prompt_token_ids": [1, 2], "output_token_ids": [3], "logprobs": [-0.5], "stop_reason": "length",
              "seed": 7, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 1}  # fmt: skip
    sa = futures.new(type="asample", num_datums=1)
    futures.run(sa, lambda: Result(json={"ok": 1}, summary={"num_tokens": 3}, samples=[sample]))

    again = FutureStore(Journal(store, "srv"))  # a restarted server on the same store
    assert again.known(fb) and again.wait(fb, 0).body() == b"\x01\x02"
    assert again.known(bad) and again.known(sa)
    assert again.wait(bad, 0).body() == {"error": "no", "category": "user"}
    assert again.wait(sa, 0).body() == {"ok": 1}
    assert not again.known("req-" + "0" * 32) and not again.known("../../etc/passwd")
    assert not FutureStore(Journal(store, "other")).known(fb)  # another server id's results are not ours

    rows = {r["request_id"]: r for r in read_requests(store, "srv").to_pylist()}
    assert set(rows) == {fb, bad, sa}
    r = rows[fb]
    assert (r["request_type"], r["session_id"], r["model_id"], r["seq_id"]) == (
        "forward_backward",
        "s1",
        "s1:train:0",
        1,
    )
    assert (r["loss_fn"], r["num_datums"], r["num_tokens"], r["loss"], r["status"]) == ("ppo", 2, 7, 1.5, "ok")
    assert json.loads(r["loss_fn_config"]) == {"clip_low_threshold": 0.9}
    assert r["run_s"] >= 0 and r["finished_at"] >= r["submitted_at"]
    assert (rows[bad]["status"], rows[bad]["error"], rows[bad]["error_category"]) == ("error", "no", "user")
    samples = read_samples(store, "srv").to_pylist()
    assert len(samples) == 1 and samples[0]["output_token_ids"] == [3] and samples[0]["seed"] == 7
    assert read_requests(store, "other").num_rows == 0


def test_saved_state_round_trip_and_paths(tmp_path):
    from sluiceway.flows.tinker.server_state import parse_state_path
    from sluiceway.storage.digests import file_digests
    from sluiceway.storage.tinker import DamagedRecord, download_state, state_info, upload_state

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "tp0.pt").write_bytes(b"weights")
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "files": file_digests(ckpt)}))
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    assert state_info(store, "srv", "s1:train:0", "a") is None
    upload_state(store, "srv", "s1:train:0", "a", ckpt, {"base_model": "tiny-llama", "lora_rank": 4})
    assert state_info(store, "srv", "s1:train:0", "a")["lora_rank"] == 4
    upload_state(store, "srv", "s1:train:0", "a", ckpt, {"base_model": "tiny-llama", "lora_rank": 4})  # overwrite
    info = download_state(store, "srv", "s1:train:0", "a", tmp_path / "back")
    assert info["base_model"] == "tiny-llama" and (tmp_path / "back" / "tp0.pt").read_bytes() == b"weights"
    saved = tmp_path / "store" / "tinker" / "srv" / "weights" / "s1:train:0" / "a"
    (saved / "tp0.pt").write_bytes(b"damaged")
    # Named by its tinker:// path and its place on the store, never the temporary directory it was fetched into
    with pytest.raises(DamagedRecord, match=r"tinker://s1:train:0/weights/a \(.*srv/weights/s1:train:0/a\) is damaged"):
        download_state(store, "srv", "s1:train:0", "a", tmp_path / "again")
    (saved / "tinker.json").write_text('{"base_model": "tiny-ll')  # cut short
    with pytest.raises(DamagedRecord, match=r"srv/weights/s1:train:0/a/tinker.json is damaged \(not JSON"):
        state_info(store, "srv", "s1:train:0", "a")

    assert parse_state_path("tinker://session-1:train:0/weights/step-2") == ("session-1:train:0", "step-2")
    for bad in ("tinker://m/sampler_weights/x", "tinker://m/weights/..", "s3://m/weights/x", "tinker://a/b/weights/x"):
        with pytest.raises(TinkerUserError):
            parse_state_path(bad)


def test_refused_requests_are_rows_and_sessions_outlive_the_app(tmp_path):
    from pathlib import Path

    from starlette.testclient import TestClient

    from sluiceway.flows.tinker.app import build_app
    from sluiceway.flows.tinker.server_state import ServerState

    store = ObjectStore.from_uri(str(tmp_path / "store"))

    def app():
        return TestClient(build_app(ServerState("m", Path(tmp_path), tmp_path / "work", store=store, server_id="u")))

    with app() as client:
        sid = client.post(
            "/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
        ).json()["session_id"]
        refused = client.post("/api/v1/create_model", json={"session_id": "nope", "model_seq_id": 0,
                                                            "base_model": "m", "lora_config": {"rank": 2}})  # fmt: skip
        assert refused.status_code == 400 and "unknown session" in refused.json()["error"]
        missing = client.post("/api/v1/retrieve_future", json={"request_id": "req-" + "1" * 32})
        assert missing.status_code == 404
    with app() as client:  # a new app on the same store: the session is known, its heartbeat answers
        beat = client.post("/api/v1/session_heartbeat", json={"session_id": sid})
        assert beat.status_code == 200, beat.text
        assert client.post("/api/v1/session_heartbeat", json={"session_id": "session-" + "0" * 16}).status_code == 404
    rows = read_requests(store, "u").to_pylist()
    assert [(r["request_type"], r["status"], r["error_category"]) for r in rows] == [("create_model", "error", "user")]


def test_training_runs_and_checkpoint_deletes_outlive_the_app(tmp_path):
    """The REST client's get_training_run (the record a create_model writes, the last saves) answers from a new app
    on the same store; delete_checkpoint removes a saved state from the store and a sampler path's directory,
    each a request row; deleting again, or an unknown run, is a 404."""
    from pathlib import Path

    from starlette.testclient import TestClient

    from sluiceway.flows.tinker.app import build_app
    from sluiceway.flows.tinker.server_state import ServerState, checkpoint_record
    from sluiceway.storage.digests import file_digests
    from sluiceway.storage.tinker import state_info, upload_state

    store = ObjectStore.from_uri(str(tmp_path / "store"))
    model_id, base = "session-0123456789abcdef:train:0", tmp_path / "work"

    def state():
        return ServerState("m", Path(tmp_path), base, store=store, server_id="u")

    first = state()
    first.update_training_run(model_id, base_model="m", lora_rank=4, user_metadata={"renderer_name": "role_colon"})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "tp0.pt").write_bytes(b"weights")
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "files": file_digests(ckpt)}))
    upload_state(store, "u", model_id, "000001", ckpt, {"base_model": "m", "lora_rank": 4})
    saved = f"tinker://{model_id}/weights/000001"
    first.update_training_run(model_id, last_checkpoint=checkpoint_record(saved, None))
    sampler_dir = base / "sampler_weights" / "v1"
    sampler_dir.mkdir(parents=True)
    sampler = f"tinker://{model_id}/sampler_weights/000001"
    first.save_sampler_dir(sampler, sampler_dir)
    first.update_training_run(model_id, last_sampler_checkpoint=checkpoint_record(sampler, None))

    with TestClient(build_app(state())) as client:  # a new app: what the first one wrote is on the store
        run = client.get(f"/api/v1/training_runs/{model_id}", params={"access_scope": "owned"})
        assert run.status_code == 200, run.text
        body = run.json()
        assert (body["training_run_id"], body["is_lora"], body["lora_rank"]) == (model_id, True, 4)
        assert body["user_metadata"] == {"renderer_name": "role_colon"}
        assert body["last_checkpoint"]["tinker_path"] == saved
        assert body["last_checkpoint"]["checkpoint_id"] == "weights/000001"
        assert body["last_sampler_checkpoint"]["checkpoint_type"] == "sampler"
        assert client.get("/api/v1/training_runs/session-ffffffffffffffff:train:0").status_code == 404
        assert client.get("/api/v1/training_runs/..%2F..%2Fetc").status_code == 404

        gone = client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/000001")
        assert gone.status_code == 200, gone.text
        assert state_info(store, "u", model_id, "000001") is None
        assert not (tmp_path / "store" / "tinker" / "u" / "weights" / model_id / "000001").exists()
        assert client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/000001").status_code == 404
        assert client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/000001").status_code == 200
        assert not sampler_dir.exists()
        assert client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/000001").status_code == 404
        after = client.get(f"/api/v1/training_runs/{model_id}").json()
        assert after["last_checkpoint"] is None and after["last_sampler_checkpoint"] is None
    rows = [(r["request_type"], r["model_id"], r["status"]) for r in read_requests(store, "u").to_pylist()]
    assert rows == [("delete_checkpoint", model_id, s) for s in ("ok", "error", "ok", "error")]


def test_requests_finishing_together_share_commits(tmp_path):
    """Group commit: 24 requests finishing at once from 8 threads are all rows, in fewer commits than requests
    (each waited for the commit holding its rows before it counted as finished)."""
    from concurrent.futures import ThreadPoolExecutor

    store = ObjectStore.from_uri(str(tmp_path / "store"))
    journal = Journal(store, "g")
    futures = FutureStore(journal)

    def one(i: int) -> str:
        rid = futures.new(type="asample", num_datums=1)
        row = {"request_id": rid, "sequence_id": f"{rid}:0", "sample_index": 0, "sampler_path": "m",
               "prompt_token_ids": [1, 2], "output_token_ids": [i], "logprobs": [-0.5], "stop_reason": "length",
               "seed": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 1}  # fmt: skip
        futures.run(rid, lambda: Result(json={"i": i}, summary={"num_tokens": 3}, samples=[row]))
        assert futures.wait(rid, 0).body() == {"i": i}
        return rid

    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(one, range(24)))
    assert {r["request_id"] for r in read_requests(store, "g").to_pylist()} == set(rids)
    assert sorted(r["output_token_ids"][0] for r in read_samples(store, "g").to_pylist()) == list(range(24))
    assert journal.rows.commits < 24


def test_a_server_keeps_only_recent_results_in_memory_and_reads_older_ones_back(tmp_path):
    """Issue 52 point 9: every answered request's result stayed in memory for the server's life."""
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    futures = FutureStore(Journal(store, "srv"), keep_finished=3)
    rids = []
    for i in range(6):
        rid = futures.new(type="asample")
        futures.run(rid, lambda i=i: Result(json={"i": i}, samples=[], summary={"num_tokens": i}))
        rids.append(rid)
    assert len(futures._entries) == 3  # the three newest
    assert futures.known(rids[0]) and futures.wait(rids[0], 0).json == {"i": 0}  # from the store
    assert futures.wait(rids[5], 0).json == {"i": 5} and futures.wait(rids[5], 0).samples == []


def test_the_request_tables_get_upkeep_and_lose_no_row(tmp_path, monkeypatch):
    """Every request is a commit: without upkeep an open handle's state grew by about 0.2 MB a request (measured
    with 1,000 requests: 183 -> 385 MB; with upkeep every 200 commits it stays near 260 MB). Upkeep compacts and
    checkpoints the tables and every row is still there."""
    from sluiceway.flows.tinker import journal

    monkeypatch.setattr(journal, "UPKEEP_EVERY", 5)
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    futures = FutureStore(Journal(store, "srv"))
    for _ in range(12):
        rid = futures.new(type="asample")
        row = {"request_id": rid, "sequence_id": f"{rid}:0", "sample_index": 0, "sampling_session_id": None,
               "sampler_path": "base", "prompt_token_ids": [1, 2], "output_token_ids": [3], "logprobs": [-0.5],
               "stop_reason": "stop", "seed": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
               "max_tokens": 4}  # fmt: skip
        futures.run(rid, lambda row=row: Result(json={"i": 1}, samples=[row]))
    assert read_requests(store, "srv").num_rows == 12 and read_samples(store, "srv").num_rows == 12
    log = tmp_path / "store" / "tinker_requests" / "_delta_log"
    assert list(log.glob("*.checkpoint.parquet")), sorted(p.name for p in log.iterdir())
