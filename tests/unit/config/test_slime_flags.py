"""slime's launch-script flags through the real `sluiceway` parser and config (issue 23): every flag of six of
slime's scripts is implemented, mapped, not applicable here or a model-architecture flag that agrees with the
checkpoint; none is rejected. Nothing runs: `sluiceway config` resolves the config and prints it."""

import os
import shlex
from pathlib import Path

import pytest

from sluiceway.flows import cli, slime
from sluiceway.flows.slime import docs
from sluiceway.flows.slime.script import read_slime_script
from sluiceway.infra import held_lines
from sluiceway.infra.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "slime_flags"
SLIME = DATA / "slime"
CONFIGS = DATA / "hf_configs"

# flag list -> (the slime script it was read from, the HF checkpoint it names, as a config.json here)
SCRIPTS = {
    "run-qwen3-4B": ("scripts/run-qwen3-4B.sh", "Qwen3-4B"),
    "run-glm4-9B": ("scripts/run-glm4-9B.sh", "GLM-Z1-9B-0414"),
    "run-qwen3-30B-A3B": ("scripts/run-qwen3-30B-A3B.sh", "Qwen3-30B-A3B"),
    "run-qwen2.5-0.5B-fully_async": ("examples/fully_async/run-qwen2.5-0.5B-fully_async.sh", "Qwen2.5-0.5B-Instruct"),
    "run_qwen2.5_3B": ("examples/search-r1/run_qwen2.5_3B.sh", "Qwen2.5-3B"),
    "run-glm4.7-30B-A3B-delta": ("examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh", "GLM-4.7-Flash"),
}
# scripts/models/qwen3-30B-A3B.sh builds this with a loop and printf -v, which the reader does not run
ENV = {"MOE_LAYER_FREQ": "[" + ",".join(["1"] * 48) + "]"}
KINDS = {slime.IMPLEMENTED, slime.MAPPED, slime.NOT_APPLICABLE, slime.ARCHITECTURE}


def flag_lines(name: str) -> list[list[str]]:
    lines = (DATA / f"{name}.flags").read_text().splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.startswith("#")]


