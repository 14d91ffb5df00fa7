"""The `sluiceway` command.

    sluiceway run [CONFIG.yaml] [--flag value ...]   train (flags override the YAML)
    sluiceway sft [CONFIG.yaml] [--flag value ...]   supervised fine-tuning on --prompt-data
    sluiceway replay [CONFIG.yaml] --replay-run-id RUN [--replay-version N | --replay-timestamp ISO]
                                                     train on a stored run's trajectories, no engines
    sluiceway eval [CONFIG.yaml] --hf-checkpoint M --eval-prompt-data ...   evaluate a model, no training
    sluiceway resume RUN_DIR_OR_ID                   run a failed or killed run again from where it stopped
    sluiceway config [CONFIG.yaml] [flags]           print the resolved config as YAML
    sluiceway plan [CONFIG.yaml] [flags] [--available-gib N]   memory per trainer rank and engine for the layout
                                                     (flows/plan.py); exit status 1 if it cannot fit
    sluiceway models                                 list the model zoo
    sluiceway engine --model NAME_OR_DIR [--port N]  serve the embedded engine (SGLang's HTTP API)
    sluiceway server [--port 4200]                   a Prefect server and its UI on loopback
    sluiceway serve [CONFIG.yaml] [flags] [--cron X]  deployments of the flows (flows/deploy.py)
    sluiceway weights ls|diff A B|apply V --to DIR|verify V --store URI   inspect and repair a weight store
                                                     (published weight versions; alias: ckpt)

Every config field is a flag named after it (`rollout_batch_size` -> `--rollout-batch-size`), which gives
slime's names for the fields slime has. A user mistake prints one line and exits 2, never a traceback.
"""

# ruff: noqa: E402 - the signal handlers are installed before the slow imports below

from __future__ import annotations

import os
import sys

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "sluiceway":
    # The `sluiceway` command: from its first import on, SIGINT and SIGTERM end a run in order (infra/proc.py
    # `exit_on_signals`), never as a KeyboardInterrupt inside an import or a library's cleanup.
    from sluiceway.infra.proc import exit_on_signals

    exit_on_signals(sys.argv[1:])

import argparse
import gc
import re
import types
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

import yaml

from sluiceway.flows import slime_compat
from sluiceway.flows.config import RunConfig, build_config, load_yaml
from sluiceway.flows.weights_cmd import add_parser as add_weights_parser
from sluiceway.infra.errors import UserError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No prefix matching: slime's --normalize-advantages would silently be --normalize-advantages-by-std.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # argparse would print usage and the message
        raise UserError(f"{self.prog}: {message}")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def field_flags() -> dict[str, tuple[str, str]]:
    """flag -> (group, field) for every field of every config group."""
    flags: dict[str, tuple[str, str]] = {}
    for group, info in RunConfig.model_fields.items():
        for name in info.annotation.model_fields:
            flag = _flag(name)
            assert flag not in flags, f"config field {name} is defined in two groups"
            flags[flag] = (group, name)
    return flags


