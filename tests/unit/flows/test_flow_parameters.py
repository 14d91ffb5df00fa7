"""Every flow takes the typed run config, so each deployment's parameter form in the Prefect UI is the config's
form (not a JSON editor), and a parameter is checked with the invariants of its command."""

import pytest
from prefect.utilities.callables import parameter_schema

from sluiceway.flows.config import EvalRunConfig, ReplayRunConfig, RunConfig
from sluiceway.flows.deploy import flows


@pytest.mark.parametrize(
    ("short", "typed"), [("rl", "RunConfig"), ("sft", "RunConfig"), ("eval", "EvalRunConfig"),
                         ("replay", "ReplayRunConfig")],
)  # fmt: skip
def test_each_flow_takes_a_typed_config(short, typed):
    schema = parameter_schema(flows([short])[short].fn)
    assert list(schema.properties) == ["config"]
    assert schema.properties["config"]["$ref"] == f"#/definitions/{typed}"
    assert {"TrainingConfig", "EvalConfig", "DataConfig"} <= set(schema.definitions)


def test_typed_parameters_check_their_commands_invariants():
    evals = {"eval": {"eval_prompt_data": ["env:arithmetic"]}}
    assert EvalRunConfig.model_validate(evals).data.prompt_data is None  # eval needs no training data
    with pytest.raises(ValueError, match="eval needs eval_prompt_data"):
        EvalRunConfig.model_validate({})
    with pytest.raises(ValueError, match="replay needs replay_run_id"):
        ReplayRunConfig.model_validate({})
    with pytest.raises(ValueError, match="prompt_data is required"):
        RunConfig.model_validate(evals)