def run_config(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["config", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_flag_lists_are_the_scripts_flags(name):
    """The copied lists are what slime's scripts pass to train.py (the reader splices arrays and sourced files)."""
    script, _ = SCRIPTS[name]
    words = read_slime_script(SLIME / script, env=ENV).argv
    assert words == [w for line in flag_lines(name) for w in line]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_slimes_scripts_is_accepted(name, capsys):
    lines = flag_lines(name)
    for line in lines:
        assert slime.classify(line[0]) in KINDS, f"{line[0]} of {name} is unknown"
    words = [w for line in lines for w in line]
    rc, err = run_config([*words, "--hf-checkpoint", str(CONFIGS / SCRIPTS[name][1])], capsys)
    assert rc == 0, err
    assert err == ""
    report = "\n".join(held_lines.held("slime"))
    flags = {line[0] for line in lines}
    for flag in flags:
        kind = slime.classify(flag)
        if kind == slime.NOT_APPLICABLE:  # reported, once, in the line the run logs
            (na_line,) = [x for x in held_lines.held("slime") if "not applicable" in x]
            assert flag in na_line
        elif kind == slime.ARCHITECTURE:
            assert flag in report
    assert sum("not applicable" in x for x in held_lines.held("slime")) <= 1


def test_counts_over_the_six_scripts():
    """What the issue counted as rejected (128 of 318 run flags, all 130 architecture flags) is accepted now."""
    uses = [line[0] for name in SCRIPTS for line in flag_lines(name)]
    kinds = [slime.classify(f) for f in uses]
    assert None not in kinds
    distinct = {f: slime.classify(f) for f in uses}
    by_kind = {k: sum(1 for v in distinct.values() if v == k) for k in KINDS}
    assert by_kind[slime.ARCHITECTURE] >= 40 and by_kind[slime.NOT_APPLICABLE] >= 20


def test_mapped_flags_become_fields(tmp_path, capsys):
    import yaml

    capsys.readouterr()
    rc = cli.main(["config", "--prompt-data", "env:arithmetic", "--n-samples-per-prompt", "8", "--save",
                   str(tmp_path / "r"), "--load",
                   str(tmp_path / "r"), "--update-weight-disk-dir", str(tmp_path / "w"), "--update-weight-mode",
                   "delta", "--rollout-function-path",
                   "slime.rollout.fully_async_rollout.generate_rollout_fully_async"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["storage"]["output_dir"] == str(tmp_path / "r")
    assert cfg["sync"]["weights_uri"] == str(tmp_path / "w")
    assert cfg["rollout"]["mode"] == "fully-async"
    args = cli.make_parser().parse_args(["run", "--save", "d", "--colocate"])
    given = slime.take(args)
    assert vars(args)["storage.output_dir"] == "d"
    assert given.of_kind(slime.NOT_APPLICABLE) == {"--colocate": True}


def test_a_slime_command_line_gets_slimes_defaults(capsys):
    """slime's delta example leaves out --rollout-temperature, --weight-decay, --adam-beta2 and the dropouts:
    slime's (and Megatron's) defaults apply, not sluiceway's, and the dropout it cannot honour is logged."""
    import yaml

    words = [w for line in flag_lines("run-glm4.7-30B-A3B-delta") for w in line]
    capsys.readouterr()
    assert cli.main(["config", *words, "--hf-checkpoint", str(CONFIGS / "GLM-4.7-Flash")]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rollout"]["rollout_temperature"] == 1.0
    assert cfg["training"]["weight_decay"] == 0.01 and cfg["training"]["adam_beta2"] == 0.999
    assert cfg["algorithm"]["loss_agg_mode"] == "seq_mean_token_mean"  # slime's mean of per-sample means
    assert cfg["training"]["lr_decay_style"] == "constant"  # given by the script
    assert cfg["resources"]["actor_num_gpus_per_node"] == 4  # 16 GPUs at TP 2 x PP 2 x CP 2: DP 2 at TP 2
    assert cfg["sync"]["update_weight_mode"] == "delta"
    assert any("Megatron's default 0.1" in line for line in held_lines.held("slime"))
    capsys.readouterr()
    assert cli.main(["config", *words, "--calculate-per-token-loss", "--rollout-temperature", "0.7",
                     "--hf-checkpoint", str(CONFIGS / "GLM-4.7-Flash")]) == 0  # fmt: skip
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algorithm"]["loss_agg_mode"] == "token_mean" and cfg["rollout"]["rollout_temperature"] == 0.7


def test_hidden_size_contradiction_is_one_line(capsys):
    words = [w for line in flag_lines("run-qwen3-4B") for w in line]
    words[words.index("--hidden-size") + 1] = "4096"
    checkpoint = str(CONFIGS / "Qwen3-4B")
    rc, err = run_config([*words, "--hf-checkpoint", checkpoint], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        err
        == f"error: --hidden-size 4096 contradicts --hf-checkpoint {checkpoint}: its config.json has hidden_size 2560\n"
    )


def test_architecture_of_another_model_is_refused(capsys):
    """slime's Qwen3-30B-A3B model flags against a dense checkpoint: the first contradiction, one line."""
    words = [w for line in flag_lines("run-qwen3-30B-A3B") for w in line]
    rc, err = run_config([*words, "--hf-checkpoint", str(CONFIGS / "Qwen3-4B")], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "contradicts" in err and "Qwen3-4B" in err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--optimizer", "sgd"], "--optimizer sgd"),
        (["--hidden-dropout", "0.1"], "hidden dropout"),
        (["--moe-aux-loss-coeff", "0.01"], "auxiliary loss"),
        (["--rollout-function-path", "my.rollout.fn"], "--custom-generate-function-path"),
        (["--enable-mtp-training"], "multi-token-prediction"),
        (["--rollout-stop-token-ids", "151329", "151336"], "stop tokens"),
    ],
)
def test_settings_that_change_results_and_are_not_implemented_are_refused(flags, needle, capsys):
    rc, err = run_config(["--hf-checkpoint", "tiny-llama", *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_load_elsewhere_holding_a_checkpoint_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "megatron"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")
    rc, err = run_config(["--load", str(ckpt), "--save", str(tmp_path / "run")], capsys)
    assert rc == 2 and "convert_torch_dist_to_hf" in err and err.count("\n") == 1
    empty = ["--load", str(tmp_path / "e"), "--save", str(tmp_path / "r"), "--prompt-data", "env:x"]
    rc, err = run_config([*empty, "--n-samples-per-prompt", "8"], capsys)
    assert rc == 0, err  # nothing to continue from: slime starts from --ref-load, sluiceway from --hf-checkpoint


def test_help_says_how_slime_flags_are_treated(capsys):
    with pytest.raises(SystemExit):
        cli.make_parser().parse_args(["run", "--help-slime"])  # `run --help` lists sluiceway's own flags
    out = capsys.readouterr().out
    assert "slime compatibility" in out and "--from-slime-script" in out
    assert "[mapped] onto --output-dir" in out and "[not applicable]" in out


def test_from_slime_script_reads_and_prints(capsys, monkeypatch):
    monkeypatch.setenv("MOE_LAYER_FREQ", ENV["MOE_LAYER_FREQ"])
    script = SLIME / "scripts" / "run-qwen3-4B.sh"
    rc, err = run_config(["--from-slime-script", str(script), "--hf-checkpoint", str(CONFIGS / "Qwen3-4B")], capsys)
    assert rc == 0, err
    assert "sourced:" in err and "models/qwen3-4B.sh" in err
    assert "--attention-backend flash  ->  not applicable" in err
    assert "--save /root/Qwen3-4B_slime/  ->  mapped" in err


def test_unreadable_script_value_is_one_line_naming_file_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOE_LAYER_FREQ", raising=False)
    rc, err = run_config(["--from-slime-script", str(SLIME / "scripts" / "run-qwen3-30B-A3B.sh")], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "qwen3-30B-A3B.sh:16" in err and "MOE_LAYER_FREQ" in err


def test_script_reader(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.sh").write_text("N=4\nMODEL_ARGS=(\n   --num-layers $((N * 2))  # eight\n)\n")
    (tmp_path / "run.sh").write_text(
        'SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"\n'
        'source "${SCRIPT_DIR}/models/m.sh"\n'
        "DIR=${DIR:-/data}\n"
        'A_ARGS=(\n   # a comment\n   --prompt-data "${DIR}/x.jsonl"\n   --sglang-cuda-graph-bs $(seq 1 2 5)\n'
        "   --input-key 'my key'\n)\n"
        'python3 train.py \\\n   --colocate \\\n   ${MODEL_ARGS[@]} \\\n   "${A_ARGS[@]}"\n'
    )
    s = read_slime_script(tmp_path / "run.sh", env={})
    assert s.argv == ["--colocate", "--num-layers", "8", "--prompt-data", "/data/x.jsonl",
                      "--sglang-cuda-graph-bs", "1", "3", "5", "--input-key", "my key"]  # fmt: skip
    assert read_slime_script(tmp_path / "run.sh", env={"DIR": "/d"}).argv[4] == "/d/x.jsonl"
    (tmp_path / "bad.sh").write_text("X=(\n --a $(nvidia-smi -L)\n)\n")
    with pytest.raises(UserError, match=r"bad.sh:1: cannot evaluate the command substitution"):
        read_slime_script(tmp_path / "bad.sh", env={})


def test_docs_are_current():
    doc = ROOT / "docs" / "slime.md"
    assert doc.read_text() == docs.render_markdown(), "regenerate: python -m sluiceway.flows.slime.docs"


def test_rm_type_deepscaler():
    """slime's scripts score with --rm-type deepscaler: the answer after </think>, none without it."""
    from sluiceway.tasks.reward.scorer_registry import get_scorer

    score = get_scorer("deepscaler", None)
    assert score("<think>2 + 3 = 6?</think> so \\boxed{5}", "5", {})[0] == 1.0
    assert score("<think>...</think> \\boxed{6}", "5", {})[0] == 0.0
    assert score("\\boxed{5}", "5", {})[0] == 0.0  # no </think>: slime scores 0


def test_warmup_fraction_wandb_key_and_sft_switch(capsys, monkeypatch):
    import yaml

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    base = [
        "--prompt-data",
        "env:x",
        "--num-rollout",
        "10",
        "--rollout-batch-size",
        "8",
        "--lr-decay-style",
        "constant",
        "--n-samples-per-prompt",
        "4",
        "--global-batch-size",
        "16",
        "--num-steps-per-rollout",
        "2",
    ]
    # fmt: skip
    capsys.readouterr()
    assert cli.main(["config", *base, "--lr-warmup-fraction", "0.1", "--wandb-key", "secret-key"]) == 0
    out, _ = capsys.readouterr()
    assert yaml.safe_load(out)["training"]["lr_warmup_iters"] == 2  # 0.1 x (10 x 8 x 4 / 16 = 20 steps)
    assert "secret-key" not in out and os.environ.get("WANDB_API_KEY") == "secret-key"
    assert "***" in "\n".join(slime.describe(["--wandb-key", "secret-key"]))
    assert "secret-key" not in "\n".join(slime.describe(["--wandb-key", "secret-key"]))
    rc, err = run_config([*base, "--disable-compute-advantages-and-returns"], capsys)
    assert rc == 2 and "--loss-type sft_loss" in err


def test_slime_custom_functions_run_as_they_are():
    """search-r1's --custom-generate-function-path names slime's function by slime's dotted path: --from-slime-script
    says it runs as it is (issue 41), and one that does not import is one line saying where it was looked for."""
    from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin

    words = [w for line in flag_lines("run_qwen2.5_3B") for w in line]
    lines = slime.describe(words)
    (gen,) = [x for x in lines if x.strip().startswith("--custom-generate-function-path")]
    assert "runs as it is" in gen and "slime's generate" in gen
    with pytest.raises(UserError, match="cannot import generate_with_search .*--from-slime-script"):
        load_plugin("generate_with_search.reward_func", "--custom-rm-path")


def test_slime_normalisation_flags_and_no_prefix_matching():
    """Found while writing docs/algorithms.md: argparse's prefix matching read slime's --normalize-advantages as
    --normalize-advantages-by-std. Now each of slime's three normalisation flags has its own treatment."""
    main = cli.main
    assert main(["config", "--prompt-data", "env:arithmetic", "--normalize-advantages"]) == 2  # grpo: refused
    assert main(["config", "--prompt-data", "env:arithmetic", "--disable-rewards-normalization"]) == 2
    assert main(["config", "--prompt-data", "env:arithmetic", "--normalize-advantages-by"]) == 2  # no prefixes
    args = cli.make_parser().parse_args(["run", "--disable-grpo-std-normalization"])
    slime.take(args)
    assert vars(args)["algorithm.normalize_advantages_by_std"] is False