def _add_field_arguments(parser: argparse.ArgumentParser) -> None:
    for group, info in RunConfig.model_fields.items():
        model = info.annotation
        section = parser.add_argument_group(group)
        for name, f in model.model_fields.items():
            ann = f.annotation
            inner = [a for a in get_args(ann) if a is not type(None)] if isinstance(ann, types.UnionType) else [ann]
            kwargs: dict = {"dest": f"{group}.{name}", "default": argparse.SUPPRESS, "help": f.description}
            if inner == [bool]:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif get_origin(inner[0]) is list:
                kwargs["nargs"] = "+"
                kwargs["metavar"] = get_args(inner[0])[0].__name__.upper()
            elif get_origin(inner[0]) is Literal:
                kwargs["choices"] = list(get_args(inner[0]))
            else:
                kwargs["metavar"] = inner[0].__name__.upper()  # pydantic converts and checks the value
            section.add_argument(_flag(name), **kwargs)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sluiceway", description="Durable RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cmd, help_ in (
        ("run", "run the RL loop"),
        ("sft", "supervised fine-tuning on a data file (slime's SFT format)"),
        ("replay", "train on a stored run's trajectories at a table version, with no engine running"),
        ("eval", "evaluate a model (zoo name, HF directory, or a run's weights) on the eval sets"),
        ("config", "print the resolved config as YAML"),
        ("plan", "memory per trainer rank and engine of the layout: weights, grads, optimizer, activations, KV"),
    ):
        p = sub.add_parser(cmd, help=help_)
        p.add_argument("config_file", nargs="?", help="YAML run config (flags override it)")
        if cmd == "plan":
            p.add_argument(
                "--available-gib",
                type=float,
                default=None,
                help="plan against this much memory (per GPU with --device cuda) instead of what is here",
            )
        _add_field_arguments(p)
        slime_compat.add_arguments(p)
        if cmd in ("run", "config", "plan"):
            p.add_argument(
                "--from-slime-script",
                metavar="SCRIPT.sh",
                help="take the flags of a slime launch script (its *_ARGS arrays, the model files it sources, its "
                "train.py line), print how each is treated, then run; flags after it override the script's",
            )
    res = sub.add_parser("resume", help="run a failed or killed run again from its first unfinished stage")
    res.add_argument("run", help="the run's output directory, or its run id (looked up under --runs-root)")
    res.add_argument("--runs-root", default="runs", help="where run ids are looked up (default ./runs)")
    sub.add_parser("models", help="list the model zoo")
    srv = sub.add_parser("server", help="run a Prefect server and its UI on loopback, home inside the project")
    srv.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    srv.add_argument("--port", type=int, default=4200)
    srv.add_argument("--home", default=".sluiceway/prefect", help="PREFECT_HOME: the server's database and settings")
    dep = sub.add_parser("serve", help="register deployments of the flows; their parameter form is the run config")
    dep.add_argument("config_file", nargs="?", help="YAML run config: the deployments' default parameters")
    dep.add_argument("--name", default="default", help="deployment name (sluiceway-rl/NAME, sluiceway-sft/NAME)")
    dep.add_argument("--cron", default=None, help="schedule: a cron expression, e.g. '0 3 * * *'")
    dep.add_argument("--interval", type=float, default=None, help="schedule: every this many seconds")
    dep.add_argument("--pool", default=None, help="register on this Prefect work pool and exit (else serve here)")
    dep.add_argument("--flow", action="append", default=None, help="only this flow (rl, sft, eval, replay; repeatable)")
    dep.add_argument("--api-url", default=None, help="the Prefect API (default $PREFECT_API_URL or 127.0.0.1:4200)")
    dep.add_argument("--home", default=".sluiceway/prefect", help="PREFECT_HOME of this client process")
    _add_field_arguments(dep)
    rep = sub.add_parser("report", help="a run's per-step metrics as a markdown table, its charts as a PNG")
    rep.add_argument("output_dir", help="the run's --output-dir")
    rep.add_argument("--run-id", default=None, help="default: the output directory's name")
    rep.add_argument("--storage-uri", default=None, help="where the run's tables are, if not OUTPUT_DIR/tables")
    rep.add_argument("--plot", metavar="PATH", help="write the charts PNG here (default OUTPUT_DIR/curves.png)")
    eng = sub.add_parser("engine", help="serve the embedded rollout engine (SGLang's native HTTP API)")
    eng.add_argument("--model", required=True, help="zoo name or HF model directory")
    eng.add_argument("--host", default="127.0.0.1")
    eng.add_argument("--port", type=int, default=30000)
    eng.add_argument("--max-running-requests", type=int, default=64)
    eng.add_argument("--max-total-len", type=int, default=1024, help="prompt + response tokens per request")
    eng.add_argument(
        "--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
        help="auto: bfloat16 where this CPU computes it natively and faster (infra/precision.py), else float32",
    )  # fmt: skip
    eng.add_argument("--weight-version", default="0")
    eng.add_argument("--seed", type=int, default=None, help="base seed for requests without sampling_seed")
    eng.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    add_weights_parser(sub)
    pools = sub.add_parser("pools", help="local inference pools that pull weight versions (development)")
    pools_sub = pools.add_subparsers(dest="pools_command", required=True, parser_class=_Parser)
    up = pools_sub.add_parser("up", help="start the pools of a YAML file and serve until Ctrl-C")
    up.add_argument("pools_file", metavar="POOLS.yaml")
    up.add_argument("--work-dir", default="runs/pools", help="logs, materialized weights and status per pool")
    return parser


# A command's own defaults, which the YAML and the flags override: replay corrects for its stored behaviour
# policy with truncated importance sampling (flows/replay.py says why).
COMMAND_DEFAULTS = {"replay": {("algorithm", "use_tis"): True}}


