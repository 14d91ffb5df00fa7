"""One live run per run id in a process (flows/live_run.py): the CLI opens it and its flow enters the same one; tasks
find the flow's live objects by run id; what the flow did not take is closed when the run closes; a lost lease
stops the next stage."""

import pytest

from sluiceway.flows.config import RunConfig
from sluiceway.flows.live_run import live, open_run
from sluiceway.infra.errors import Fault


def config(tmp_path) -> RunConfig:
    return RunConfig.model_validate(
        {"storage": {"output_dir": str(tmp_path / "run")}, "data": {"prompt_data": "env:arithmetic"},
         "logging": {"run_id": "r1"}}
    )  # fmt: skip


class Closable:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def test_the_flow_enters_the_run_the_cli_opened(tmp_path):
    cfg = config(tmp_path)
    with open_run(cfg, "run") as cli:
        cli.prepared = "checked inputs"
        with open_run(cfg, "run") as flow:  # the flow, in the same process: the same run, the lock not taken again
            assert flow is cli
            assert flow.take_prepared(lambda c: "made again") == "checked inputs"
            assert flow.take_prepared(lambda c: "made again") == "made again"  # taken once
    with open_run(cfg, "run") as again:  # closed: the next command opens a new one
        assert again is not cli


def test_tasks_find_the_flows_live_objects_by_run_id(tmp_path):
    cfg = config(tmp_path)
    state = Closable()
    with open_run(cfg, "run") as run:
        with pytest.raises(RuntimeError, match="run r1 has no live Closable"):
            live("r1", Closable)  # the flow has not started serving
        with run.serving(state, Closable.close):
            assert live("r1", Closable) is state
            with pytest.raises(RuntimeError, match="run other has no live Closable"):
                live("other", Closable)
            with pytest.raises(RuntimeError, match="run r1 has no live int"):
                live("r1", int)
        assert state.closed == 1
        with pytest.raises(RuntimeError):
            live("r1", Closable)


def test_engines_the_flow_did_not_take_are_closed_with_the_run(tmp_path):
    cfg = config(tmp_path)
    taken, left = Closable(), Closable()
    with open_run(cfg, "run") as run:
        run.early_engines = taken
        assert run.take_early_engines() is taken
    assert taken.closed == 0  # the flow's runtime owns what it took
    with pytest.raises(ValueError), open_run(cfg, "run") as run:
        run.early_engines = left
        raise ValueError("the flow failed before it took them")
    assert left.closed == 1


def test_a_lost_lease_stops_the_next_stage(tmp_path):
    cfg = config(tmp_path)
    with open_run(cfg, "run") as run, run.serving(Closable(), Closable.close):
        run.lock._lease.lost = "its lease was taken over"
        with pytest.raises(Fault, match="run r1: its lease was taken over"):
            live("r1", Closable)
        run.lock._lease.lost = None  # released cleanly below
