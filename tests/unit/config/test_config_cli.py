"""Config loading, flag overrides, invariants and their messages, in process (the real `sluiceway` command's
one-line errors: tests/integration/test_config_cli_errors.py)."""

from pathlib import Path

import pytest
import yaml
from paths import ROOT

from sluiceway.flows.cli import field_flags, make_parser, resolve_config
from sluiceway.infra.errors import UserError

SLIME_FLAGS = (
    "--prompt-data --input-key --label-key --metadata-key --apply-chat-template --rollout-batch-size "
    "--n-samples-per-prompt --global-batch-size --num-steps-per-rollout --num-rollout --rollout-max-response-len "
    "--rollout-temperature --rollout-top-p --advantage-estimator --use-kl-loss --kl-loss-coef --eps-clip --lr "
    "--hf-checkpoint --rm-type --custom-rm-path --save-interval --eval-interval --seed --output-dir --storage-uri"
).split()


def cfg_from(argv):
    return resolve_config(make_parser().parse_args(argv))


def test_every_slime_flag_exists():
    flags = field_flags()
    assert [f for f in SLIME_FLAGS if f not in flags] == []


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        yaml.safe_dump(
            {"data": {"prompt_data": "env:arithmetic"}, "rollout": {"num_rollout": 3}, "training": {"lr": 1e-5}}
        )
    )
    cfg = cfg_from(["run", str(f), "--lr", "2e-6", "--apply-chat-template", "--rollout-temperature", "0.9"])
    assert cfg.rollout.num_rollout == 3
    assert cfg.training.lr == 2e-6
    assert cfg.data.apply_chat_template is True
    assert cfg.rollout.rollout_temperature == 0.9
    assert cfg.run_id == Path(cfg.storage.output_dir).resolve().name


def test_batch_invariant_is_checked():
    with pytest.raises(UserError, match=r"rollout_batch_size x n_samples_per_prompt \(3 x 8 = 24\)"):
        cfg_from(["run", "--prompt-data", "env:arithmetic", "--rollout-batch-size", "3"])


def test_unknown_yaml_key_names_the_field(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  rollout_batch_sise: 4\n")
    with pytest.raises(UserError, match="rollout.rollout_batch_sise"):
        cfg_from(["run", str(f), "--prompt-data", "env:arithmetic"])


def test_bad_yaml_names_the_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  num_rollout: 3\n bad: [\n")
    with pytest.raises(UserError, match=r"run.yaml:\d+: invalid YAML"):
        cfg_from(["run", str(f)])


def test_wrong_type_names_the_flag():
    with pytest.raises(UserError, match=r"--rollout-temperature"):
        cfg_from(["run", "--prompt-data", "env:arithmetic", "--rollout-temperature", "warm"])


def test_configuration_reference_is_current():
    from sluiceway.flows.config_docs import render_markdown

    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == render_markdown(), "regenerate: python -m sluiceway.flows.config_docs"


def test_embedded_engines_share_the_cores():
    import os

    from sluiceway.flows.engines import fleet_settings
    from sluiceway.infra.engine_fleet import embedded_engine_threads

    def threads(argv: list[str]) -> int:
        return embedded_engine_threads(fleet_settings(cfg_from(argv)))

    cores = len(os.sched_getaffinity(0))
    base = ["run", "--prompt-data", "env:arithmetic"]
    assert threads(base) == cores
    assert threads([*base, "--rollout-num-engines", "2"]) == max(1, cores // 2)
    assert threads([*base, "--num-threads", "8", "--rollout-num-engines", "2"]) == 4
    assert threads([*base, "--engine-num-threads", "3"]) == 3


@pytest.mark.parametrize("source", ["env:arithmetic", "verifiers:sw_add_v1", "openenv:http://127.0.0.1:9"])
def test_sft_refuses_every_environment_source(source):
    """Issue 53 point 1: `sluiceway sft` had refused only env: sources; a verifiers: or openenv: source passed the
    config, and flows/sft.py read it as a file."""
    from sluiceway.flows.cli.parser import configured

    kind = source.split(":")[0]
    with pytest.raises(Exception, match=rf"SFT needs a JSONL or Parquet data file .*an environment \({kind}:\)"):
        configured(make_parser().parse_args(["sft", "--prompt-data", source]))
