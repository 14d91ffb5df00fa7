"""The memory plan counts an on-policy distillation teacher in the trainer (--opd-type megatron) at its own size."""

from __future__ import annotations

from paths import ROOT

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.preflight import plan_for_config
from sluiceway.tasks.train.memory_model import GIB

CONFIGS = ROOT / "tests" / "data" / "hf_configs"


def test_megatron_teacher_weights_are_counted_per_tensor_parallel_rank():
    base = ["plan", "--hf-checkpoint", str(CONFIGS / "llama-3.1-8b"), "--device", "cuda", "--precision", "bf16",
            "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "8", "--micro-batch-size", "1",
            "--available-gib", "80"]  # fmt: skip
    teacher = str(CONFIGS / "qwen2.5-32b")  # the plan counts bytes; the vocabulary check is preflight's
    opd = ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher]
    plain = plan_for_config(resolve_config(make_parser().parse_args(base)), available_gib=80)
    with_teacher = plan_for_config(resolve_config(make_parser().parse_args([*base, *opd])), available_gib=80)
    item = next(i for i in with_teacher.static if i.label == "OPD teacher (weights)")
    # Qwen2.5-32B in bf16 over TP 8: about 32.8e9 x 2 B / 8 = 7.6 GiB on each rank.
    assert abs(item.bytes / GIB - 7.6) < 0.3, item
    assert with_teacher.rank_peak - plain.rank_peak == item.bytes
    # An sglang teacher is an engine elsewhere: nothing in the trainer.
    sglang = ["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://teacher:30000"]
    assert plan_for_config(resolve_config(make_parser().parse_args([*base, *sglang])), available_gib=80).rank_peak \
        == plain.rank_peak
