"""Elastic inference pools behind WAN-like links (issue 34 point 5): samples/s of a run that has no engines of its
own with 1, 2 and 3 remote pools, and how long a pool that joins a live run takes to register and to get its
first group trained.

Every pool is `sluiceway pools up` (a router, one tiny-llama engine, the pool agent) in its OWN network namespace,
joined to this one by its own veth pair (sluiceway.infra.netns.WanLink, shaped with tc to --rate each way). Each
pool reaches the weight store (a real SeaweedFS S3 server on 127.0.0.1, which also holds the pool registry)
only through a delaying proxy on its link's home end, and the run reaches each pool's router through a second
delaying proxy on the pool's end (--rtt-ms / 2 each way in each proxy: an --rtt-ms round trip per request). A
pool registers that proxy's URL, so the run finds it with `--rollout-pools auto` (tests/wan_helpers.py).

The run: a real `sluiceway run` on tiny-llama, `--rollout-num-engines 0 --rollout-pools auto --update-weight-mode
delta --weights-uri s3://...` (--mode fully-async with --max-staleness 1 by default), --prompts x 4 samples a
step. tiny-llama on a CPU generates too fast for the number of pools to matter, so every sample first waits
--pace-s seconds inside the run's generate function (tests/data/gated_generate.py) while it holds one of its
pool's --capacity slots: that wait stands in for a real pool's generation time, so a pool gives at most
capacity / pace samples/s.

Part 1, for K in --pools: K pools are up and serving before the run starts; the run makes --steps steps.
samples/s = the trained samples of the steps after --skip-steps over the time from step --skip-steps' end to the
last step's end (a step's end: the created_at of its last trained row; the first steps wait for v0 to reach the
pools). Also per-pool sample counts. With one group per pool (--capacity 4), --prompts 6 makes whole rounds on 1,
2 and 3 pools; with 4 prompts a step, 3 pools gain nothing over 2 (4 groups take two rounds either way).

Part 2 (join): a run starts with one pool; once the store holds version --join-at-step - 1 (the run is at step
--join-at-step) a second pool is started. At its first poll the pool agent registers at once (its record, serving
what its engines serve then: the base weights), and only then downloads the newest version, has its engine load
it and writes the record again with the new `serving`. Times, from starting its `pools up` process: engines up
(router and engine started, model loaded: its agent starts polling as `pools up` prints its line), registered (the
record first appears in the registry, watched every 0.1 s), weights held (the agent downloaded the newest version
through the link and checked and renamed it into place: its current/manifest.json appears), serving (the record's
`serving` reaches the newest version in the store at that moment, or the version of the pool's first trained
group if that is older: what the run needed), first trained group (created_at of its first trained row). The
headline is registration -> first trained group (the version download included), with the parts between.

    .venv/bin/python benchmarks/bench_elastic_pools.py --steps 2 --pools 1 --join-steps 5      # a quick check
    .venv/bin/python benchmarks/bench_elastic_pools.py --write-doc
Needs root (network namespaces, veth, tc).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_doc
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # wan_helpers, cli_run, paths

from bench_doc import DOC, write_section  # noqa: E402

SECTION = "## Elastic pools behind WAN-like links (issue 34)"
ROUTER_PORT = 30000  # each pool's router, inside its own namespace (so one port for all)


def cpu_model() -> tuple[str, bool]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    return name, " avx512f" in flags


class Setup:
    """The store, the links and the store proxies; pools and runs are made per measurement."""

    def __init__(self, args, s3, links, store_proxies, work: Path):
        from sluiceway.models.zoo import resolve_checkpoint

        self.args, self.s3, self.links, self.store_proxies, self.work = args, s3, links, store_proxies, work
        self.model_dir = resolve_checkpoint("tiny-llama")

    def uri(self, tag: str) -> str:
        return f"s3://{self.s3.bucket}/elastic-{tag}-{uuid.uuid4().hex[:6]}/weights"

    def pool(self, i: int, uri: str, tag: str):
        from wan_helpers import remote_pool

        a = self.args
        d = self.work / f"{tag}-pool{i}"
        shutil.rmtree(d, ignore_errors=True)
        env = dict(self.s3.env(), AWS_ENDPOINT_URL=self.store_proxies[i].url)
        return remote_pool(self.links[i], d, model=str(self.model_dir), weights_uri=uri, store_env=env,
                           name=f"p{i}", poll_interval_s=a.poll_interval, delay_s=a.rtt_ms / 2000,
                           router_port=ROUTER_PORT, capacity=a.capacity, heartbeat_s=a.heartbeat_s)  # fmt: skip

    def start_run(self, tag: str, uri: str, steps: int, pools: int) -> tuple[subprocess.Popen, Path, Path]:
        from cli_run import N, cli_args
        from paths import DATA

        a = self.args
        run_dir = self.work / f"{tag}-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = cli_args(run_dir, "--num-rollout", str(steps), "--mode", a.mode, "--max-staleness", str(a.max_staleness),
                       "--save-interval", str(10**6), "--rollout-num-engines", "0", "--rollout-pools", "auto",
                       "--update-weight-mode", "delta", "--weights-uri", uri,
                       "--rollout-max-concurrency", str(max(a.capacity * pools, 16)),
                       "--custom-generate-function-path", f"{DATA / 'gated_generate.py'}:generate",
                       "--rollout-batch-size", str(a.prompts), "--global-batch-size", str(a.prompts * N))  # fmt: skip
        env = dict(os.environ, **self.s3.env(), SLUICEWAY_TEST_PACE_S=str(a.pace_s))
        env.pop("SLUICEWAY_TEST_GATE", None)
        log_path = self.work / f"{tag}-run.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        return proc, run_dir, log_path


def finish(proc: subprocess.Popen, log_path: Path, timeout_s: float = 1800) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        sys.exit(f"run failed ({rc}):\n{log_path.read_text(errors='replace')[-5000:]}")


def trained_rows(run_dir: Path) -> list[dict]:
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    # The run id is the run directory's name.
    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), run_dir.name).to_pylist()
    return [r for r in rows if r["status"] != "aborted" and r["filter_reason"] is None]


def measure_pools(setup: Setup, k: int) -> dict:
    a = setup.args
    tag = f"k{k}"
    uri = setup.uri(tag)
    with contextlib.ExitStack() as stack:
        t0 = time.monotonic()
        for i in range(k):  # one after another, from this thread: a pool dies with the thread that started it
            stack.enter_context(setup.pool(i, uri, tag))
        pools_up_s = time.monotonic() - t0
        t1 = time.monotonic()
        proc, run_dir, log_path = setup.start_run(tag, uri, a.steps, k)
        finish(proc, log_path)
        run_s = time.monotonic() - t1
    rows = trained_rows(run_dir)
    # Whole steps between two step ends (a step's end: its last trained row's created_at), so the clock starts
    # and stops at the same point of a step.
    ends: dict[int, float] = {}
    for r in rows:
        ends[r["step"]] = max(ends.get(r["step"], 0.0), r["created_at"].timestamp())
    last = max(ends, default=None)
    steady = [r for r in rows if last is not None and a.skip_steps < r["step"] <= last]
    span = ends[last] - ends[a.skip_steps] if steady and a.skip_steps in ends else 0.0
    rate = len(steady) / span if span > 0 else None
    per_pool = {f"p{i}": sum(r["pool"] == f"p{i}" for r in rows) for i in range(k)}
    r = {"pools": k, "steps": len({r["step"] for r in rows}), "samples": len(rows), "steady_samples": len(steady),
         "samples_per_s": rate, "run_s": run_s, "pools_up_s": pools_up_s, "per_pool": per_pool}  # fmt: skip
    print(json.dumps(r), flush=True)
    return r


def measure_join(setup: Setup) -> dict:
    """One pool from the start; a second started when the run reaches --join-at-step."""
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights.pool_registry import PoolRegistry
    from sluiceway.storage.weights.store import WeightStore

    a = setup.args
    uri = setup.uri("join")
    wstore = WeightStore(ObjectStore.from_uri(uri))
    registry = PoolRegistry(wstore)
    seen: dict[str, float] = {}  # wall-clock times (time.time(), as created_at)
    # (time, the record's serving, the store's newest version) each time either changes, from registration on:
    # when the pool began serving what the run needed is decided once its first trained group is known.
    changes: list[tuple[float, int | None, int | None]] = []
    manifest = setup.work / "join-pool1" / "p1" / "agent" / "current" / "manifest.json"
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if "held" not in seen and manifest.exists():
                seen["held"] = time.time()
                with contextlib.suppress(OSError, ValueError, KeyError):
                    seen["held_version"] = json.loads(manifest.read_text())["version"]
            try:
                rec = registry.records().get("p1")
                newest = wstore.newest()
            except Exception:  # noqa: BLE001 - a listing mid-write may fail; look again
                rec = None
            now = time.time()
            if rec is not None:
                if "registered" not in seen:
                    seen["registered"] = now
                    seen["registered_version"] = rec.serving
                if not changes or changes[-1][1:] != (rec.serving, newest):
                    changes.append((now, rec.serving, newest))
            stop.wait(0.1)

    with contextlib.ExitStack() as stack:
        stack.enter_context(setup.pool(0, uri, "join"))
        proc, run_dir, log_path = setup.start_run("join", uri, a.join_steps, 2)
        stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        while (wstore.newest() or 0) < a.join_at_step - 1:
            if proc.poll() is not None:
                sys.exit(f"the run ended before step {a.join_at_step}:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.1)
        newest_at_start = wstore.newest()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stack.callback(stop.set)
        seen["start"] = time.time()
        stack.enter_context(setup.pool(1, uri, "join"))
        seen["engines_up"] = time.time()
        finish(proc, log_path)
        stop.set()
        watcher.join()
    rows = trained_rows(run_dir)
    mine = sorted((r for r in rows if r["pool"] == "p1"), key=lambda r: r["created_at"])
    first = mine[0] if mine else None
    first_version = min(first["weight_versions"] or [first["weight_version"]]) if first else None

    # Serving what the run needs: the newest version in the store at that moment, or (fully-async allows a pool
    # --max-staleness versions behind) the version its first trained group was made at, if that is older.
    def needed(newest: int | None) -> int | None:
        return first_version if newest is None else newest if first_version is None else min(newest, first_version)

    served = next((c for c in changes if c[1] is not None and needed(c[2]) is not None and c[1] >= needed(c[2])),
                  None)  # fmt: skip

    def since_start(key: str) -> float | None:
        return seen[key] - seen["start"] if key in seen else None

    out = {
        "newest_at_start": newest_at_start, "start_step": a.join_at_step,
        "engines_up_s": since_start("engines_up"),
        "registered_s": since_start("registered"), "registered_version": seen.get("registered_version"),
        "held_s": since_start("held"), "first_fetched": seen.get("held_version"),
        "serving_s": served[0] - seen["start"] if served else None,
        "serving_version": served[1] if served else None, "newest_when_serving": served[2] if served else None,
        "first_trained_s": first["created_at"].timestamp() - seen["start"] if first else None,
        "first_trained_step": first["step"] if first else None, "first_trained_version": first_version,
        "record_changes": [(round(t - seen["start"], 2), v, n) for t, v, n in changes[:12]],
        "p1_samples": len(mine), "p0_samples": sum(r["pool"] == "p0" for r in rows), "steps": a.join_steps,
    }  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def fmt(x, spec=".1f") -> str:
    return "?" if x is None else format(x, spec)


def fmt1(step: int | None) -> str:
    return "?" if step is None else str(step + 1)  # rows count steps from 0


def span(j: dict, a: str, b: str) -> float | None:
    return None if j.get(a) is None or j.get(b) is None else j[b] - j[a]


def vfmt(version: int | None) -> str:
    return "none" if version is None else f"v{version}"


def render(args, results: list[dict], join: dict | None, cpu: tuple[str, bool], load: str, date: str) -> str:
    name, avx512 = cpu
    base = next((r["samples_per_s"] for r in results if r["pools"] == 1), None)
    mode = f"{args.mode}" + (f", --max-staleness {args.max_staleness}" if args.mode == "fully-async" else "")
    lines = [
        SECTION, "",
        f"`benchmarks/bench_elastic_pools.py --rate {args.rate} --rtt-ms {args.rtt_ms:g} --pace-s {args.pace_s:g} "
        f"--capacity {args.capacity} --prompts {args.prompts} --steps {args.steps} --mode {args.mode}` ({date}, "
        f"load average {load} at the "
        f"start, on {name}, {'with' if avx512 else 'without'} AVX-512, a machine shared with other work). Each pool "
        "is `sluiceway pools up` with one tiny-llama engine in its own network namespace behind its own veth pair "
        f"({args.rate} each way, {args.shaper}); it reaches the SeaweedFS weight store (and the pool registry "
        f"beside it) through a proxy adding {args.rtt_ms / 2:g} ms each way, and registers the URL of a second such "
        "proxy in front of its router, which the run uses. The run: `sluiceway run` on tiny-llama with "
        "`--rollout-num-engines 0 --rollout-pools auto --update-weight-mode delta --weights-uri s3://...` "
        f"({mode}), {args.prompts} prompts x 4 samples a step (a multiple of the pools' capacity for every pool "
        f"count here, so no count is left with a half-used round). Every sample first waits {args.pace_s:g} s in "
        "the run's "
        f"generate function while it holds one of its pool's {args.capacity} slots (`capacity`): the wait stands "
        "in for a real pool's generation time (tiny-llama alone is too fast on 2 cores for the pool count to "
        f"matter), so one pool gives at most {args.capacity / args.pace_s:g} samples/s. samples/s: the trained "
        f"samples of steps {args.skip_steps + 1} to the last over the time from step {args.skip_steps}'s end to the "
        "last step's (a step's end: the created_at of its last trained row); all pools serve before the run starts, "
        f"and steps 0 to {args.skip_steps} are left out as warm-up.", "",
        "| pools | steps | samples/s | x 1 pool | samples per pool | run s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in results:
        ratio = f"{r['samples_per_s'] / base:.2f}" if base and r["samples_per_s"] else "?"
        per = ", ".join(f"{k} {v}" for k, v in r["per_pool"].items())
        lines.append(f"| {r['pools']} | {r['steps']} | {fmt(r['samples_per_s'], '.2f')} | {ratio} | {per} | "
                     f"{r['run_s']:.0f} |")  # fmt: skip
    if join is not None:
        j = join
        lines += [
            "",
            f"A pool joining a live run: the run starts with pool p0; when the store holds v{j['newest_at_start']} "
            f"(the run at step {j['start_step']}) a second pool, p1, is started in its own namespace. At its first "
            "poll its agent registers at once (serving what its engines serve then: the base weights), then downloads "
            "the newest version, has its engine load it and writes its record again. From starting its `pools up` "
            "process (seconds):", "",
            "| engines up | registered | weights held | serving | first trained group |",
            "| --- | --- | --- | --- | --- |",
            f"| {fmt(j['engines_up_s'])} | {fmt(j['registered_s'])} | {fmt(j.get('held_s'))} | "
            f"{fmt(j.get('serving_s'))} | {fmt(j['first_trained_s'])} |",
            "",
            f"**Registration to first trained group: {fmt(span(j, 'registered_s', 'first_trained_s'))} s**, the "
            f"version download included: registered to weights held {fmt(span(j, 'registered_s', 'held_s'))} s, "
            f"to serving {fmt(span(j, 'held_s', 'serving_s'))} s more, to the first trained group "
            f"{fmt(span(j, 'serving_s', 'first_trained_s'))} s more. engines up: its router and engine started and "
            "the model loaded (`pools up` prints its line as its agent starts polling); registered: the agent's first "
            f"record (serving {vfmt(j['registered_version'])}, what its engine loaded at start) seen in the registry "
            "(read every 0.1 s); weights "
            f"held: the agent found the newest version (v{j['first_fetched']}), downloaded it through the link (no "
            "held copy: the last full version and the deltas after it), checked and renamed it into place; serving: "
            f"its record says it serves {vfmt(j.get('serving_version'))} (the store's newest then: "
            f"{vfmt(j.get('newest_when_serving'))}; its first trained group was made at "
            f"{vfmt(j.get('first_trained_version'))}), so runs may send it groups; the rest is the run's next "
            "refresh of the registry (every 1 s), the dispatch of a group, its paced samples and their generation "
            f"through the proxy. The first trained row of p1 is of step {fmt1(j['first_trained_step'])} (counted "
            f"from 1, as the run's log counts); over the run's {j['steps']} steps p1 made {j['p1_samples']} trained "
            f"samples, p0 {j['p0_samples']}.",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="1,2,3", help="pool counts to measure, comma-separated (at most 9)")
    ap.add_argument("--steps", type=int, default=10, help="steps of each throughput run")
    ap.add_argument("--skip-steps", type=int, default=2, help="steps left out of samples/s (warm-up)")
    ap.add_argument("--pace-s", type=float, default=2.0, help="seconds each sample waits (its pool's generation)")
    ap.add_argument("--capacity", type=int, default=4, help="samples each pool takes at once (4: one group)")
    ap.add_argument("--prompts", type=int, default=6,
                    help="prompts (groups of 4) a step; 6: whole rounds on 1, 2, 3 pools of a group each")  # fmt: skip
    ap.add_argument("--mode", choices=("fully-async", "one-step-off", "sync"), default="fully-async")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--join-steps", type=int, default=14, help="steps of the join run (0: no join run)")
    ap.add_argument("--join-at-step", type=int, default=3, help="start the second pool at this step")
    ap.add_argument("--rate", default="1gbit", help="each link's bandwidth each way, tc units")
    ap.add_argument("--rtt-ms", type=float, default=80.0, help="round trip added by each proxy pair")
    ap.add_argument("--shaper", choices=("htb", "tbf"), default="htb")
    ap.add_argument("--poll-interval", type=float, default=0.5, help="the pool agents' poll interval, s")
    ap.add_argument("--heartbeat-s", type=float, default=2.0, help="the pool agents' heartbeat, s")
    ap.add_argument("--netns-prefix", default="elp", help="namespaces PREFIX0, PREFIX1, ...")
    ap.add_argument("--subnet-prefix", default="10.78", help="link i's /24 is PREFIX.i")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="measure nothing: print (with --write-doc: write) the section from a --json file")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        text = render(argparse.Namespace(**saved["args"]), saved["results"], saved["join"], tuple(saved["cpu"]),
                      saved["load"], saved["date"])  # fmt: skip
        print(text)
        if args.write_doc:
            write_section(text, SECTION, DOC, machine=saved["machine"])
        return
    counts = [int(k) for k in args.pools.split(",") if k]
    n_links = max(counts + ([2] if args.join_steps > 0 else []))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    from bench_doc import machine_line

    from sluiceway.infra.netns import DelayProxy, NetnsUnavailable, WanLink
    from sluiceway.infra.s3_server import SeaweedS3

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind (pools, links, namespaces) as on Ctrl-C
    tmp = tempfile.TemporaryDirectory(prefix="bench-elastic-") if args.workdir is None else None
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[0]
    results: list[dict] = []
    join = None
    try:
        with contextlib.ExitStack() as stack:
            s3 = stack.enter_context(SeaweedS3(work / "seaweedfs"))
            os.environ.update(s3.env())  # this process reads the registry directly, on loopback
            links, proxies = [], []
            for i in range(n_links):
                link = stack.enter_context(WanLink(f"{args.netns_prefix}{i}", subnet=f"{args.subnet_prefix}.{i}",
                                                   rate=args.rate, shaper=args.shaper))  # fmt: skip
                links.append(link)
                proxies.append(stack.enter_context(DelayProxy((link.home_ip, 0), ("127.0.0.1", s3.s3_port),
                                                              delay_s=args.rtt_ms / 2000, seed=i)))  # fmt: skip
            setup = Setup(args, s3, links, proxies, work)
            for k in counts:
                results.append(measure_pools(setup, k))
            if args.join_steps > 0:
                join = measure_join(setup)
    except NetnsUnavailable as exc:
        sys.exit(f"bench_elastic_pools: {exc}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    date = dt.date.today().isoformat()
    cpu = cpu_model()
    text = render(args, results, join, cpu, load, date)
    print(text)
    if args.json:
        saved = {k: v for k, v in vars(args).items() if k not in ("write_doc", "json", "workdir", "render")}
        Path(args.json).write_text(json.dumps({"args": saved, "machine": machine_line(), "cpu": cpu, "load": load,
                                               "date": date, "results": results, "join": join}, indent=1))  # fmt: skip
    if args.write_doc:
        write_section(text, SECTION, DOC)


if __name__ == "__main__":
    main()
