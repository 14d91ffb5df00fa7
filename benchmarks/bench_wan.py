"""A remote inference pool behind a WAN-like link: publish-to-serve time and bytes over the link, full versus
delta weight versions; and the link dropped mid-run (issue 21 item 5).

The pool runs as `sluiceway pools up` (a router, embedded engines and the pool agent) inside a network namespace
joined to this one by a veth pair (sluiceway.infra.netns.WanLink). Both ends are shaped with tc (--rate,
--shaper); the kernel has no netem, so latency and loss come from a delaying TCP proxy (DelayProxy) on the
home end in front of the weight store, a real SeaweedFS S3 server on 127.0.0.1: every chunk waits --rtt-ms/2
each way, and --reset of the connections it accepts are reset (RST) part way. The pool reaches the store only
through that proxy over the shaped link; the run reaches the pool's router through a second such proxy on the
remote end (tests/wan_helpers.py draws the picture).

Part 1, per model: this script plays the trainer. Its fp32 master weights take one Adam-like step per version
(every element moves by lr, default 1e-6: Adam's first step is lr * sign(g)), published as bf16 with
`WeightPublisher(float_dtype="BF16")`, as a --bf16 run publishes: --versions full versions (full_every=1),
then --versions deltas (and on the first model --versions more deltas with --request-resets of the requests
cut by a reset, to show what resets cost: the agent keeps a few keep-alive connections open, which a share of
new connections reset seldom hits). For each
version: publish seconds (cast, hash, encode, upload); seconds from publish() returning (the manifest is on the
store) to the agent holding it (polled, downloaded, applied: its current/manifest.json) and to every engine of
the remote pool serving it (its status.json); the HTTP requests the agent sent through the proxy (each a round
trip); the bytes the link carried in each direction meanwhile (the home veth's counters: payload, headers,
polls, TCP).

Part 2 (--drop-s > 0, on --drop-model): a real `sluiceway run` (fully-async, --run-max-staleness,
--update-weight-mode delta to the store) with its own engine and the remote pool (--rollout-pools). Once the
pool serves v2, the link is cut for --drop-s seconds (--drop-mode blackhole: every packet lost both ways; or
down), then restored. Reported: samples each pool generated before, during and after the cut (trajectories'
created_at), the versions the pool served during the cut, and how long after the link came back the pool served
the newest version again.

    .venv/bin/python benchmarks/bench_wan.py                                   # 1gbit, 80 ms RTT, 0.1% resets
    .venv/bin/python benchmarks/bench_wan.py --rate 100mbit --rtt-ms 150 --reset 0.01 --drop-s 0
    .venv/bin/python benchmarks/bench_wan.py --write-doc                       # also the section in docs/benchmarks.md
Needs root (network namespaces, veth, tc).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_doc
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # wan_helpers, cli_run

from bench_doc import DOC, write_section  # noqa: E402

SECTION = "## A remote pool behind a WAN-like link (issue 21)"


PACE_ENV = "SLUICEWAY_BENCH_WAN_PACE_S"


async def paced_generate(ctx, prompt, params):
    """The drop part's generate function (loaded by the run): every sample waits PACE_ENV seconds first, so a
    tiny-llama step takes about as long as that (a real step takes minutes; unpaced, tiny-llama makes about two
    versions a second, faster than any pool behind 80 ms can follow), then generates as usual."""
    import asyncio

    await asyncio.sleep(float(os.environ.get(PACE_ENV) or 0))
    buf = ctx.new_buffer(prompt.token_ids)
    await ctx.generate(buf, params)
    return buf


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


class Trainer:
    """fp32 masters that move by lr * sign(noise) per version (an Adam step), published as bf16."""

    def __init__(self, model_dir: Path, lr: float, seed: int = 0):
        import torch

        from sluiceway.storage.weights import safetensors_raw as st
        from sluiceway.storage.weights.model_dir import read_model_dir

        self.torch = torch
        self.masters = {}
        for k, t in read_model_dir(model_dir).items():
            x = st.to_torch(t)
            self.masters[k] = x.float().clone() if x.is_floating_point() else x
        self.lr = lr
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        for t in self.masters.values():
            if t.is_floating_point():
                t.add_(torch_sign_noise(self.torch, t, self.gen), alpha=self.lr)


def torch_sign_noise(torch, t, gen):
    return torch.randint(0, 2, t.shape, generator=gen, dtype=torch.int8).to(t.dtype).mul_(2).sub_(1)


def measure_versions(args, model: str, s3, link, store_proxy, work: Path) -> list[dict]:
    from wan_helpers import remote_pool

    from sluiceway.models.zoo import resolve_checkpoint
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights.publish import WeightPublisher
    from sluiceway.storage.weights.store import WeightStore

    model_dir = resolve_checkpoint(model)
    uri = f"s3://{s3.bucket}/wan-{model}-{uuid.uuid4().hex[:6]}/weights"
    wstore = WeightStore(ObjectStore.from_uri(uri))
    publisher = WeightPublisher(wstore, full_every=1, keep=3, float_dtype="BF16")
    trainer = Trainer(model_dir, args.lr)
    pool_env = dict(s3.env(), AWS_ENDPOINT_URL=store_proxy.url)
    rows = []
    shutil.rmtree(work / f"pool-{model}", ignore_errors=True)  # an agent's held copy from an earlier run
    with remote_pool(link, work / f"pool-{model}", model=str(model_dir), weights_uri=uri, store_env=pool_env,
                     poll_interval_s=args.poll_interval, delay_s=args.rtt_ms / 2000) as pool:  # fmt: skip
        version = 0
        series = [("full", 0.0), ("delta", 0.0)]
        if args.request_resets > 0 and model == args.models.split(",")[0]:
            series.append((f"delta, {args.request_resets * 100:g}% of requests reset", args.request_resets))
        for label, per_request in series:
            publisher.full_every = 1 if label == "full" else 10**6
            store_proxy.reset_per_request = per_request
            for _ in range(args.versions):
                version += 1
                trainer.step()
                c0, r0 = link.counters(), dict(store_proxy.stats)
                t0 = time.monotonic()
                m = publisher.publish(version, trainer.masters, model_dir)
                t1 = time.monotonic()
                seen = pool.wait_serving(version)
                c1, r1 = link.counters(), store_proxy.stats
                c = {k: c1[k] - c0[k] for k in c1}
                r = {
                    "model": model, "series": label, "version": version, "kind": m.kind, "data_bytes": m.data_size,
                    "raw_bytes": m.raw_size, "publish_s": t1 - t0, "serve_s": seen["serving"] - t1,
                    "held_s": seen["held"] - t1, "load_s": seen["serving"] - seen["held"],
                    "requests": r1["exchanges"] - r0["exchanges"], "connections": r1["connections"] - r0["connections"],
                    "resets": r1["resets"] - r0["resets"], "link_down_bytes": c["tx_bytes"],
                    "link_up_bytes": c["rx_bytes"],
                }  # fmt: skip
                rows.append(r)
                print(f"{model} v{version} {m.kind:5s} {mb(m.data_size):>8s} MB  publish {r['publish_s']:.2f} s  "
                      f"-> held {r['held_s']:.2f} s, serving {r['serve_s']:.2f} s  requests {r['requests']}  "
                      f"link down {mb(r['link_down_bytes'])} MB up {mb(r['link_up_bytes'])} MB  "
                      f"conns {r['connections']} resets {r['resets']}", flush=True)  # fmt: skip
        store_proxy.reset_per_request = 0.0
    return rows


def measure_drop(args, s3, link, store_proxy, work: Path) -> dict:
    """A tiny run beside the remote pool, the link cut for --drop-s seconds once the pool serves v2."""
    from cli_run import cli_args
    from wan_helpers import remote_pool

    from sluiceway.models.zoo import resolve_checkpoint
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories
    from sluiceway.storage.weights.store import WeightStore

    model = args.drop_model
    model_dir = resolve_checkpoint(model)
    uri = f"s3://{s3.bucket}/wan-run-{uuid.uuid4().hex[:6]}/weights"
    wstore = WeightStore(ObjectStore.from_uri(uri))
    pool_env = dict(s3.env(), AWS_ENDPOINT_URL=store_proxy.url)
    run_dir = work / "run"
    for d in (run_dir, work / "pool-run"):
        shutil.rmtree(d, ignore_errors=True)
    timeline: list[tuple[float, int | None, int | None, str]] = []  # (time, pool serves, newest on store, link)
    events: dict[str, float] = {}
    with remote_pool(link, work / "pool-run", model=str(model_dir), weights_uri=uri, store_env=pool_env,
                     poll_interval_s=args.poll_interval, delay_s=args.rtt_ms / 2000,
                     reset_fraction=args.reset) as pool:  # fmt: skip
        cmd = cli_args(run_dir, "--hf-checkpoint", model, "--num-rollout", str(args.run_steps),
                       "--mode", "fully-async", "--max-staleness", str(args.run_max_staleness),
                       "--save-interval", str(10**6),
                       "--update-weight-mode", "delta", "--weights-uri", uri,
                       "--weights-full-every", str(args.run_full_every),
                       "--update-weights-interval", str(args.run_update_interval),
                       "--rollout-pools", f"remote={pool.url}", "--rollout-max-concurrency", "8",
                       "--custom-generate-function-path", f"{Path(__file__).resolve()}:paced_generate")  # fmt: skip
        env = dict(os.environ, **s3.env(), **{PACE_ENV: str(args.run_pace_s)})
        t_start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    newest = wstore.latest()
                except Exception:  # noqa: BLE001 - the store is local and up; a listing mid-write may fail
                    newest = None
                timeline.append((time.monotonic(), pool.status().get("version"), newest, link.state))
                stop.wait(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            while proc.poll() is None and "cut" not in events:
                if (pool.status().get("version") or 0) >= 2 and time.monotonic() - t_start >= args.cut_after_s:
                    events["cut"], events["cut_utc"] = time.monotonic(), time.time()
                    link.cut(args.drop_mode)
                    time.sleep(args.drop_s)
                    link.restore()
                    events["restore"], events["restore_utc"] = time.monotonic(), time.time()
                time.sleep(0.1)
            proc.wait(timeout=1800)
            events["end"] = time.monotonic()
            # The run may end before the pool caught up: watch on until it serves the run's last version.
            last = wstore.latest()
            deadline = time.monotonic() + 180
            while pool.status().get("version") != last and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            if link.state == "cut":
                link.restore()
            stop.set()
            watcher.join()
            if proc.poll() is None:
                proc.kill()
        timeline.append((time.monotonic(), pool.status().get("version"), wstore.latest(), link.state))
        pool_stats = dict(pool.proxy.stats)
        agent_log = pool.log_tail(10**6).splitlines()
        agent_errors = [line for line in agent_log if "still serving" in line]
        poll_failures = [line for line in agent_log if "poll failed" in line]
    text = "".join(out)
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{text[-4000:]}")
    if "cut" not in events:
        sys.exit("the run ended before the pool served v2: nothing was cut (more --run-steps?)")

    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    trained = [r for r in rows if r["status"] != "aborted" and r["filter_reason"] is None]

    def phase(r) -> str:
        t = r["created_at"].timestamp()
        return "before" if t < events["cut_utc"] else "during" if t < events["restore_utc"] else "after"

    samples = {ph: {"local": 0, "remote": 0} for ph in ("before", "during", "after")}
    for r in trained:
        samples[phase(r)]["remote" if r["pool"] == "remote" else "local"] += 1
    during = [v for t, v, _, _ in timeline if events["cut"] <= t < events["restore"]]
    newest_at_restore = max((n for t, _, n, _ in timeline if t <= events["restore"] and n is not None), default=None)
    caught = next((t for t, v, _, _ in timeline if t >= events["restore"] and v is not None
                   and newest_at_restore is not None and v >= newest_at_restore), None)  # fmt: skip
    held_at_cut = max((v for v in during if v is not None), default=None)
    first = next((t for t, v, _, _ in timeline if t >= events["restore"] and v is not None and held_at_cut is not None
                  and v > held_at_cut), None)  # fmt: skip
    steps = len({r["step"] for r in trained})
    return {
        "model": model, "steps": steps, "samples": len(trained), "run_s": events["end"] - t_start,
        "cut_after_s": events["cut"] - t_start, "drop_s": events["restore"] - events["cut"],
        "served_during": sorted({v for v in during if v is not None}),
        "newest_at_restore": newest_at_restore,
        "catch_up_s": None if caught is None else caught - events["restore"],
        "first_update_s": None if first is None else first - events["restore"],
        "final_pool_version": timeline[-1][1] if timeline else None,
        "final_store_version": wstore.latest(),
        "phases": samples, "pool_failed": text.count("pool remote failed"), "pool_slow": text.count("pool remote slow"),
        "router_proxy": pool_stats, "agent_errors": agent_errors, "poll_failures": poll_failures,
        "final_after_end_s": next((t - events["end"] for t, v, _, _ in timeline
                                   if v is not None and v == timeline[-1][2]), None),
        "log": text,
    }  # fmt: skip


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for series in dict.fromkeys(r["series"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["series"] == series]
            out.append({
                "model": model, "kind": series, "n": len(rs),
                **{k: statistics.median(r[k] for r in rs) for k in ("data_bytes", "raw_bytes", "publish_s", "held_s",
                                                                    "serve_s", "requests", "link_down_bytes",
                                                                    "link_up_bytes")},
                "serve_min": min(r["serve_s"] for r in rs), "serve_max": max(r["serve_s"] for r in rs),
                "resets": sum(r["resets"] for r in rs), "connections": sum(r["connections"] for r in rs),
            })  # fmt: skip
    return out


def render(args, rows: list[dict], drop: dict | None, load: str, date: str) -> str:
    link_desc = (
        f"a veth pair, {args.rate} each way ({args.shaper}), {args.rtt_ms:g} ms added round trip "
        f"({args.rtt_ms / 2:g} ms each way in the proxy), {args.reset * 100:g}% of connections reset"
    )
    lines = [
        SECTION, "",
        f"`benchmarks/bench_wan.py --rate {args.rate} --rtt-ms {args.rtt_ms:g} --reset {args.reset:g} --shaper "
        f"{args.shaper} --versions {args.versions} --poll-interval {args.poll_interval:g}` "
        f"({date}, load average {load} at the start on a machine shared with other "
        f"work). The link: {link_desc}. The remote pool (`sluiceway pools up`, one "
        "embedded engine) runs in the namespace and reaches the SeaweedFS weight store only through the proxy; "
        f"its agent polls every {args.poll_interval:g} s. Versions: fp32 masters moved by lr {args.lr:g} x "
        "sign(noise) per version (an Adam step), published as bf16; first `--versions` full versions, then as "
        "many deltas (keep 3). Counted from `publish()` returning (the manifest is on the store): \"to held\" "
        "until the agent holds the version (found by a poll, downloaded, applied, checked, renamed into place), "
        "\"to serving\" until every engine of the pool serves it (also the engine's reload); \"requests\": "
        "HTTP requests the agent sent through the proxy meanwhile, each a round trip (its polls included); link "
        "MB: bytes the home veth sent to (down) and got from (up) the namespace meanwhile (payload, HTTP, "
        "TCP/IP headers). Medians over the versions of each kind (min-max of the serve time in brackets).", "",
        "| model | kind | versions | store MB (full copy MB) | publish s | to held s | to serving s "
        "| requests (x RTT s) | link down MB | link up MB | new connections (reset) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for s in summarize(rows):
        lines.append(
            f"| {s['model']} | {s['kind']} | {s['n']} | {mb(s['data_bytes'])} ({mb(s['raw_bytes'])}) | "
            f"{s['publish_s']:.2f} | {s['held_s']:.2f} | "
            f"{s['serve_s']:.2f} ({s['serve_min']:.2f}-{s['serve_max']:.2f}) | "
            f"{s['requests']:.0f} ({s['requests'] * args.rtt_ms / 1000:.1f}) | "
            f"{mb(s['link_down_bytes'])} | {mb(s['link_up_bytes'])} | {s['connections']} ({s['resets']}) |"
        )
    if drop is not None:
        ph = drop["phases"]
        catch = "never" if drop["catch_up_s"] is None else f"{drop['catch_up_s']:.1f} s"
        first = "never" if drop["first_update_s"] is None else f"{drop['first_update_s']:.1f} s"
        final = drop["final_after_end_s"]
        final = "never" if final is None else f"{final:.1f} s after the run ended" if final > 0 else "before it ended"
        pruned = len(drop["agent_errors"])
        lines += [
            "",
            f"The link dropped mid-run (`--drop-s {args.drop_s:g} --drop-mode {args.drop_mode}`): a `sluiceway run` "
            f"on {drop['model']} (fully-async, --max-staleness {args.run_max_staleness}, {drop['steps']} steps, one "
            "engine of its own, `--rollout-pools remote=...` through the link, deltas to the store, "
            f"--weights-full-every {args.run_full_every}, keep 3; every sample first waits {args.run_pace_s:g} s, "
            "`--run-pace-s`, so a step takes seconds rather than the half second of an unpaced tiny-llama step) "
            f"and the remote pool. The link was cut {drop['cut_after_s']:.0f} s into the run, the pool serving "
            f"v{min(drop['served_during'], default='?')}, for {drop['drop_s']:.1f} s. The run finished all "
            f"{drop['steps']} steps in {drop['run_s']:.0f} s. During the cut the pool kept serving "
            f"v{', v'.join(map(str, drop['served_during'])) or '?'} while the store went on to newer versions; "
            f"after the link came back it served a newer version {first} later and "
            f"v{drop['newest_at_restore']} (the newest when the link came back) {catch} later, and the run's last, "
            f"v{drop['final_store_version']}, {final}. The run's log: `pool remote failed` {drop['pool_failed']}x, "
            f"`pool remote slow` (hedged) {drop['pool_slow']}x. The agent's log: {pruned} version(s) it could not "
            "fetch (pruned from the store before it got there, or unreachable; it kept serving the one before), "
            f"{len(drop.get('poll_failures', []))} poll(s) failed with an exception (retried at the next poll).",
            "",
            "| samples trained | before the cut | during | after |",
            "| --- | --- | --- | --- |",
            f"| on the run's own engine | {ph['before']['local']} | {ph['during']['local']} | {ph['after']['local']} |",
            f"| on the remote pool | {ph['before']['remote']} | {ph['during']['remote']} | {ph['after']['remote']} |",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-llama,smollm2-135m-instruct", help="comma-separated zoo names")
    ap.add_argument("--rate", default="1gbit", help="link bandwidth each way, tc units (1gbit, 100mbit, ...)")
    ap.add_argument("--rtt-ms", type=float, default=80.0, help="round trip added by the proxies (half each way)")
    ap.add_argument("--reset", type=float, default=0.001, help="fraction of proxied connections reset (RST)")
    ap.add_argument("--request-resets", type=float, default=0.05,
                    help="then, first model only: as many deltas, this share of requests cut by a reset")  # fmt: skip
    ap.add_argument("--shaper", choices=("htb", "tbf"), default="htb", help="tc qdisc on both veth ends")
    ap.add_argument("--versions", type=int, default=3, help="versions of each kind (full, then delta) per model")
    ap.add_argument("--poll-interval", type=float, default=0.5, help="the pool agent's poll interval, s")
    ap.add_argument("--lr", type=float, default=1e-6, help="per-version step of the fp32 masters")
    ap.add_argument("--drop-s", type=float, default=30.0, help="seconds the link is cut mid-run (0: no run)")
    ap.add_argument("--drop-mode", choices=("blackhole", "down"), default="blackhole")
    ap.add_argument("--drop-model", default="tiny-llama", help="the run's model in the drop part")
    ap.add_argument("--run-steps", type=int, default=45, help="steps of the run in the drop part")
    ap.add_argument("--run-pace-s", type=float, default=2.0, help="seconds each sample of the run waits first")
    ap.add_argument("--cut-after-s", type=float, default=20.0, help="cut no earlier than this into the run")
    ap.add_argument("--run-max-staleness", type=int, default=4,
                    help="the run's --max-staleness (tiny-llama: a version a second; a real run: minutes)")  # fmt: skip
    ap.add_argument("--run-update-interval", type=int, default=1,
                    help="the run's --update-weights-interval: a version every N steps")  # fmt: skip
    ap.add_argument("--run-full-every", type=int, default=10, help="the run's --weights-full-every (its default)")
    ap.add_argument("--netns", default="remote", help="network namespace name")
    ap.add_argument("--subnet", default="10.77.0", help="the link's /24 (home .1, remote .2)")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed")
    ap.add_argument("--json", default=None, help="also write the results (and the settings) here")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="measure nothing: print (with --write-doc: write) the section from a --json file")  # fmt: skip
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        text = render(argparse.Namespace(**saved["args"]), saved["rows"], saved["drop"], saved["load"], saved["date"])
        print(text)
        if args.write_doc:
            write_section(text, SECTION, DOC, machine=saved["machine"])
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    from bench_doc import machine_line

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind (pool, link, namespace) as on Ctrl-C

    from sluiceway.infra.netns import DelayProxy, NetnsUnavailable, WanLink
    from sluiceway.infra.s3_server import SeaweedS3

    tmp = tempfile.TemporaryDirectory(prefix="bench-wan-") if args.workdir is None else None
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    drop = None
    load = Path("/proc/loadavg").read_text().split()[0]
    try:
        with SeaweedS3(work / "seaweedfs") as s3, WanLink(args.netns, subnet=args.subnet, rate=args.rate,
                                                             shaper=args.shaper) as link:  # fmt: skip
            os.environ.update(s3.env())  # this process (the trainer) reaches the store directly on loopback
            with DelayProxy((link.home_ip, 0), ("127.0.0.1", s3.s3_port), delay_s=args.rtt_ms / 2000,
                            reset_fraction=args.reset, seed=1) as store_proxy:  # fmt: skip
                for model in [m for m in args.models.split(",") if m]:
                    rows += measure_versions(args, model, s3, link, store_proxy, work)
                if args.drop_s > 0:
                    drop = measure_drop(args, s3, link, store_proxy, work)
                    print(json.dumps({k: v for k, v in drop.items() if k != "log"}, indent=1), flush=True)
    except NetnsUnavailable as exc:
        sys.exit(f"bench_wan: {exc}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    brief = None if drop is None else {k: v for k, v in drop.items() if k != "log"}
    saved_args = {k: v for k, v in vars(args).items() if k not in ("render", "write_doc", "json", "workdir")}
    date = dt.date.today().isoformat()
    text = render(args, rows, brief, load, date)
    print(text)
    if args.json:
        results = {"args": saved_args, "machine": machine_line(), "load": load, "date": date, "rows": rows,
                   "drop": brief}  # fmt: skip
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_doc:
        write_section(text, SECTION, DOC)


if __name__ == "__main__":
    main()
