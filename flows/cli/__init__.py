"""The `sluiceway` command: one module per command, each with `add_parser(sub)` and `run(args)`.

    sluiceway run [CONFIG.yaml] [--flag value ...]   train (flags override the YAML)              run.py
    sluiceway sft [CONFIG.yaml] [--flag value ...]   supervised fine-tuning on --prompt-data      sft.py
    sluiceway replay [CONFIG.yaml] --replay-run-id RUN [--replay-version N | --replay-timestamp ISO]
                                                     train on a stored run's trajectories         replay.py
    sluiceway eval [CONFIG.yaml] --hf-checkpoint M --eval-prompt-data ...   evaluate, no training eval.py
    sluiceway resume RUN_DIR_OR_ID                   run a failed or killed run again             resume.py
    sluiceway config [CONFIG.yaml] [flags]           print the resolved config as YAML            config.py
    sluiceway plan [CONFIG.yaml] [flags] [--available-gib N]   memory per trainer rank and engine plan.py
    sluiceway models                                 list the model zoo                           models.py
    sluiceway engine --model NAME_OR_DIR [--port N]  serve the embedded engine (SGLang's API)     engine.py
    sluiceway server [--port 4200]                   a Prefect server and its UI on loopback      server.py
    sluiceway serve [CONFIG.yaml] [flags] [--cron X]  deployments of the flows                    serve.py
    sluiceway report OUTPUT_DIR                      a run's metrics table and charts             report.py
    sluiceway weights ls|diff A B|apply V --to DIR|verify V --store URI   a weight store (alias: ckpt)  weights.py
    sluiceway pools up POOLS.yaml                    local inference pools (development)          pools.py

main.py holds the table of commands and `main`; parser.py what the config-taking commands share (a flag per
config field, `rollout_batch_size` -> `--rollout-batch-size`, which gives slime's names for the fields slime has,
grouped by config part in --help); flow.py runs a flow command. slime's other flags are flows/slime/'s. A user
mistake prints one line and exits 2, never a traceback.
"""

# ruff: noqa: E402 - the signal handlers are installed before the slow imports below

import os
import sys

# The `sluiceway` command (the console script, or `python -m sluiceway.flows.cli`, which imports this package
# while sys.argv[0] is still "-m"): from its first import on, SIGINT and SIGTERM end a run in order (infra/proc.py
# `exit_on_signals`), never as a KeyboardInterrupt inside an import or a library's cleanup.
if sys.argv[0] == "-m" or os.path.basename(sys.argv[0]) == "sluiceway":
    from sluiceway.infra.proc import exit_on_signals

    exit_on_signals(sys.argv[1:])

from sluiceway.flows.cli.main import entry, main, make_parser
from sluiceway.flows.cli.parser import resolve_config
from sluiceway.flows.config import field_flags

__all__ = ["entry", "field_flags", "main", "make_parser", "resolve_config"]