def resolve_config(args: argparse.Namespace) -> RunConfig:
    base = load_yaml(args.config_file) if args.config_file else {}
    overrides = {tuple(k.split(".", 1)): v for k, v in vars(args).items() if "." in k}
    command = getattr(args, "command", "run")
    for (group, field), value in COMMAND_DEFAULTS.get(command, {}).items():
        in_yaml = isinstance(base.get(group), dict) and field in base[group]
        if (group, field) not in overrides and not in_yaml:
            overrides[(group, field)] = value
    checked = command if command in ("replay", "eval", "plan") else "run"  # whose invariants apply
    return build_config(base, overrides, source=args.config_file or "flags", command=checked)


def main(argv: list[str] | None = None) -> int:
    from sluiceway.infra.proc import hold_if_stopping

    try:
        from sluiceway.infra.sglang_launcher import split_sglang_args

        argv = _from_slime_script(list(sys.argv[1:] if argv is None else argv))
        argv, sglang_args = split_sglang_args(argv)
        args = make_parser().parse_args(argv)
        given = slime_compat.take(args)
        if sglang_args:
            vars(args)["rollout.sglang_server_args"] = sglang_args
        if args.command in ("weights", "ckpt"):
            from sluiceway.flows.weights_cmd import run as run_weights

            return run_weights(args)
        if args.command == "pools":
            from sluiceway.flows.pools import pools_up

            return pools_up(args.pools_file, args.work_dir)
        if args.command == "models":
            from sluiceway.models.zoo import ZOO

            for name, entry in ZOO.items():
                print(f"{name:24s} {entry.description}")
            return 0
        if args.command == "engine":
            from sluiceway.models.engine.server import serve

            if args.max_running_requests < 1 or args.max_total_len < 2:
                raise UserError("engine: --max-running-requests must be >= 1 and --max-total-len >= 2")
            if args.num_threads is not None and args.num_threads < 1:
                raise UserError("engine: --num-threads must be >= 1")
            if args.dtype == "auto":
                from sluiceway.infra.precision import choose

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
        if args.command == "server":
            from sluiceway.flows.deploy import run_server

            return run_server(args.host, args.port, args.home)
        if args.command == "serve":
            from sluiceway.flows.deploy import serve

            given = args.config_file or any("." in k for k in vars(args))
            base = resolve_config(args).model_dump(mode="json") if given else None
            serve(base, name=args.name, cron=args.cron, interval=args.interval, pool=args.pool,
                  api_url=args.api_url, home=args.home, only=args.flow)  # fmt: skip
            return 0
        if args.command == "report":
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
        if args.command == "resume":
            from sluiceway.flows.resume import load_run_record

            command, cfg = load_run_record(args.run, args.runs_root)
            return _dispatch(command, cfg)
        if args.command == "sft":
            vars(args).setdefault("algorithm.loss_type", "sft_loss")  # what makes the config an SFT one
        cfg = resolve_config(args)
        slime_compat.check_architecture(given, cfg.training.hf_checkpoint)  # before anything expensive
        slime_compat.report(given, cfg)
        if args.command == "plan":
            from sluiceway.flows.plan import print_plan

            return print_plan(cfg, args.available_gib)
        if args.command == "config":
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
            return 0
        return _dispatch(args.command, cfg)
    except UserError as e:
        hold_if_stopping()  # a signal is ending the run (infra/proc.py): no other line after `interrupted`
        # One line, even for a file name with a newline in it: control characters are shown escaped.
        msg = re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], str(e))
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the commands that keep Python's SIGINT handling (infra/proc.py FLOW_COMMANDS)
        hold_if_stopping()
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a fault: one line here, the traceback in the run's log file (flows/faults.py)
        hold_if_stopping()  # ... unless the fault is what a signal's stopping the run's processes caused
        from sluiceway.flows.faults import explain
        from sluiceway.flows.run import record_failure

        out = explain(e, _RUN_DIR[0] if _RUN_DIR else None)
        log_path = record_failure(out.message, e)
        where = f" (traceback in {log_path})" if log_path else ""
        print(f"error: {out.message}{where}", file=sys.stderr)
        return out.exit_code


