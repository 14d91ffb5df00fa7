"""SGLang servers on GPUs: the command line for one `sglang.launch_server` built from the run config.

SGLang is CUDA-only and never installed on CPU machines (the `gpu` extra brings it). The server it starts
speaks the same HTTP API as `sluiceway engine`, so `EngineGroup`, the router and `EngineClient` treat both
alike; only the command differs. `--sglang-X value` flags of `sluiceway run` reach the server as `--X value`.
"""

from __future__ import annotations

import importlib.util
import sys

from sluiceway.infra.errors import UserError

SGLANG_FLAG_PREFIX = "--sglang-"


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--sglang-X [value]` flags (returned as `--X [value]`) from the rest of a command line."""
    rest, sglang = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(SGLANG_FLAG_PREFIX):
            name, eq, value = arg.partition("=")
            sglang.append("--" + name[len(SGLANG_FLAG_PREFIX) :])
            if eq:
                sglang.append(value)
            else:  # every value up to the next flag (SGLang's list flags: --cuda-graph-bs 1 2 4 8)
                while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    sglang.append(argv[i + 1])
                    i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, sglang


def sglang_server_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int = 1,
    dtype: str = "auto",
    seed: int | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
        "--port", str(port), "--tp-size", str(tp_size), "--dtype", dtype,
    ]  # fmt: skip
    if seed is not None:
        cmd += ["--random-seed", str(seed)]
    return cmd + list(extra_args)


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise UserError(
            "--rollout-engine sglang: SGLang is not installed (GPU machines: pip install 'sluiceway[gpu]'); "
            "use --rollout-engine embedded on CPU"
        )
