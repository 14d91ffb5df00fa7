"""Entry point behind `sluiceway run`: configure embedded Prefect inside the run directory, then run the flow."""

from __future__ import annotations

import logging
import os

from sluiceway.flows.config import RunConfig
from sluiceway.infra.prefect_env import configure_prefect


def run(cfg: RunConfig) -> dict:
    configure_prefect(cfg.storage.output_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub at run time
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Libraries (httpx, megatron) log at INFO; only sluiceway's own logger follows --log-level.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("sluiceway").setLevel(cfg.logging.log_level)
    from sluiceway.flows.rl import rl_flow  # imported after Prefect's settings are in the environment
    from sluiceway.flows.runtime import hand_over, prepare

    # Everything a user can get wrong (data files, scorer, model name, prompt lengths) is checked here,
    # before the flow starts, so a mistake is one line rather than a failed flow run; the flow reuses it.
    hand_over(cfg, prepare(cfg))

    result = rl_flow(cfg.model_dump(mode="json"))
    if not cfg.logging.quiet:
        print(
            f"done: {result['steps']} steps, weight version {result['final_weight_version']}, "
            f"tables at {result['tables']}"
        )
    return result
