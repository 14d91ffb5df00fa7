"""The SGLang launcher's command line (SGLang itself only runs on GPU machines)."""

import pytest

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.infra.sglang_launcher import sglang_server_command, split_sglang_args


def test_sglang_flags_are_passed_through():
    rest, sglang = split_sglang_args(
        [
            "run",
            "--lr",
            "1e-6",
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-enable-memory-saver",
            "--sglang-context-length=4096",
            "--seed",
            "1",
        ]
    )
    assert rest == ["run", "--lr", "1e-6", "--seed", "1"]
    assert sglang == ["--mem-fraction-static", "0.7", "--enable-memory-saver", "--context-length", "4096"]


def test_server_command():
    cmd = sglang_server_command(
        "/models/m",
        "127.0.0.1",
        31000,
        tp_size=2,
        dtype="bfloat16",
        seed=3,
        extra_args=["--mem-fraction-static", "0.7"],
    )
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == [
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--dtype",
        "bfloat16",
        "--random-seed",
        "3",
        "--mem-fraction-static",
        "0.7",
    ]


def test_config_carries_sglang_args():
    argv = [
        "run",
        "--prompt-data",
        "env:arithmetic",
        "--rollout-engine",
        "sglang",
        "--rollout-num-gpus-per-engine",
        "2",
        "--sglang-mem-fraction-static",
        "0.7",
    ]
    rest, sglang = split_sglang_args(argv)
    args = make_parser().parse_args(rest)
    args.__dict__["rollout.sglang_server_args"] = sglang
    cfg = resolve_config(args)
    assert cfg.rollout.rollout_engine == "sglang" and cfg.rollout.rollout_num_gpus_per_engine == 2
    assert cfg.rollout.sglang_server_args == ["--mem-fraction-static", "0.7"]


@pytest.mark.parametrize("flag", ["--rollout-engine"])
def test_unknown_engine_kind_is_refused(flag):
    from sluiceway.infra.errors import UserError

    with pytest.raises(UserError):
        make_parser().parse_args(["run", flag, "vllm"])
