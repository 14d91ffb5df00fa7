"""Precision: `auto` picks bf16 only where this CPU computes it natively and faster; explicit choices win."""

import json

import pytest

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.config import TrainingConfig
from sluiceway.flows.precision import resolve_precision
from sluiceway.infra import held_lines
from sluiceway.infra.errors import UserError
from sluiceway.models import precision


def cfg_from(argv):
    return resolve_config(make_parser().parse_args(argv))


def test_bf16_flag_and_precision_are_one_setting():
    assert TrainingConfig().precision == "auto" and TrainingConfig().bf16 is None
    assert (TrainingConfig(bf16=True).precision, TrainingConfig(bf16=False).precision) == ("bf16", "fp32")
    assert TrainingConfig(precision="bf16").bf16 is True and TrainingConfig(precision="fp32").bf16 is False
    assert TrainingConfig(precision="bf16", bf16=True).bf16 is True
    # A dumped, resolved config (what the Prefect flow receives) validates back to itself.
    t = TrainingConfig(precision="fp32")
    assert TrainingConfig.model_validate(t.model_dump(mode="json")) == t


def test_contradicting_flags_are_one_error_line():
    with pytest.raises(UserError, match="--bf16 contradicts precision fp32"):
        cfg_from(["run", "--prompt-data", "env:arithmetic", "--bf16", "--precision", "fp32"])


def test_explicit_precision_is_kept(monkeypatch):
    def no_probe(*a, **k):
        raise AssertionError("an explicit precision needs no probe")

    monkeypatch.setattr(precision, "probe_cpu", no_probe)
    for flag, want in (["--bf16"], True), (["--no-bf16"], False), (["--precision", "bf16"], True):
        cfg = resolve_precision(cfg_from(["run", "--prompt-data", "env:arithmetic", *flag]))
        assert cfg.training.bf16 is want


@pytest.mark.parametrize(
    ("bf16_gflops", "roles", "want"),
    [
        (800.0, (), "bf16"),
        (310.0, (), "bf16"),
        (210.0, (), "fp32"),
        (2.8, (), "fp32"),
        # By role, weighted by a step's shares (0.65 training, 0.35 decode): the AMX Xeon's figures, then AMX off.
        (300.0, (2.09, 0.76), "bf16"),  # 1.29x a step
        (300.0, (1.86, 0.75), "bf16"),  # 1.22x
        (110.0, (0.65, 0.88), "fp32"),  # 0.72x
        (300.0, (3.0, 0.45), "fp32"),  # training 3x, but decode so slow that the step is 0.95x
    ],
)
def test_auto_follows_the_measured_rates(monkeypatch, bf16_gflops, roles, want):
    probe = precision.CpuProbe(200.0, bf16_gflops, 2, *roles)
    monkeypatch.setattr(precision, "probe_cpu", lambda refresh=False: probe)
    cfg = resolve_precision(cfg_from(["run", "--prompt-data", "env:arithmetic"]))
    assert cfg.training.precision == want and cfg.training.bf16 is (want == "bf16")
    assert precision.choose("auto").reason.startswith("auto: ")


def test_probe_is_cached_per_machine_and_isa_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICEWAY_CACHE", str(tmp_path))
    for k in precision.ISA_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    first = precision.probe_cpu()
    assert first.fp32_gflops > 0 and first.bf16_gflops > 0
    files = list((tmp_path / "precision").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["threads"] == first.threads
    files[0].write_text(json.dumps({"fp32_gflops": 1.0, "bf16_gflops": 9.0, "threads": first.threads}))
    assert precision.probe_cpu().speedup == 9.0  # read back, not measured again
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # other kernels: another cache entry
    precision.probe_cpu()
    assert len(list((tmp_path / "precision").glob("*.json"))) == 2


def test_the_choice_is_one_log_line_when_the_flow_starts(monkeypatch, caplog):
    """The CLI resolves `auto` silently (a data mistake found after it must stay the only line); the flow logs
    why, once."""
    monkeypatch.setattr(precision, "probe_cpu", lambda refresh=False: precision.CpuProbe(200.0, 2.8, 2))
    held_lines.drop()  # what other tests of this process held
    cfg = resolve_precision(cfg_from(["run", "--prompt-data", "env:arithmetic"]), announce=False)
    assert cfg.training.precision == "fp32" and not caplog.records
    with caplog.at_level("INFO", logger="sluiceway"):
        resolve_precision(cfg)  # the flow, with the already resolved config
        assert not caplog.records  # held until the run starts (infra/held_lines.py)
        held_lines.flush()  # the flow has its inputs: the run starts (flows/live_run.py `take_prepared`)
    lines = [r.getMessage() for r in caplog.records]
    want = "precision: fp32 (auto: a step's training and decode work runs only 0.01x as fast in bf16 as in fp32"
    assert len(lines) == 1 and lines[0].startswith(want)


def test_the_reason_names_each_role(monkeypatch):
    """Issue 51: the first line says what bf16 does for training and for decode, and what both roles run."""
    probe = precision.CpuProbe(200.0, 420.0, 2, train_speedup=3.1, decode_speedup=1.2)
    monkeypatch.setattr(precision, "probe_cpu", lambda refresh=False: probe)
    choice = precision.choose("auto")
    assert choice.bf16 and "by role training 3.10x, decode 1.20x" in choice.reason
    assert "bf16 for the trainer and the engines" in choice.reason
    old = precision.CpuProbe(200.0, 100.0, 2)  # a cache written before roles were measured
    monkeypatch.setattr(precision, "probe_cpu", lambda refresh=False: old)
    assert "by role" not in precision.choose("auto").reason and old.roles() == ""
