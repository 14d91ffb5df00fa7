"""Deployments take the typed run config as their parameter (the UI shows its form), with their schedule and job
variables and no secrets."""

from __future__ import annotations

from sluiceway.flows.config import RunConfig


def test_deployments_take_the_run_config_as_their_parameter(tmp_path, monkeypatch):
    from sluiceway.flows.deploy import build_deployments

    monkeypatch.chdir(tmp_path)
    base = RunConfig.model_validate({"data": {"prompt_data": "env:arithmetic"}}).model_dump(mode="json")
    deps = {d.flow_name: d for d in build_deployments(base, name="nightly", cron="0 3 * * *", pool="p")}
    assert set(deps) >= {"sluiceway-rl"}
    rl = deps["sluiceway-rl"]
    assert rl.entrypoint == "sluiceway.flows.rl.rl_flow"
    schema = rl._parameter_openapi_schema.model_dump()
    assert schema["properties"]["config"]["$ref"] == "#/definitions/RunConfig"
    assert "rollout_batch_size" in schema["definitions"]["RolloutConfig"]["properties"]
    cfg = RunConfig.model_validate(rl.parameters["config"])  # the default is a valid run config
    assert cfg.storage.output_dir == str(tmp_path / "runs" / "default")  # absolute: a worker runs elsewhere
    assert [s.schedule.cron for s in rl.schedules] == ["0 3 * * *"]
    assert rl.job_variables["working_dir"] == str(tmp_path)
    assert not any(k.startswith(("AWS_", "WANDB")) for k in rl.job_variables["env"])
    if "sluiceway-sft" in deps:
        assert deps["sluiceway-sft"].parameters["config"]["algorithm"]["loss_type"] == "sft_loss"
