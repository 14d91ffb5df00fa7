"""`sluiceway run --use-tis --tis-mode icepop|mis` on tiny-llama trains, masks tokens or sequences where the engine's
log-probs differ from the trainer's, and logs the mismatch statistics each step (the masks are checked by hand in
tests/unit/train/test_mismatch_corrections.py).

On CPU in fp32 the embedded engine and the trainer agree exactly, so the mismatch is made the way it arises in
asynchronous training: with --mode one-step-off, step 1 trains on samples of the weights before step 0's update
(rollout/staleness_max 1), and the trainer's log-probs of them differ from the engine's by up to about 0.26."""

import math

import pytest
import torch
from cli_run import run_cli

from sluiceway.models.hf_megatron import hf_to_megatron
from sluiceway.models.zoo import load_hf_model, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

STATS = ("mismatch_kl", "tis_weight_mean", "tis_clipfrac", "tis_masked_frac", "tis_masked_seq_frac")


# icepop: tokens with a ratio outside [1/1.2, 1.2] (|log ratio| > 0.18); mis: sequences whose geometric-mean
# ratio leaves [1/1.02, 1.02]
@pytest.mark.parametrize(("mode", "bound"), [("icepop", "1.2"), ("mis", "1.02")])
def test_icepop_or_mis_run_masks_and_trains(tmp_path, mode, bound):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_cli(run_dir, cache, "--num-rollout", "3", "--mode", "one-step-off", "--use-tis", "--tis-mode", mode,
            "--tis-clip", bound)  # fmt: skip
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    values = {name: {r["step"]: r["value"] for r in m if r["name"] == f"train/{name}"} for name in ("loss", *STATS)}
    for name, per_step in values.items():
        assert set(per_step) == {0, 1, 2} and all(math.isfinite(v) for v in per_step.values()), (name, per_step)
    for step in (0, 1, 2):
        assert values["mismatch_kl"][step] >= 0.0 and values["tis_weight_mean"][step] > 0.0
        assert 0.0 <= values["tis_masked_frac"][step] < 1.0 and 0.0 <= values["tis_masked_seq_frac"][step] < 1.0
    # step 1 trains one version off-policy: a mismatch, and some tokens (icepop) or whole sequences (mis) masked
    assert values["mismatch_kl"][1] > 0.0 and values["tis_masked_frac"][1] > 0.0
    assert mode == "icepop" or values["tis_masked_seq_frac"][1] > 0.0
    hf = load_hf_model(resolve_checkpoint("tiny-llama", cache_dir=cache))
    initial = hf_to_megatron(hf.state_dict(), hf.config)
    trained = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
    assert trained["weight_version"] == 3
    changed = [k for k, v in initial.items() if not torch.equal(v, trained["model"][k])]
    assert len(changed) >= len(initial) // 2, f"only {len(changed)} of {len(initial)} tensors changed"


def test_custom_tis_function_run_logs_its_metrics(tmp_path):
    """tests/tis_helpers.py:half_weights (0.5, or 0 where |old - rollout| > 1) as a file path; its metrics
    abs_gap and tis_w are logged as train/tis_abs_gap and train/tis_w."""
    import tis_helpers

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_cli(run_dir, cache, "--num-rollout", "2", "--mode", "one-step-off", "--use-tis",
            "--custom-tis-function-path", f"{tis_helpers.__file__}:half_weights")  # fmt: skip
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    names = (*STATS, "tis_abs_gap", "tis_w")
    values = {name: {r["step"]: r["value"] for r in m if r["name"] == f"train/{name}"} for name in names}
    assert values["tis_abs_gap"][0] < 1e-4 < values["tis_abs_gap"][1]  # on-policy, then one version off
    for step in (0, 1):  # no gap exceeds 1 here: every trained token weighs 0.5
        assert values["tis_w"][step] == pytest.approx(0.5) and values["tis_weight_mean"][step] == pytest.approx(0.5)
        assert values["tis_masked_frac"][step] == 0.0
