"""Run one of slime's own example launch scripts on this CPU with tiny-llama, through `sluiceway run
--from-slime-script`.

The script is slime's examples/fully_async/run-qwen2.5-0.5B-fully_async.sh as slime ships it (a copy is in
tests/data/slime_flags/slime/, from THUDM/slime 624b824a). Converting it for a CPU takes three things, nothing
else in it is edited:

1. the model file it sources (scripts/models/qwen2.5-0.5B.sh) is swapped for tiny-llama's, written in slime's
   format from tiny-llama's config.json (the architecture flags are then checked against that config.json);
2. the variables slime's script reads from the environment point at tiny-llama and a small math JSONL
   (MODEL_DIR, DATA_PATH; ACTOR_GPUS=1 trainer process);
3. flags after the script shrink the run (2 rollout steps of 2 prompts x 2 samples, 16 new tokens) and put the
   run directory under --save.

    python examples/run_slime_example_cpu.py [OUT_DIR] [-- more sluiceway flags]

It prints how sluiceway treats each of the script's flags, then runs. GPU-only settings (--attention-backend,
--sequence-parallel, ...) are accepted and listed once in the run's log (OUT_DIR/run/logs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLIME = ROOT / "tests" / "data" / "slime_flags" / "slime"
SCRIPT = SLIME / "examples" / "fully_async" / "run-qwen2.5-0.5B-fully_async.sh"

PROBLEMS = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3"), ("What is 3 * 3?", "9"), ("What is 8 / 2?", "4")]

SMALL = [
    "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
    "--rollout-max-response-len", "16", "--max-tokens-per-gpu", "512", "--rollout-max-prompt-len", "256",
    "--micro-batch-size", "4",
]  # fmt: skip


def convert(out: Path, script: Path = SCRIPT, model: str = "tiny-llama") -> tuple[Path, dict]:
    """A copy of slime's script whose model file is `model`'s, and the environment it reads."""
    from sluiceway.flows.slime.architecture import hf_config_of, model_args

    out.mkdir(parents=True, exist_ok=True)
    model_file = out / f"{model}.sh"
    words = model_args(hf_config_of(model))
    lines: list[str] = []
    for w in words:  # one flag and its value per line, as slime's model files are written
        if w.startswith("--"):
            lines.append(f"   {w}")
        else:
            lines[-1] += f" {w}"
    model_file.write_text("MODEL_ARGS=(\n" + "\n".join(lines) + "\n)\n")
    text = script.read_text()
    text, n = re.subn(r'^source .*scripts/models/.*\.sh"?$', f'source "{model_file}"', text, flags=re.M)
    assert n == 1, f"{script}: expected one `source .../scripts/models/X.sh` line"
    converted = out / script.name
    converted.write_text(text)
    data = out / "math.jsonl"
    with data.open("w") as f:
        for q, a in PROBLEMS:
            f.write(json.dumps({"prompt": [{"role": "user", "content": q + " Put the answer in \\boxed{}."}],
                                "label": a}) + "\n")  # fmt: skip
    env = {"MODEL_DIR": model, "DATA_PATH": str(data), "NUM_GPUS": "2", "ACTOR_GPUS": "1"}
    return converted, env


def command(converted: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sluiceway.flows.cli", "run", "--from-slime-script", str(converted), *SMALL,
            "--save", str(out / "run"), *extra]  # fmt: skip


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    out = Path(argv[0] if argv and argv[0] != "--" else "runs/slime_fully_async_cpu").resolve()
    converted, env = convert(out / "script")
    print(f"converted {SCRIPT.name} -> {converted}", file=sys.stderr)
    return subprocess.call(command(converted, out, *extra), env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