def _from_slime_script(argv: list[str]) -> list[str]:
    """`--from-slime-script FILE`: the script's train.py flags in its place (later flags override them)."""
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--from-slime-script" or word.startswith("--from-slime-script="):
            if "=" in word:
                path, rest = word.split("=", 1)[1], argv[i + 1 :]
            elif i + 1 < len(argv):
                path, rest = argv[i + 1], argv[i + 2 :]
            else:
                raise UserError("--from-slime-script: expected a slime launch script")
            from sluiceway.flows.slime_script import read_slime_script

            script = read_slime_script(path)
            print(f"slime script {path}: {len(script.argv)} words from its train.py line"
                  + (f" (sourced: {', '.join(str(p) for p in script.sources)})" if script.sources else ""),
                  file=sys.stderr)  # fmt: skip
            for line in slime_compat.describe(script.argv):
                print(line, file=sys.stderr)
            return [*argv[:i], *script.argv, *rest]
    return argv


_RUN_DIR: list[Path] = []
_CONSOLE: list[bool] = []  # set by `entry`: this process is the sluiceway command, not a test calling main()


def _dispatch(command: str, cfg: RunConfig) -> int:
    """Run a flow command; the run record written first is what `sluiceway resume` replays."""
    from sluiceway.flows.precision import resolve_precision
    from sluiceway.flows.preflight import preflight
    from sluiceway.flows.resume import RESUMABLE, save_run_record
    from sluiceway.flows.run import configure_logging, send_native_stderr_to_log
    from sluiceway.storage import run_lock
    from sluiceway.storage.integrity import check_tables
    from sluiceway.storage.maintenance import RUN_TABLES

    preflight(cfg, command)  # file mistakes are one line here, before logging, engines or Prefect start
    if _CONSOLE:
        send_native_stderr_to_log(cfg)
    configure_logging(cfg)
    slime_compat.log_pending()  # slime flags not applicable here, once in the run's log
    # Resolved before the run record is written (a resumed run keeps the precision it started with) and before
    # the engines start; the flow logs the choice once everything is checked.
    cfg = resolve_precision(cfg, announce=False)
    _RUN_DIR[:] = [Path(cfg.storage.output_dir).resolve()]  # where a fault's message looks for a full disk
    # One live process per run directory and run tables (storage/run_lock.py), taken before the run record is
    # written or anything starts: a second run is refused with one line naming the first.
    store = run_store(cfg)
    with run_lock.hold(Path(cfg.storage.output_dir).resolve(), store, cfg.run_id, command):
        check_tables(store, RUN_TABLES)  # a damaged table is one line, not a run on unreadable data
        if command in RESUMABLE:
            save_run_record(cfg, command, store)
        if command == "sft":
            from sluiceway.flows.run import run_sft

            run_sft(cfg)
        elif command in ("replay", "eval"):
            from sluiceway.flows.run import run_eval, run_replay

            (run_replay if command == "replay" else run_eval)(cfg)
        else:
            from sluiceway.flows.run import run

            run(cfg)
    return 0


def run_store(cfg: RunConfig):
    from sluiceway.storage.object_store import ObjectStore

    return ObjectStore.from_uri(cfg.tables_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)


def entry() -> None:
    """The `sluiceway` console script (and `python -m sluiceway.flows.cli`): `main`, then a prompt exit.

    The garbage collector is switched off and its objects frozen before the interpreter's teardown: after a
    run, collecting the object graphs of torch, megatron and Prefect at exit took 2-3 s (SmolLM2, 2 cores), and
    the process's memory goes back to the system when it ends anyway. Reference counting, finalizers and atexit
    handlers (the embedded Prefect server's stop, logging's flush) work as at any exit. A flow command then exits
    from the last atexit callback, without the interpreter's teardown of its modules (infra/proc.py
    `exit_on_signals`): its signal handlers stay until the end, and no failed flush changes the code.
    """
    from sluiceway.infra.proc import hold_if_stopping, set_exit_code

    _CONSOLE.append(True)
    try:
        code = main()
        if code == 1 and _RUN_DIR:  # a fault was printed as one line: what the teardown says goes to the run's log
            from sluiceway.flows.run import quiet_teardown

            quiet_teardown(_RUN_DIR[0])
    finally:
        hold_if_stopping()  # a signal is ending the run: its exit code, not this one (infra/proc.py)
    set_exit_code(code)  # a flow command ends with it after the atexit callbacks, before the interpreter's teardown
    gc.disable()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
