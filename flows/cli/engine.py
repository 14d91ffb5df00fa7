"""`sluiceway engine --model NAME_OR_DIR [--port N]`: serve the embedded engine (SGLang's native HTTP API)."""

from __future__ import annotations

import sys

from sluiceway.infra.errors import UserError


def add_parser(sub) -> None:
    eng = sub.add_parser("engine", help="serve the embedded rollout engine (SGLang's native HTTP API)")
    eng.add_argument("--model", required=True, help="zoo name or HF model directory")
    eng.add_argument("--host", default="127.0.0.1")
    eng.add_argument("--port", type=int, default=30000)
    eng.add_argument("--max-running-requests", type=int, default=64)
    eng.add_argument("--max-total-len", type=int, default=1024, help="prompt + response tokens per request")
    eng.add_argument(
        "--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
        help="auto: bfloat16 where this CPU computes it natively and faster (models/precision.py), else float32",
    )  # fmt: skip
    eng.add_argument("--weight-version", default="0")
    eng.add_argument("--seed", type=int, default=None, help="base seed for requests without sampling_seed")
    eng.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")


def run(args) -> int:
    from sluiceway.models.engine.server import serve

    if args.max_running_requests < 1 or args.max_total_len < 2:
        raise UserError("engine: --max-running-requests must be >= 1 and --max-total-len >= 2")
    if args.num_threads is not None and args.num_threads < 1:
        raise UserError("engine: --num-threads must be >= 1")
    if args.dtype == "auto":
        from sluiceway.models.precision import choose

        choice = choose("auto")
        print(f"engine precision: {choice.precision} ({choice.reason})", file=sys.stderr)
        args.dtype = "bfloat16" if choice.bf16 else "float32"
    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_running_requests=args.max_running_requests,
        max_total_len=args.max_total_len,
        dtype=args.dtype,
        weight_version=args.weight_version,
        seed=args.seed,
        num_threads=args.num_threads,
    )
    return 0
