"""`sluiceway report OUTPUT_DIR`: a run's per-step metrics as a markdown table, its charts as a PNG
(flows/report.py)."""

from __future__ import annotations

import sys

from sluiceway.infra.errors import UserError


def add_parser(sub) -> None:
    rep = sub.add_parser("report", help="a run's per-step metrics as a markdown table, its charts as a PNG")
    rep.add_argument("output_dir", help="the run's --output-dir")
    rep.add_argument("--run-id", default=None, help="default: the output directory's name")
    rep.add_argument("--storage-uri", default=None, help="where the run's tables are, if not OUTPUT_DIR/tables")
    rep.add_argument("--plot", metavar="PATH", help="write the charts PNG here (default OUTPUT_DIR/curves.png)")


def run(args) -> int:
    from sluiceway.flows.report import render, write_curves

    print(render(args.output_dir, args.run_id, args.storage_uri), end="")
    try:
        png = write_curves(args.output_dir, args.run_id, args.storage_uri, args.plot)
    except UserError as e:
        if args.plot is not None:
            raise
        print(f"warning: {e}", file=sys.stderr)  # a read-only run directory: the table is still printed
        return 0
    if png is not None:
        print(f"charts: {png}", file=sys.stderr)
    return 0
