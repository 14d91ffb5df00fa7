"""Long-run storage cost (issue 19): the storage and ledger calls of N RL steps, timed per step and per call.

Each step makes the calls one step of the `sluiceway-rl` flow makes (flows/rl.py, tasks/), on synthetic rows
shaped like tasks/rollout/rollout.py's `_row` (random token ids, logprobs, loss masks):

- rollout: `finished_stage` (the ledger check of `_ledgered`), two `append_trajectory_groups` commits (the
  rollout writer appends groups in batches; here half the groups each), `record_stage`;
- reward: `finished_stage`, `read_trajectories(run, step)`, `set_rewards` (merge), `record_stage`;
- filter: `finished_stage`, `read_trajectories(run, step)`, `set_filter_reasons` (merge), `record_stage`;
- train: `read_trajectories(run, step)`; then one `append_metrics`.

Per step it reports the storage time (total and per call kind) at checkpoint steps (default 10, 100, 1000,
3000; those <= N), each the median over a small window of steps ending there (so one slow step does not
decide it), plus the tables' size on disk (files and bytes). On S3 (`--store s3`: the SeaweedFS server the
tests use, on loopback) it also counts the S3 requests per step, from the server's Prometheus counter
(`SeaweedFS_s3_request_total`, `weed mini -metricsPort`).

    .venv/bin/python benchmarks/bench_long_run.py --steps 3                        # smoke run
    .venv/bin/python benchmarks/bench_long_run.py --steps 300 --out /tmp/long.json --doc
    .venv/bin/python benchmarks/bench_long_run.py --store s3 --steps 100 --doc
    .venv/bin/python benchmarks/bench_long_run.py --steps 3000 --checkpoints 10,100,1000,3000 --max-minutes 60

`--max-minutes` stops the run after that long (the steps reached are reported). `--doc` writes a section of
docs/benchmarks.md per store ("## Long-run storage cost (local)" / "(s3)").
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

from bench_doc import machine_line, write_section  # benchmarks/ is the script's own directory

from sluiceway.storage.maintenance import maintain_run
from sluiceway.storage.metrics import METRICS, append_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.stages import STAGES, finished_stage, record_stage
from sluiceway.storage.trajectories import (
    TRAJECTORIES,
    append_trajectory_groups,
    read_trajectories,
    set_filter_reasons,
    set_rewards,
)

SECTION = "## Long-run storage cost"  # + " (local)" / " (s3)"
TABLES = (TRAJECTORIES, STAGES, METRICS)
RUN_ID = "long-run"
# Call kinds, in the order a step makes them (the keys of the per-step timings).
KINDS = ("finished_stage", "append_groups", "record_stage", "read_trajectories", "set_rewards",
         "set_filter_reasons", "append_metrics")


# --- synthetic rows -------------------------------------------------------------------------------------------


def make_row(rng: random.Random, step: int, group: int, i: int, prompt_len: int, response_len: int) -> dict:
    """One sample, with the fields `_row` in tasks/rollout/rollout.py writes (synthetic token ids)."""
    n = rng.randint(response_len // 2, response_len)
    tokens = [rng.randrange(32000) for _ in range(n)]
    return {
        "run_id": RUN_ID,
        "step": step,
        "group_id": group,
        "sample_index": i,
        "prompt_id": f"p{step}-{group}",
        "prompt": f"synthetic prompt {step}/{group}",
        "label": "42",
        "prompt_token_ids": [rng.randrange(32000) for _ in range(prompt_len)],
        "response_token_ids": tokens,
        "response_text": " ".join(map(str, tokens[:32])),
        "rollout_logprobs": [-rng.random() for _ in range(n)],
        "loss_mask": [1] * n,
        "status": "completed",
        "finish_reason": "stop",
        "weight_version": step,
        "weight_versions": [step],
        "engine": "engine-0",
        "pool": "local",
        "gen_time_s": rng.random(),
        "created_at": datetime.now(UTC),
        "metadata": json.dumps({"bench": True}),
    }


# --- S3 request counting ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _with_metrics_port(port: int):
    """Start `weed mini` with `-metricsPort=port` (infra/s3_server.py has no option for it): its Popen, patched."""
    import sluiceway.infra.s3_server as s3_server

    real = subprocess.Popen

    def popen(args, *a, **kw):
        if isinstance(args, list) and len(args) > 1 and args[1] == "mini":
            args = [*args, f"-metricsPort={port}", "-metricsIp=127.0.0.1"]
        return real(args, *a, **kw)

    s3_server.subprocess.Popen = popen
    try:
        yield
    finally:
        s3_server.subprocess.Popen = real


_REQ = re.compile(r'^SeaweedFS_s3_request_total\{([^}]*)\}\s+([0-9.eE+]+)$', re.M)


class S3Counter:
    """Reads SeaweedFS's `SeaweedFS_s3_request_total` counters (by request type) from its metrics port."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def snapshot(self) -> dict[str, float] | None:
        try:
            text = urllib.request.urlopen(self.url, timeout=5).read().decode()
        except OSError:
            return None
        out: dict[str, float] = defaultdict(float)
        for labels, value in _REQ.findall(text):
            kind = re.search(r'type="([^"]*)"', labels)
            out[kind.group(1) if kind else "?"] += float(value)
        return dict(out)

    @staticmethod
    def diff(after: dict[str, float] | None, before: dict[str, float] | None) -> dict[str, float] | None:
        if after is None or before is None:
            return None
        return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


