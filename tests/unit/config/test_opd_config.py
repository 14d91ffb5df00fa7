"""On-policy distillation's flags (slime's names) and the contradictions refused before anything starts."""

import json

import pytest

from sluiceway.flows.cli import field_flags, make_parser, resolve_config
from sluiceway.flows.preflight import check_teacher
from sluiceway.infra.errors import UserError

BASE = ["run", "--prompt-data", "env:arithmetic"]


def cfg_from(*argv, command=BASE):
    return resolve_config(make_parser().parse_args([*command, *argv]))


def test_slime_flags_exist():
    flags = field_flags()
    assert all(f in flags for f in ("--use-opd", "--opd-type", "--opd-kl-coef", "--opd-teacher-load"))
    a = cfg_from("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "tiny-llama").algorithm
    assert (a.use_opd, a.opd_type, a.opd_kl_coef, a.opd_teacher_load) == (True, "megatron", 1.0, "tiny-llama")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use-opd"], "use_opd needs opd_type"),
        (["--opd-type", "sglang"], "opd_type set(s) up on-policy distillation: also set use_opd"),
        (["--opd-teacher-url", "http://h:1"], "opd_teacher_url set(s) up on-policy distillation"),
        (["--use-opd", "--opd-type", "megatron"], "opd_type megatron needs opd_teacher_load"),
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "x", "--opd-teacher-url", "http://h:1"],
         "opd_type megatron loads the teacher into the trainer"),
        (["--use-opd", "--opd-type", "sglang"], "opd_type sglang needs a teacher"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "x", "--opd-teacher-url", "http://h:1"],
         "not both"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "h:1"], "is not http://HOST:PORT"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://h:1", "--opd-kl-coef", "-1"],
         "opd_kl_coef"),
    ],
)  # fmt: skip
def test_contradictions_are_one_line(argv, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        cfg_from(*argv)
    assert "\n" not in str(e.value)


def test_replay_needs_no_teacher():
    # A replay reads the stored teacher log-probs: no engine and no URL.
    replay = ["replay", "--replay-run-id", "stored"]
    assert cfg_from("--use-opd", "--opd-type", "sglang", command=replay).algorithm.use_opd


def test_teacher_vocabulary_must_be_the_students(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"vocab_size": 50}))
    cfg = cfg_from("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(teacher))
    with pytest.raises(UserError, match=r"--opd-teacher-load .*teacher: a vocabulary of 50 tokens, the student's"):
        check_teacher(cfg, {"vocab_size": 1024})
    check_teacher(cfg, {"vocab_size": 50})  # the same vocabulary: fine
    missing = cfg_from("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path / "nope"))
    with pytest.raises(UserError, match="--opd-teacher-load .*nope: no such model directory"):
        check_teacher(missing, {"vocab_size": 50})
