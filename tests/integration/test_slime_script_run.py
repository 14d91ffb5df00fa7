"""`sluiceway run --from-slime-script` on slime's own fully-async example, converted for tiny-llama on the CPU by
examples/run_slime_example_cpu.py (issue 23): it prints how each flag is treated, runs two steps, and logs the
flags not applicable here once."""

import importlib.util
import os
import subprocess

import pytest
from deltalake import DeltaTable
from paths import ROOT

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


def load_example():
    spec = importlib.util.spec_from_file_location("slime_example", ROOT / "examples" / "run_slime_example_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slime_fully_async_example_runs_on_cpu(tmp_path):
    example = load_example()
    converted, env = example.convert(tmp_path / "script")
    env = {**os.environ, **env, "SLUICEWAY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(example.command(converted, tmp_path), capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    err = proc.stderr
    # what it mapped, flag by flag, before the run
    assert "--attention-backend flash  ->  not applicable" in err
    assert "--save /tmp/slime_fully_async_demo/  ->  mapped: onto --output-dir" in err
    assert "--num-layers 2  ->  architecture" in err
    fully_async = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
    assert f"--rollout-function-path {fully_async}  ->  implemented" in err
    run = tmp_path / "run"
    log = (run / "sluiceway.log").read_text()
    assert log.count("slime flags not applicable on this device") == 1
    assert "--sequence-parallel" in log and "agree with tiny-llama's config.json" in log
    assert "mode: fully-async" in (run / "sluiceway-run.yaml").read_text()
    metrics = DeltaTable(str(run / "tables" / "metrics")).to_pyarrow_table().to_pylist()
    assert len({m["step"] for m in metrics}) == 2  # slime's --num-rollout 3, overridden by the example