# --- the step -----------------------------------------------------------------------------------------------


class Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, kind: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[kind] += time.perf_counter() - t0
            self.calls[kind] += 1


def one_step(store: ObjectStore, step: int, groups: int, samples: int, rng: random.Random, args) -> Timer:
    t = Timer()
    batches = [
        ([make_row(rng, step, g, i, args.prompt_len, args.response_len) for i in range(samples)],
         f"rollout/{RUN_ID}/{step}/{g}")
        for g in range(groups)
    ]
    # rollout
    with t("finished_stage"):
        finished_stage(store, RUN_ID, step, "rollout")
    half = max(1, len(batches) // 2)
    for part in (batches[:half], batches[half:]):
        if part:
            with t("append_groups"):
                append_trajectory_groups(store, part)
    with t("record_stage"):
        record_stage(store, RUN_ID, step, "rollout", {"groups": groups, "gen_time_s": 1.0})
    # reward
    with t("finished_stage"):
        finished_stage(store, RUN_ID, step, "reward")
    with t("read_trajectories"):
        rows = read_trajectories(store, RUN_ID, step).to_pylist()
    rewards = [(r["group_id"], r["sample_index"], rng.random(), json.dumps({"ok": True})) for r in rows]
    with t("set_rewards"):
        set_rewards(store, RUN_ID, step, rewards)
    with t("record_stage"):
        record_stage(store, RUN_ID, step, "reward", {"scored": len(rows), "errors": 0})
    # filter
    with t("finished_stage"):
        finished_stage(store, RUN_ID, step, "filter")
    with t("read_trajectories"):
        rows = read_trajectories(store, RUN_ID, step).to_pylist()
    reasons = [(r["group_id"], r["sample_index"], "zero_std" if r["group_id"] == 0 else None) for r in rows]
    with t("set_filter_reasons"):
        set_filter_reasons(store, RUN_ID, step, reasons)
    with t("record_stage"):
        record_stage(store, RUN_ID, step, "filter", {"kept": len(rows) - samples})
    # train
    with t("read_trajectories"):
        read_trajectories(store, RUN_ID, step)
    with t("append_metrics"):
        append_metrics(store, RUN_ID, step, {f"m/{k}": rng.random() for k in range(24)}, tag="train")
    return t


def table_sizes(root: Path) -> dict[str, dict[str, int]]:
    """Files and bytes per table directory (data files and _delta_log together, and the log alone)."""
    out = {}
    for name in TABLES:
        d = root / name
        files = [p for p in d.rglob("*") if p.is_file()] if d.exists() else []
        log = [p for p in files if "_delta_log" in p.parts]
        out[name] = {
            "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "log_files": len(log),
            "log_bytes": sum(p.stat().st_size for p in log),
        }
    return out


def s3_table_sizes(store: ObjectStore) -> dict[str, dict[str, int]]:
    fs = store.filesystem()
    out = {}
    for name in TABLES:
        base = store.table_uri(name)
        try:
            found = fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        log = {k: v for k, v in found.items() if "/_delta_log/" in k}
        out[name] = {
            "files": len(found),
            "bytes": int(sum(v.get("size", 0) for v in found.values())),
            "log_files": len(log),
            "log_bytes": int(sum(v.get("size", 0) for v in log.values())),
        }
    return out


# --- report -------------------------------------------------------------------------------------------------


def summarize(steps: list[dict], checkpoints: list[int], window: int) -> list[dict]:
    """Per checkpoint c (1-based step count): medians over steps c-window+1 .. c."""
    out = []
    for c in checkpoints:
        if c > len(steps):
            continue
        span = steps[max(0, c - window):c]
        row = {"step": c, "window": len(span), "total_s": statistics.median(s["total_s"] for s in span)}
        row["per_kind_s"] = {k: statistics.median(s["times"].get(k, 0.0) for s in span) for k in KINDS}
        reqs = [s["s3_requests"] for s in span if s.get("s3_requests") is not None]
        if reqs:
            row["s3_requests"] = statistics.median(sum(r.values()) for r in reqs)
            kinds = sorted({k for r in reqs for k in r})
            row["s3_requests_by_type"] = {k: statistics.median(r.get(k, 0.0) for r in reqs) for k in kinds}
        out.append(row)
    return out


def render(res: dict) -> str:
    store, a = res["store"], res["args"]
    lines = [
        f"{SECTION} ({store})",
        "",
        f"`benchmarks/bench_long_run.py --store {store} --steps {a['steps']} --groups {a['groups']} "
        f"--samples {a['samples']} --retention-hours {a.get('retention_hours', 168)} "
        f"--idempotency-hours {a.get('idempotency_hours', 1.0)} "
        f"--maintenance-every {a.get('maintenance_every', 0)}`: the storage and ledger calls of one RL step each "
        "step (two group appends, three ledger checks and three records, three reads of the step, the reward and "
        "filter updates, one metrics append) on synthetic rows "
        f"({a['groups']} groups x {a['samples']} samples, {a['prompt_len']}-token prompts, up to "
        f"{a['response_len']}-token responses). Reached {res['steps_done']} of {a['steps']} steps in "
        f"{res['wall_s']:.0f} s{' (stopped by --max-minutes)' if res['stopped_early'] else ''}; "
        f"measured {res['date']}. Each row: medians over the {a['window']} steps ending at that step.",
        "",
    ]
    has_req = any("s3_requests" in r for r in res["checkpoints"])
    head = ["after step", "storage s/step"] + [f"`{k}`" for k in KINDS] + (["S3 requests/step"] if has_req else [])
    lines += ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in res["checkpoints"]:
        cells = [str(r["step"]), f"{r['total_s']:.3f}"] + [f"{r['per_kind_s'][k]:.3f}" for k in KINDS]
        if has_req:
            cells.append(f"{r.get('s3_requests', float('nan')):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per-kind columns are the time of all calls of that kind in one step (e.g. three reads).", ""]
    if has_req:
        last = res["checkpoints"][-1]
        by = ", ".join(f"{k} {v:.0f}" for k, v in last.get("s3_requests_by_type", {}).items())
        lines += [f"S3 requests per step by type at step {last['step']}: {by}.", ""]
    else:
        lines += ["S3 requests: not counted for this store.", ""] if store == "local" else [
            "S3 requests: the server's metrics port did not answer; not counted.", ""]
    ups = res.get("upkeeps") or []
    if ups:
        secs = sorted(u["seconds"] for u in ups)
        reqs = [u["s3_requests"] for u in ups if u.get("s3_requests") is not None]
        lines += [
            f"Upkeep (storage/maintenance.py, all three tables) every {a['maintenance_every']} steps, "
            f"{len(ups)} times: median {statistics.median(secs):.2f} s, max {secs[-1]:.2f} s, i.e. "
            f"{sum(secs) / max(1, res['steps_done']):.3f} s a step amortized; not in the per-step columns"
            + (f"; S3 requests per upkeep: median {statistics.median(reqs):.0f}" if reqs else "") + ".",
            "",
        ]
    else:
        lines += ["No upkeep (--maintenance-every 0).", ""]
    lines += ["Tables at the end:", "", "| table | files | bytes | log files | log bytes |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, s in res["sizes"].items():
        lines.append(f"| {name} | {s['files']} | {s['bytes']:,} | {s['log_files']} | {s['log_bytes']:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--store", choices=["local", "s3"], default="local")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per group")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--checkpoints", default="10,100,1000,3000", help="comma-separated steps to report")
    p.add_argument("--window", type=int, default=25, help="steps per checkpoint median (fewer at the first ones)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this long; report steps reached")
    p.add_argument("--dir", default=None, help="where the store lives (default: a temporary directory, removed)")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--doc", action="store_true", help="write a section of docs/benchmarks.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--maintenance-every", type=int, default=50,
                   help="table upkeep every N steps, as storage.maintenance_interval (0: none, the old behaviour)")
    p.add_argument("--retention-hours", type=float, default=24.0, help="replay retention (storage.retention_hours)")
    p.add_argument("--idempotency-hours", type=float, default=1.0, help="id window (storage.idempotency_hours)")
    p.add_argument("--from-json", default=None, help="render a saved --out file again (no run)")
    a = p.parse_args(argv)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        if a.window != res["args"]["window"]:  # medians over another window, from the stored per-step times
            res["args"]["window"] = a.window
            res["checkpoints"] = summarize(res["steps"], [c["step"] for c in res["checkpoints"]], a.window)
        text = render(res)
        print(text)
        if a.doc:
            write_section(text, f"{SECTION} ({res['store']})", machine=res.get("machine"))
        return res
    checkpoints = sorted({int(x) for x in a.checkpoints.split(",") if x.strip()})
    if a.steps not in checkpoints:  # always report where the run ended
        checkpoints.append(a.steps)
    rng = random.Random(a.seed)

    with ExitStack() as stack:
        base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-long-run-"))
        if not a.dir:
            stack.callback(shutil.rmtree, base, True)
        counter = None
        if a.store == "local":
            root = base / "store"
            store = ObjectStore.from_uri(str(root))
        else:
            import os

            from sluiceway.infra.s3_server import SeaweedS3

            port = _free_port()
            with _with_metrics_port(port):
                server = stack.enter_context(SeaweedS3(base / "seaweedfs"))
            os.environ.update(server.env())
            store = ObjectStore.from_uri(f"s3://{server.bucket}/long-run-{int(time.time())}")
            counter = S3Counter(port)
            if counter.snapshot() is None:
                print("warning: SeaweedFS metrics port does not answer; S3 requests not counted", file=sys.stderr)
                counter = None

        steps: list[dict] = []
        t_start = time.perf_counter()
        deadline = t_start + a.max_minutes * 60 if a.max_minutes else None
        stopped = False
        upkeeps: list[dict] = []
        for step in range(a.steps):
            before = counter.snapshot() if counter else None
            t0 = time.perf_counter()
            timer = one_step(store, step, a.groups, a.samples, rng, a)
            total = time.perf_counter() - t0
            reqs = S3Counter.diff(counter.snapshot(), before) if counter else None
            steps.append({"step": step + 1, "total_s": total, "times": dict(timer.times),
                          "calls": dict(timer.calls), "s3_requests": reqs})
            if a.maintenance_every and (step + 1) % a.maintenance_every == 0:  # as flows/rl.py's upkeep task
                before = counter.snapshot() if counter else None
                t0 = time.perf_counter()
                done = maintain_run(store, RUN_ID, step + 1, a.retention_hours, idempotency_hours=a.idempotency_hours)
                reqs = S3Counter.diff(counter.snapshot(), before) if counter else None
                upkeeps.append({"step": step + 1, "seconds": time.perf_counter() - t0,
                                "s3_requests": sum(reqs.values()) if reqs else None,
                                "tables": {u.table: vars(u) for u in done}})
            if (step + 1) in checkpoints or (step + 1) % 25 == 0 or step == 0:
                extra = f", {sum(reqs.values()):.0f} S3 requests" if reqs else ""
                print(f"step {step + 1}: {total:.3f} s storage{extra} "
                      f"(elapsed {time.perf_counter() - t_start:.0f} s)", flush=True)
            if deadline and time.perf_counter() > deadline and step + 1 < a.steps:
                stopped = True
                print(f"stopping after {step + 1} steps (--max-minutes {a.max_minutes})", flush=True)
                break
        wall = time.perf_counter() - t_start
        sizes = table_sizes(root) if a.store == "local" else s3_table_sizes(store)

    if stopped and len(steps) not in checkpoints:
        checkpoints.append(len(steps))
    res = {
        "store": a.store,
        "args": vars(a),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine_line(),
        "steps_done": len(steps),
        "stopped_early": stopped,
        "wall_s": wall,
        "checkpoints": summarize(steps, sorted(set(checkpoints)), a.window),
        "sizes": sizes,
        "upkeeps": upkeeps,
        "steps": steps,
    }
    text = render(res)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if a.doc:
        write_section(text, f"{SECTION} ({a.store})")
    return res


if __name__ == "__main__":
    main()
