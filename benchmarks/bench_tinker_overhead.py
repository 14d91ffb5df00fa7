"""The Tinker API's overhead: the same RL step through `sluiceway tinker serve` and in `sluiceway run` (issue 42).

One run of each, one after the other, on this machine, with the same step shape: GRPO-style RL on `env:arithmetic`
(one-digit sums, the chat template applied), PROMPTS prompts x SAMPLES samples a step, at most RESPONSE_LEN
sampled tokens at temperature 1, LoRA of rank RANK (alpha 32, every linear layer) trained in fp32, lr LR, one
optimizer step per step, the new weights given to the sampler before the next step.

- `sluiceway run`: a subprocess with those flags (`--precision fp32`, one micro-batch of the whole step); its step
  time and stage times come from its metrics table (time/step_s, time/rollout_s, time/train_start/end).
- Tinker: `sluiceway tinker serve` (a subprocess) driven with the real SDK the way tinker-cookbook's RL loop
  drives it (rl/train.py's synchronous loop): every episode its own `sample` request (num_samples 1), all of a
  step's sent at once; the rewards (the same verifier, `tasks/environments/arithmetic.py`) and group-centred
  advantages computed on the client; one `forward_backward(..., "importance_sampling")` with every episode a
  datum (prompt + response, the sampler's log-probs, the advantage on the response's tokens) and an
  `optim_step`; then `save_weights_and_get_sampling_client` for the next step's sampler. Times are the client's
  (wall time of each phase); the server's own time per request comes from its `tinker_requests` table (run_s).

The first step of each is warm-up (first forward/backward, engine warm-up): medians leave it out.

    .venv/bin/python benchmarks/bench_tinker_overhead.py                    # smollm2-135m-instruct, 8 x 4, 5 steps
    .venv/bin/python benchmarks/bench_tinker_overhead.py --model tiny-llama
    .venv/bin/python benchmarks/bench_tinker_overhead.py --write-doc --note "shared with other work"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)

SECTION = "## Tinker API overhead: a cookbook-like RL step against `sluiceway run` (issue 42)"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- sluiceway run ----------------------------------------------------------------------------------------


def run_sluiceway(args, work: Path) -> dict:
    from sluiceway.storage.metrics import metrics_frame
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    out = work / "run"
    cmd = [sys.executable, "-m", "sluiceway.flows.cli",
           "run", "--hf-checkpoint", args.model, "--prompt-data", "env:arithmetic", "--apply-chat-template",
           "--rm-type", "env", "--advantage-estimator", "grpo", "--precision", "fp32", "--lr", str(args.lr),
           "--lr-decay-style", "constant", "--weight-decay", "0",
           "--lora-rank", str(args.rank), "--lora-alpha", "32", "--target-modules", "all-linear",
           "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
           "--global-batch-size", str(args.prompts * args.samples),
           "--micro-batch-size", str(args.prompts * args.samples),
           "--rollout-max-response-len", str(args.response_len), "--rollout-temperature", "1.0",
           "--num-rollout", str(args.steps), "--seed", "7", "--output-dir", str(out), "--run-id", "bench",
           "--save-interval", str(10**6), "--quiet"]  # fmt: skip
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(work / "run.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"sluiceway run failed ({rc}):\n{(work / 'run.log').read_text()[-4000:]}")
    store = ObjectStore.from_uri(str(out / "tables"))
    m = metrics_frame(store, "bench")
    col = lambda name: [float(x) for x in m[name]]  # noqa: E731
    step, rollout = col("time/step_s"), col("time/rollout_s")
    train = [b - a for a, b in zip(col("time/train_start"), col("time/train_end"))]
    t = read_trajectories(store, "bench").to_pydict()
    steps = [dict(step=s, sample=r, train=tr, rest=s - r - tr) for s, r, tr in zip(step, rollout, train)]
    prompt_tokens = [len(p) for p in t["prompt_token_ids"]]
    response_tokens = [len(r) for r in t["response_token_ids"]]
    print(f"sluiceway run: {wall:.0f} s, steps {' '.join(f'{s:.2f}' for s in step)} s", flush=True)
    return dict(steps=steps, wall=wall, load=load, prompt_tokens=prompt_tokens, response_tokens=response_tokens)


# --- the Tinker API ---------------------------------------------------------------------------------------


def start_server(args, work: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    from sluiceway.infra.proc import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--base-model", args.model,
           "--port", str(port), "--work-dir", str(work / "tinker"), "--store", str(work / "tinker-store"),
           "--server-id", "bench"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    proc = subprocess.Popen(cmd, env=env, stdout=open(work / "tinker.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("the Tinker server exited:\n" + (work / "tinker.log").read_text()[-4000:])
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    sys.exit("the Tinker server did not answer")


async def tinker_loop(args, url: str, model_dir: Path) -> list[dict]:
    import tinker

    with tinker.ServiceClient(base_url=url) as service:  # closed at the end, as the cookbook's loop does
        tc = await service.create_lora_training_client(str(model_dir), rank=args.rank)
        return await tinker_steps(args, tc)


async def tinker_steps(args, tc) -> list[dict]:
    from tinker import types

    from sluiceway.tasks.environments.arithmetic import ENV, generate

    tok = tc.get_tokenizer()
    records = generate(args.prompts * args.steps, seed=7)
    sampler = await tc.save_weights_and_get_sampling_client()  # the cookbook's first sampler: the initial weights
    params = types.SamplingParams(max_tokens=args.response_len, temperature=1.0)
    adam = types.AdamParams(learning_rate=args.lr)
    steps = []
    for step in range(args.steps):
        batch = records[step * args.prompts : (step + 1) * args.prompts]
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["input"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for r in batch]  # fmt: skip
        t0 = time.perf_counter()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=1, sampling_params=params)
                   for p in prompts for _ in range(args.samples)]  # fmt: skip
        results = await asyncio.gather(*futures)
        t1 = time.perf_counter()
        data, rewards, response_tokens = [], [], []
        for g, (p, rec) in enumerate(zip(prompts, batch)):
            seqs = [results[g * args.samples + i].sequences[0] for i in range(args.samples)]
            r = [ENV.verify(tok.decode(s.tokens, skip_special_tokens=True), rec["label"])[0] for s in seqs]
            mean = sum(r) / len(r)
            rewards += r
            for s, reward in zip(seqs, r):
                full = list(p) + list(s.tokens)
                n_prompt = len(p) - 1
                response_tokens.append(len(s.tokens))
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * n_prompt + list(s.logprobs),
                                    "advantages": [0.0] * n_prompt + [reward - mean] * len(s.tokens)},
                ))  # fmt: skip
        t2 = time.perf_counter()
        fb = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(adam)
        await fb
        await opt
        t3 = time.perf_counter()
        sampler = await tc.save_weights_and_get_sampling_client()
        t4 = time.perf_counter()
        steps.append(dict(step=t4 - t0, sample=t1 - t0, client=t2 - t1, train=t3 - t2, sync=t4 - t3,
                          reward=sum(rewards) / len(rewards), prompt_tokens=[len(p) for p in prompts],
                          response_tokens=response_tokens))  # fmt: skip
        print(f"tinker step {step}: {t4 - t0:.2f} s (sample {t1 - t0:.2f}, train {t3 - t2:.2f}, sync {t4 - t3:.2f})",
              flush=True)  # fmt: skip
    return steps


def run_tinker(args, work: Path, model_dir: Path) -> dict:
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.tinker import read_requests

    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc, url = start_server(args, work)
    started = time.perf_counter() - t0
    try:
        steps = asyncio.run(tinker_loop(args, url, model_dir))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows = read_requests(ObjectStore.from_uri(str(work / "tinker-store")), "bench").to_pylist()
    server: dict[str, list[float]] = {}
    for r in rows:
        server.setdefault(r["request_type"], []).append(r["run_s"])
    return dict(steps=steps, wall=time.perf_counter() - t0, start_s=started, load=load, server=server)


# --- report -----------------------------------------------------------------------------------------------


def render(args, run: dict, tk: dict, note: str) -> str:
    rs, ts = run["steps"][1:], tk["steps"][1:]
    r_step, t_step = med([s["step"] for s in rs]), med([s["step"] for s in ts])
    t_sync_client = med([s["sync"] + s["client"] for s in ts])
    srv = {k: med(v) for k, v in tk["server"].items()}
    get = lambda kind: srv.get(kind, float("nan"))  # noqa: E731
    n = args.prompts * args.samples
    run_tokens = args.prompts * med(run["prompt_tokens"]) + n * statistics.mean(run["response_tokens"])
    widths = [max(p + r - 1 for p, r in zip([p for p in s["prompt_tokens"] for _ in range(args.samples)],
                                            s["response_tokens"])) for s in tk["steps"]]  # fmt: skip
    tinker_tokens = n * med(widths)
    from sluiceway.flows.tinker.sampler import Samplers

    engine_rows = Samplers().max_running
    rows = [
        ("step", r_step, t_step),
        ("sampling (run: rollout stage)", med([s["sample"] for s in rs]), med([s["sample"] for s in ts])),
        ("training (run: train stage; Tinker: forward_backward + optim_step)", med([s["train"] for s in rs]),
         med([s["train"] for s in ts])),
        ("the rest (run: reward, filter, sync, tables; Tinker: rewards and datums on the client, "
         "save_weights_and_get_sampling_client)", med([s["rest"] for s in rs]), t_sync_client),
    ]  # fmt: skip
    table = [f"| per step (median of steps 2-{args.steps}) | `sluiceway run`, s | Tinker API, s | Tinker / run |",
             "| --- | ---: | ---: | ---: |"]  # fmt: skip
    table += [f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |" for name, a, b in rows]
    tokens = (
        f"Tokens a step: `sluiceway run` prompts {med(run['prompt_tokens']):.0f}, responses "
        f"{statistics.mean(run['response_tokens']):.1f} on average; Tinker prompts "
        f"{med([x for s in tk['steps'] for x in s['prompt_tokens']]):.0f}, responses "
        f"{statistics.mean([x for s in tk['steps'] for x in s['response_tokens']]):.1f} (median prompt, mean response)."
    )
    server = (
        f"The Tinker server's own time per request (tinker_requests.run_s, medians, journal writes excluded): "
        f"asample {get('asample'):.2f} s (each of {n} a step, up to {engine_rows} at once), forward_backward "
        f"{get('forward_backward'):.2f} s, optim_step {get('optim_step'):.2f} s, "
        f"save_weights_for_sampler {get('save_weights_for_sampler'):.2f} s."
    )
    return "\n".join([
        SECTION, "",
        f"`benchmarks/bench_tinker_overhead.py --model {args.model} --prompts {args.prompts} --samples {args.samples} "
        f"--response-len {args.response_len} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}; load average "
        f"{run['load']:.2f} before `sluiceway run`, {tk['load']:.2f} before the Tinker run{note}). The same RL step "
        f"both ways, one run each on this machine: {args.prompts} prompts x {args.samples} samples of `env:arithmetic` "
        f"(chat template), at most {args.response_len} tokens at temperature 1, LoRA rank {args.rank} (alpha 32, every "
        "linear layer) in fp32, one optimizer step, new weights to the sampler. Tinker: the real SDK against "
        "`sluiceway tinker serve`, called as tinker-cookbook's RL loop calls it (a `sample` per episode, all at "
        "once; `forward_backward` with `importance_sampling` and `optim_step`; "
        "`save_weights_and_get_sampling_client`).", "",
        *table, "",
        f"**The Tinker API's step takes {t_step / r_step:.2f}x `sluiceway run`'s** ({t_step:.2f} s against "
        f"{r_step:.2f} s).", "",
        tokens, server,
        f"Where the sampling time goes: the server's sampler engines run at most {engine_rows} episodes at once "
        "(flows/tinker/sampler.py, `Samplers.max_running`: a KV cache of that many rows, so that two engines fit in "
        f"memory as the sampler weights change every step), so a step's {n} sample requests run in "
        f"{-(-n // engine_rows)} waves where `sluiceway run`'s engine takes the whole step at once; besides, each "
        "request is its own HTTP round trips (the SDK's `asample`, then `retrieve_future` polls) and its rows' group "
        "commit on the store.",
        f"Where the training time goes: `sluiceway run`'s trainer lays a prompt's samples in one row with the prompt "
        f"once (`share_prompts`, on by default: about {run_tokens:.0f} token positions a step), while the Tinker "
        f"server gives every datum a row of its own, padded to the longest ({tinker_tokens:.0f} positions a step): "
        "the API hands over finished sequences, and the server does not look for their shared prefixes.",
        f"Wall time: `sluiceway run` {run['wall']:.0f} s for {args.steps} steps (its engine, trainer and Prefect "
        f"set-up included); Tinker {tk['wall']:.0f} s (the server's start {tk['start_s']:.0f} s included).", "",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or HF directory")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (groups) a step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--response-len", type=int, default=16, help="most tokens sampled per episode")
    ap.add_argument("--steps", type=int, default=5, help="steps of each (the first is warm-up)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds `sluiceway run` may take")
    ap.add_argument("--workdir", default=None, help="where both runs go (default: a temporary directory, removed)")
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    ap.add_argument("--note", default="", help="said beside the load averages (e.g. 'shared with other work')")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is warm-up)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sluiceway.models.zoo import resolve_checkpoint

    model_dir = resolve_checkpoint(args.model)  # built once, outside the timings; both runs load this directory
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run = run_sluiceway(args, work)
        tk = run_tinker(args, work, model_dir)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = render(args, run, tk, f"; {args.note}" if args.note else "")
    print("\n" + text)
    if args.write_doc:
        write_section(text, SECTION, DOC)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
