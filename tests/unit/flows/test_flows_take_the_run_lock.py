"""Every flow a deployment starts (the Prefect UI, `sluiceway serve`) takes the run's lock itself, as the CLI does
before it starts one (flows/live_run.py open_run): a second run on a live run's directory is refused with the one
line naming the first, before anything is prepared."""

import multiprocessing as mp

import pytest
from storage_helpers import hold_run_lock

from sluiceway.flows.config import RunConfig, validate_for
from sluiceway.flows.eval import eval_flow
from sluiceway.flows.replay import replay_flow
from sluiceway.flows.rl import rl_flow
from sluiceway.flows.sft import sft_flow
from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore


def config(run_dir, command):
    data = {
        "storage": {"output_dir": str(run_dir)},
        "data": {"prompt_data": "env:arithmetic"},
        "training": {"precision": "fp32"},
        "logging": {"run_id": "r1"},
        "replay": {"replay_run_id": "stored"},
        "eval": {"eval_prompt_data": ["env:arithmetic"]},
    }
    return validate_for(RunConfig.model_validate(data), command)


@pytest.mark.parametrize(
    "flow, command", [(rl_flow, "run"), (sft_flow, "run"), (replay_flow, "replay"), (eval_flow, "eval")]
)
def test_a_deployment_flow_on_a_live_run_is_refused(tmp_path, flow, command):
    run_dir = tmp_path / "run"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    tables = ObjectStore.from_uri(str(run_dir / "tables"))
    child = ctx.Process(target=hold_run_lock, args=(run_dir, tables, ready, stop))
    child.start()
    try:
        assert ready.wait(60)
        with pytest.raises(UserError, match=rf"in use by `sluiceway run` \(pid {child.pid} on "):
            flow.fn(config(run_dir, command))
    finally:
        stop.set()
        child.join(30)
