"""`sluiceway run --recompute-granularity full`: the same run as without recompute, bit for bit (recompute
replays the forward in backward with the same RNG state; tests/unit/models/test_recompute.py checks gradients)."""

import pytest
import torch
from cli_run import run_cli

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)["model"]


@pytest.mark.slow  # 31 s, two runs; recompute's gradients are checked in tests/unit/models/test_recompute.py
def test_a_run_with_full_recompute_trains_the_same_weights(tmp_path):
    cache = tmp_path / "cache"
    run_cli(tmp_path / "plain", cache, "--num-rollout", "2")
    run_cli(tmp_path / "recompute", cache, "--num-rollout", "2", "--recompute-granularity", "full")
    assert "activation recompute: recompute_granularity full" in (tmp_path / "recompute" / "sluiceway.log").read_text()
    plain, recompute = final_weights(tmp_path / "plain"), final_weights(tmp_path / "recompute")
    assert plain.keys() == recompute.keys()
    for name, tensor in plain.items():
        assert torch.equal(tensor, recompute[name]), name
