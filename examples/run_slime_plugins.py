"""Run slime's own example plugins, unchanged, from a slime checkout: retool (multi-turn code tool, a dict reward
from rm_hub.math_dapo_utils), multi_agent (one prompt fanned out into several trained Samples, rm type
deepscaler) and search-r1 (a search tool against a retrieval server, a dict label). Each trains two steps on
SmolLM2-135M-Instruct through `sluiceway run` with the example's own flags (its --custom-* paths, keys, rm type).

    python examples/run_slime_plugins.py /path/to/slime [OUT_DIR] [--model smollm2-135m-instruct]

The example directories are copied to OUT_DIR as they are (slime's repository root itself is not put on the
path: its `slime/` package would need slime's GPU dependencies; sluiceway's `slime` names stand in). What differs
from slime's launch scripts, and why: the data are a few arithmetic and trivia questions in the examples' formats
(no hub downloads here); search-r1's retrieval server is a small local one answering three passages per query on
127.0.0.1:8000 (the URL the example has); lengths are small for a CPU, and --rollout-max-context-len is set
(slime's SGLang holds the model's whole context; sluiceway's embedded engines are sized by it). Last checked at
slime 624b824a: all three run their two steps to the end (docs/slime.md). It checks the interface, not learning:
SmolLM2-135M solved none of the problems and never searched, so each group's rewards were equal and the
gradient zero.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SMALL = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size",
         "4", "--micro-batch-size", "4", "--rollout-temperature", "1", "--advantage-estimator", "grpo",
         "--rollout-max-context-len", "1024"]  # fmt: skip

MATH = [(26, 28), (4, 18), (13, 7), (9, 31)]
TRIVIA = [("Who wrote Hamlet?", "William Shakespeare"), ("What is the capital of France?", "Paris")]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_rows() -> list[dict]:
    """dapo-math-17k's format: a chat prompt, an integer label."""
    ask = "What is {} * {}? Use Python, then answer with \\boxed{{}}."
    return [{"prompt": [{"role": "user", "content": ask.format(a, b)}], "label": str(a * b)} for a, b in MATH]


def trivia_rows() -> list[dict]:
    """Search-R1's format: a chat prompt, reward_model = {"ground_truth": {"target": [...]}}."""
    ask = "Answer the question; search with <search> query </search>, answer in <answer></answer>. Question: {}"
    return [{"prompt": [{"role": "user", "content": ask.format(q)}],
             "reward_model": {"ground_truth": {"target": [a]}, "style": "rule"}} for q, a in TRIVIA * 2]  # fmt: skip


def retrieval_server(log: Path) -> ThreadingHTTPServer:
    """/retrieve in the shape slime's local_search_server.py reads: {"result": [[{"document", "contents"}]]}."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with log.open("a") as f:
                f.write(json.dumps(body) + "\n")
            text = f'"Passage {{}}"\nA passage about {body.get("queries")}'
            passages = [text.format(i) for i in range(3)]
            docs = [{"document": {"id": str(i), "contents": c}, "contents": c} for i, c in enumerate(passages)]
            out = json.dumps({"result": [docs]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 8000), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(name: str, cwd: Path, pythonpath: Path | None, model: str, flags: list[str]) -> int:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "run", "--hf-checkpoint", model, "--output-dir",
           str(cwd / f"run-{name}"), *SMALL, *flags]  # fmt: skip
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("slime_dir", type=Path, help="a checkout of THUDM/slime")
    p.add_argument("out", type=Path, nargs="?", default=Path("slime-plugins-check"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    a = p.parse_args()
    examples = a.slime_dir / "examples"
    if not (examples / "retool" / "generate_with_retool.py").is_file():
        p.error(f"{a.slime_dir}: not a slime checkout (no examples/retool/generate_with_retool.py)")
    out = a.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    for d in ("retool", "search-r1"):
        shutil.copytree(examples / d, out / d)
    shutil.copytree(examples / "multi_agent", out / "ma" / "examples" / "multi_agent")
    shutil.copy(examples / "__init__.py", out / "ma" / "examples" / "__init__.py")
    dapo = write_jsonl(out / "dapo.jsonl", math_rows())
    trivia = write_jsonl(out / "trivia.jsonl", trivia_rows())
    server = retrieval_server(out / "retrieval-requests.jsonl")
    chat = ["--input-key", "prompt", "--apply-chat-template", "--rollout-max-response-len", "48"]
    try:
        codes = {
            "retool": run("retool", out, out / "retool", a.model, [
                "--prompt-data", str(dapo), "--label-key", "label", *chat, "--reward-key", "score",
                "--custom-generate-function-path", "generate_with_retool.generate",
                "--custom-rm-path", "generate_with_retool.reward_func",
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"]),
            "multi_agent": run("multi_agent", out / "ma", None, a.model, [
                "--prompt-data", str(dapo), "--label-key", "label", *chat[:3], "--rollout-max-response-len", "32",
                "--rm-type", "deepscaler", "--custom-generate-function-path",
                "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"]),
            "search-r1": run("search-r1", out, out / "search-r1", a.model, [
                "--prompt-data", str(trivia), "--label-key", "reward_model", *chat,
                "--custom-generate-function-path", "generate_with_search.generate",
                "--custom-rm-path", "generate_with_search.reward_func"]),
        }  # fmt: skip
    finally:
        server.shutdown()
    for name, code in codes.items():
        print(f"{name}: {'ran two steps' if code == 0 else f'failed (exit {code})'}")
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main())
