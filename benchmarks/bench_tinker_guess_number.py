"""tinker-cookbook's multiplayer guess_number recipe, unchanged, against `sluiceway tinker serve`: the server's
peak resident memory and the step's time (issue 52 point 9: on SmolLM2-135M it had reached 23 GB and been killed).

The recipe's own config (its CLIConfig and build_config: batch 32 x group 8 episodes, at most 64 tokens a turn,
LoRA 32, importance_sampling) with the served model's directory as model_name, the ChatML renderer SmolLM2 speaks
(`qwen3_instruct`), the server's URL, `--steps` steps. The server is one process (its samplers' engines run in
it); its peak is its VmHWM read from /proc when the recipe is done.

    .venv/bin/python benchmarks/bench_tinker_guess_number.py                   # SmolLM2-135M-Instruct, 1 step
    .venv/bin/python benchmarks/bench_tinker_guess_number.py --write-doc
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import write_section  # noqa: E402  (benchmarks/ is the script's own directory)

SECTION = "## Tinker server memory: tinker-cookbook's guess_number on SmolLM2 (issue 52)"
GIB = 2**30


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="the server's (default its own: 1024)")
    p.add_argument("--write-doc", action="store_true")
    args = p.parse_args()

    import chz
    import httpx
    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train

    from sluiceway.infra.proc import free_port
    from sluiceway.models.zoo import resolve_checkpoint

    model_dir = str(resolve_checkpoint(args.model))
    work = Path(tempfile.mkdtemp(prefix="bench-guess-"))
    port = free_port()
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--base-model", args.model, "--port",
           str(port), "--work-dir", str(work / "server"), "--server-id", "bench"]  # fmt: skip
    if args.micro_batch_tokens:
        cmd += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    server = subprocess.Popen(cmd, env=env, stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    cli = train.CLIConfig(model_name=model_dir, renderer_name="qwen3_instruct", log_path=str(work / "recipe"),
                          behavior_if_log_dir_exists="delete", max_steps=args.steps, eval_every=0,
                          save_every=0)  # fmt: skip
    config = chz.replace(train.build_config(cli), base_url=url)
    t0 = time.perf_counter()
    try:
        asyncio.run(train.train.main(config))
        wall = time.perf_counter() - t0
        peak = peak_rss(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    line = (f"{args.steps} step(s) of {cli.batch_size} x {cli.group_size} episodes: {wall:.0f} s, the server's peak "
            f"resident memory {peak / GIB:.2f} GiB (micro-batches of {args.micro_batch_tokens or 1024} token "
            "positions)")  # fmt: skip
    print(line)
    if args.write_doc:
        text = "\n".join([
            SECTION, "",
            "`.venv/bin/python benchmarks/bench_tinker_guess_number.py --write-doc`: tinker-cookbook 0.6.1's "
            "`multiplayer_rl/guess_number` recipe, its own settings (LoRA 32, importance_sampling), on "
            f"{args.model} with the ChatML renderer, against `sluiceway tinker serve` on this machine.", "",
            f"- {line}.",
            "- Before issue 52 a forward_backward ran every datum of the batch in one padded batch: the same recipe "
            "reached 23 GB and was killed by the kernel on a 23 GB machine (the issue's measurement).", "",
        ])  # fmt: skip
        write_section(text, SECTION)


if __name__ == "__main__":
    main()
