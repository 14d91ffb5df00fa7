"""Who can reach what on `sluiceway tinker serve` (issue 52 point 11), with the real SDK: with --api-keys-file a
request needs one of its keys and sees only what its key made; without keys the server will not bind beyond
loopback; two servers cannot share one (store, server id); sampler names are checked."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from tinker_helpers import CLIENT_ENV, TinkerServer

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.skipif(tinker.__version__ != "0.38.0", reason="the wire format is 0.38.0's")

ALICE, BOB = "tml-alice-0123456789", "tml-bob-9876543210"


def test_each_key_sees_only_what_it_made_and_a_request_without_one_is_refused(tmp_path, module_cache):
    keys = tmp_path / "keys"
    keys.write_text(f"# the team's keys\n{ALICE}\n\n{BOB}\n")
    server = TinkerServer(tmp_path / "srv", module_cache, extra=("--api-keys-file", str(keys))).start()
    try:
        os.environ.update(CLIENT_ENV)
        alice = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
        tc = alice.create_lora_training_client(base_model="tiny-llama", rank=2).result()
        tok = tc.get_tokenizer()
        ids = tok.encode("Mine, not yours.")
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                   loss_fn_inputs={"target_tokens": ids[1:]})  # fmt: skip
        tc.forward([datum], "cross_entropy").result()
        model_id = tc.model_id
        with pytest.raises(Exception, match="state name"):
            tc.save_weights_for_sampler("../../escape").result()

        url = f"{server.url}/api/v1"
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200  # the one route without a key
        r = httpx.post(f"{url}/get_info", json={"model_id": model_id}, timeout=10)
        assert r.status_code == 401 and "needs an API key" in r.json()["error"]
        mallory = {"X-API-Key": "tml-mallory"}
        r = httpx.post(f"{url}/get_info", json={"model_id": model_id}, headers=mallory, timeout=10)
        assert r.status_code == 401 and "not one of this server's" in r.json()["error"]
        as_alice, as_bob = {"X-API-Key": ALICE}, {"X-API-Key": BOB}
        step = httpx.post(f"{url}/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=as_alice)
        rid = step.json()["request_id"]
        for route, body in [("get_info", {"model_id": model_id}),
                            ("optim_step", {"model_id": model_id, "adam_params": {}}),
                            ("retrieve_future", {"request_id": rid})]:  # fmt: skip
            r = httpx.post(f"{url}/{route}", json=body, headers=as_bob, timeout=20)
            assert r.status_code == 404 and "unknown" in r.json()["error"], (route, r.text[:300])
        r = httpx.get(f"{url}/training_runs/{model_id}", headers=as_bob, timeout=10)
        assert r.status_code == 404
        r = httpx.post(f"{url}/retrieve_future", json={"request_id": rid}, headers=as_alice, timeout=30)
        assert r.status_code == 200 and "grad_norm:mean" in r.text  # the owner still can
        alice.close("success").result()
    finally:
        server.stop()
    log = server.log_text()
    assert ALICE not in log and BOB not in log and "Traceback" not in log


def test_no_keys_beyond_loopback_and_one_server_per_store_and_id(tmp_path, module_cache):
    env = dict(os.environ, SLUICEWAY_CACHE=str(module_cache))
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--host", "0.0.0.0", "--port", "1",
           "--work-dir", str(tmp_path / "w")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "without --api-keys-file anyone who reaches the port" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr

    first = TinkerServer(tmp_path / "a", module_cache, server_id="shared").start()
    try:
        second = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--port", "1",
                  "--work-dir", str(tmp_path / "b"), "--store", str(first.store), "--server-id", "shared"]  # fmt: skip
        out = subprocess.run(second, capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 2 and "held by `sluiceway tinker serve`" in out.stderr, out.stderr
    finally:
        first.stop()
