"""Ray placement settings: what is refused before anything starts, and the SGLang command an engine actor runs."""

import pytest

from sluiceway.flows.config import build_config


def cfg(**rollout_and_resources):
    groups = {"resources": {}, "rollout": {}}
    for key, value in rollout_and_resources.items():
        groups["resources" if key in ("ray_address", "actor_num_nodes", "trainer_launcher") else "rollout"][key] = value
    return build_config({"data": {"prompt_data": "env:arithmetic"}, **groups}, {}, source="t.yaml")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"actor_num_nodes": 2}, "needs ray_address"),
        ({"ray_address": "auto", "trainer_launcher": "torchrun"}, "leave trainer_launcher at auto"),
        ({"rollout_num_gpus": 2}, "needs ray_address and rollout_engine sglang"),
        ({"ray_address": "auto", "rollout_engine": "sglang", "rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2},
         "must be a multiple of rollout_num_gpus_per_engine"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_be_placed_are_refused(settings, message):
    from sluiceway.infra.errors import UserError

    with pytest.raises(UserError, match=message):
        cfg(**settings)


def test_an_sglang_engine_actor_serves_on_its_node_with_its_gpus():
    from sluiceway.flows.engines import fleet_settings
    from sluiceway.infra.engine_fleet import sglang_on_node

    c = cfg(ray_address="auto", rollout_engine="sglang", rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    cmd = sglang_on_node("/models/m", 2, fleet_settings(c), [], "10.0.0.7", 31000)
    assert cmd[cmd.index("--host") + 1] == "10.0.0.7" and cmd[cmd.index("--port") + 1] == "31000"
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--model-path") + 1] == "/models/m"
