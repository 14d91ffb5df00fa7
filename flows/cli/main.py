"""The `sluiceway` command's table of commands, its parser, and `main`: parse, run the command, turn what ended it
into one line and an exit status."""

from __future__ import annotations

import argparse
import gc
import re
import sys

from sluiceway.flows.cli import (
    config,
    engine,
    eval,
    models,
    plan,
    pools,
    replay,
    report,
    resume,
    run,
    serve,
    server,
    sft,
    tinker,
    weights,
)
from sluiceway.flows.cli.flow import FlowCommand, Invocation, dispatch
from sluiceway.flows.cli.parser import Parser
from sluiceway.flows.slime import splice_slime_script
from sluiceway.infra.errors import UserError

# command -> its module: `add_parser(sub)` declares its arguments, `run(args)` runs it and returns the exit status
# (a flow command returns the `FlowCommand` for `main` to run: flows/cli/flow.py)
COMMANDS = {
    "run": run,
    "sft": sft,
    "replay": replay,
    "eval": eval,
    "config": config,
    "plan": plan,
    "resume": resume,
    "models": models,
    "server": server,
    "serve": serve,
    "report": report,
    "engine": engine,
    "weights": weights,
    "ckpt": weights,  # the alias kept for scripts written before the rename
    "pools": pools,
    "tinker": tinker,
}


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sluiceway", description="Durable RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None, inv: Invocation | None = None) -> int:
    from sluiceway.infra import held_lines
    from sluiceway.infra.proc import hold_if_stopping

    inv = inv if inv is not None else Invocation()
    try:
        from sluiceway.infra.sglang_launcher import split_sglang_args

        argv = splice_slime_script(list(sys.argv[1:] if argv is None else argv))
        argv, sglang_args = split_sglang_args(argv)
        args = make_parser().parse_args(argv)
        if sglang_args:
            vars(args)["rollout.sglang_server_args"] = sglang_args
        out = COMMANDS[args.command].run(args)
        return dispatch(out, inv) if isinstance(out, FlowCommand) else out
    except UserError as e:
        held_lines.drop()  # the lines held for the run (infra/held_lines.py): the mistake's line is the only one
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

        held_lines.drop()  # a fault before the run started: its one line, nothing held for a run that never began
        out = explain(e, inv.run_dir)
        log_path = record_failure(out.message, e)
        where = f" (traceback in {log_path})" if log_path else ""
        print(f"error: {out.message}{where}", file=sys.stderr)
        return out.exit_code


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

    inv = Invocation(console=True)
    try:
        code = main(inv=inv)
        if code == 1 and inv.run_dir:  # a fault was printed as one line: what the teardown says goes to the run's log
            from sluiceway.flows.run import quiet_teardown

            quiet_teardown(inv.run_dir)
    finally:
        hold_if_stopping()  # a signal is ending the run: its exit code, not this one (infra/proc.py)
    set_exit_code(code)  # a flow command ends with it after the atexit callbacks, before the interpreter's teardown
    gc.disable()
    gc.freeze()
    sys.exit(code)
