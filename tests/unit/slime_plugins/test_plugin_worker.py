"""A slime generate function in its worker process (issue 52: code nobody here wrote costs at most its sample):
one that exits or blocks its event loop fails its own sample, the others it shared the worker with complete, and
attributes it sets on `args` reach the run's args (slime's plugins share one)."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading

from test_plugin_hooks import args_ns

from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings, guarded_generate
from sluiceway.tasks.rollout.slime_plugins.generate import SlimeGenerate
from sluiceway.tasks.rollout.slime_plugins.worker import plugin_worker

PLUGIN = """
import asyncio, os, threading, time
from slime.utils.types import Sample

async def generate(args, sample, sampling_params):
    args.calls_seen = getattr(args, "calls_seen", 0) + 1
    args.worker_pid = os.getpid()
    args.http_lock = threading.Lock()  # a value that cannot cross: it stays in the worker, the call goes on
    await asyncio.sleep(0.5)  # every sample is in the shared worker when the misbehaving ones strike
    if sample.index == 6:
        raise RuntimeError("the tool server is down")
    if sample.index == 7:
        return "garbage"
    if sample.index % 4 == 1:
        os._exit(3)
    if sample.index % 4 == 2:
        time.sleep(3600)  # blocks the worker's loop
    sample.tokens = [1, 2, 3, 10 + sample.index]
    sample.response_length = 1
    sample.rollout_log_probs = [-0.5]
    sample.status = Sample.Status.COMPLETED
    return sample
"""


class _State:  # GenerateState without a tokenizer to load (the run's side builds the sampling params)
    sampling_params = {"temperature": 1.0}


def test_an_exit_or_a_blocked_loop_costs_its_own_sample_only(tmp_path, monkeypatch):
    import slime.rollout.sglang_rollout as sr

    monkeypatch.setattr(sr, "GenerateState", lambda args: _State())
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "plug.py").write_text(textwrap.dedent(PLUGIN))
    path = f"{tmp_path / 'plug.py'}:generate"
    args = args_ns(tmp_path)
    args.run_side_lock = threading.Lock()  # set on the run's args by a hook: it cannot cross, the worker starts
    worker = plugin_worker(path, args, timeout_s=30.0)  # a loop silent for 10 s is called blocked
    from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin

    gen = SlimeGenerate(load_plugin(path, "--custom-generate-function-path"), path, args, False, worker)
    s = RolloutSettings(n_samples=4, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=0,
                        groups_needed=1, groups_submitted=1, custom_generate=gen, timeout_s=120.0)  # fmt: skip

    async def sample(i):
        ctx = GenerateContext(client=None, tokenizer=None, rid=f"run/0/0/{i}", max_new_tokens=8)
        return await guarded_generate(s, ctx, PromptItem(f"p{i}", "Q?", [1], "4", {}), {"sampling_seed": i})

    async def main():
        together = await asyncio.gather(*(sample(i) for i in range(4)))
        seen.append(args.calls_seen)
        later = [await sample(i) for i in (4, 6, 7)]  # in a new shared worker, which starts from the run's args
        return [*together, *later]

    seen = []
    try:
        results = asyncio.run(main())
    finally:
        gen.close()
    assert [r.token_ids for r in (results[0], results[3])] == [[10], [13]]
    assert [r.finish_reason for r in results] == ["stop", "failed", "failed", "stop", "stop", "failed", "failed"]
    raised, garbage = (r.row_metadata["failure_reason"] for r in results[5:7])
    assert "raised RuntimeError: the tool server is down" in raised, raised
    assert "returned str, not a slime Sample" in garbage, garbage
    exited, blocked = (r.row_metadata["failure_reason"] for r in results[1:3])
    assert "exited with code 3 during the call" in exited, exited
    assert "was killed after 10 s without a sign of life" in blocked, blocked
    assert results[4].token_ids == [14]
    # what the plugin set reached the run's args (each call alone counted on from them), and the next shared
    # worker started from them
    # (a call that failed brings nothing back)
    assert seen[0] >= 1 and args.calls_seen == seen[0] + 1 and args.worker_pid != os.getpid()
    assert not hasattr(args, "http_lock")
