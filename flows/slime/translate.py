"""A slime command line onto a sluiceway config: slime's flags taken off the parsed arguments, the mapped ones
written as config overrides, slime's layout and defaults applied, the architecture flags checked, and the lines the
run logs once about what each became."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluiceway.flows.slime.architecture import hf_config_of
from sluiceway.flows.slime.flag_table import SLIME_FLAGS
from sluiceway.flows.slime.treatments import ARCHITECTURE, IMPLEMENTED, NOT_APPLICABLE, REFUSED
from sluiceway.infra import held_lines
from sluiceway.infra.errors import UserError

DEST = "slime:"  # argparse dest prefix of these flags (no dot: the CLI's config overrides are `group.field`)

WHITENED_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # docs/algorithms.md

# -- the CLI's side -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, listed: bool = False) -> None:
    """slime's flags, accepted by `parser`. Listed in its help only where `listed` (`sluiceway run --help-slime`,
    which `add_help_flag` gives): the run-like commands accept them all, but their --help lists sluiceway's own."""
    section = parser
    if listed:
        section = parser.add_argument_group(
            "slime compatibility",
            "flags of slime's launch scripts that are not sluiceway fields (docs/slime.md): implemented, mapped onto "
            "a field, not applicable here (reported once in the run's log), or model architecture (checked against "
            "--hf-checkpoint's config.json)",
        )
    for flag, spec in SLIME_FLAGS.items():
        kind = spec.kind if spec.kind != ARCHITECTURE else "architecture, checked against config.json"
        kwargs: dict = {"dest": DEST + flag, "default": argparse.SUPPRESS, "help": f"[{kind}] {spec.note}"}
        if not listed:
            kwargs["help"] = argparse.SUPPRESS
        if spec.nargs == 0:
            kwargs["action"] = "store_true"
        else:
            kwargs["nargs"] = None if spec.nargs == 1 else spec.nargs
            kwargs["metavar"] = "VALUE"
        section.add_argument(flag, **kwargs)


class _HelpSlime(argparse.Action):
    """`--help-slime`: print slime's flags and how each is treated, then exit (as --help does)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        listing = argparse.ArgumentParser(prog=parser.prog, usage=parser.usage, add_help=False, allow_abbrev=False,
                                          epilog="A slime launch script's own flags: --from-slime-script SCRIPT.sh "
                                          "(docs/slime.md).")  # fmt: skip
        add_arguments(listing, listed=True)
        hooks = listing.add_argument_group("slime hooks run here", "fields in slime's convention only, not listed by "
                                           "--help (tasks/rollout/slime_plugins/hooks.py)")  # fmt: skip
        for name, f in slime_hook_fields().items():
            hooks.add_argument("--" + name.replace("_", "-"), metavar="PATH", help=f.description)
        listing.print_help()
        parser.exit()


def slime_hook_fields() -> dict:
    """The config fields of slime's hooks (json_schema_extra slime_hook): `run --help-slime` lists them."""
    from sluiceway.flows.config import RunConfig

    out = {}
    for info in RunConfig.model_fields.values():
        for name, f in info.annotation.model_fields.items():
            if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("slime_hook"):
                out[name] = f
    return out


def add_help_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--help-slime", action=_HelpSlime, help="list slime's flags that are not fields (accepted here) and exit"
    )


@dataclass
class Given:
    """The slime flags of one command line, once `take` has applied the mapped ones."""

    flags: dict[str, Any] = field(default_factory=dict)  # flag -> value (True for a switch)
    placement: dict[str, Any] = field(default_factory=dict)  # sluiceway fields not applicable in this layout
    notes: list[str] = field(default_factory=list)  # what a slime command line's fields became here

    def of_kind(self, kind: str) -> dict[str, Any]:
        return {f: v for f, v in self.flags.items() if SLIME_FLAGS[f].kind == kind}


def _shown(value: Any) -> str:
    if value is True:
        return ""
    return " " + " ".join(map(str, value)) if isinstance(value, list) else f" {value}"


def take(args: argparse.Namespace) -> Given:
    """Remove slime's flags from `args`, writing the mapped ones as config overrides (`group.field` keys)."""
    ns = vars(args)
    given = Given({k[len(DEST) :]: ns.pop(k) for k in list(ns) if k.startswith(DEST)})
    for flag, value in given.flags.items():
        spec = SLIME_FLAGS[flag]
        if spec.kind == REFUSED:
            raise UserError(f"{flag}{_shown(value)}: {spec.note}")
        for (group, name), v in (spec.apply(value) if spec.apply else {}).items():
            key = f"{group}.{name}"
            if key in ns and ns[key] != v:
                raise UserError(f"{flag}{_shown(value)} contradicts --{name.replace('_', '-')} {ns[key]}: give one")
            ns[key] = v
    if "--disable-compute-advantages-and-returns" in given.flags and ns.get("algorithm.loss_type") != "sft_loss":
        raise UserError("--disable-compute-advantages-and-returns trains without advantages: only with "
                        "--loss-type sft_loss (slime's SFT scripts); the policy loss needs them")  # fmt: skip
    estimator = ns.get("algorithm.advantage_estimator") or "grpo"
    if "--normalize-advantages" in given.flags and estimator not in WHITENED_ESTIMATORS:
        raise UserError(f"--normalize-advantages with --advantage-estimator {estimator}: whitening its advantages "
                        f"over the batch is not implemented (only {', '.join(WHITENED_ESTIMATORS)}, which always "
                        "whiten)")  # fmt: skip
    if "--lr-warmup-fraction" in given.flags:
        iters = _warmup_iters(ns, given.flags["--lr-warmup-fraction"])
        if "training.lr_warmup_iters" in ns and _n(ns["training.lr_warmup_iters"]) != iters:
            raise UserError(f"--lr-warmup-fraction {given.flags['--lr-warmup-fraction']} ({iters} steps) "
                            f"contradicts --lr-warmup-iters {ns['training.lr_warmup_iters']}: give one")  # fmt: skip
        ns["training.lr_warmup_iters"] = iters
    if given.flags:
        _slime_layout(ns, given, _ray_address(args))
        _slime_defaults(ns, given, _yaml_keys(args))
    save, load = given.flags.get("--save"), given.flags.get("--load")
    if load is not None:
        out = ns.get("storage.output_dir", save)
        if out is None or Path(load).resolve() != Path(out).resolve():
            _load_elsewhere(load, out)
        elif save is None:
            ns["storage.output_dir"] = load
    return given


def _warmup_iters(ns: dict, fraction: str) -> int:
    keys = ("rollout.num_rollout", "rollout.rollout_batch_size", "rollout.n_samples_per_prompt",
            "training.global_batch_size")  # fmt: skip
    values = [_n(ns.get(k), None) for k in keys]
    frac = _n(fraction, None)
    if frac is None or not 0 <= frac <= 1 or any(v is None or v <= 0 for v in values):
        raise UserError(f"--lr-warmup-fraction {fraction}: needs a fraction in [0, 1] and --num-rollout, "
                        "--rollout-batch-size, --n-samples-per-prompt, --global-batch-size (or give "
                        "--lr-warmup-iters)")  # fmt: skip
    rollouts, batch, n, gbs = values
    return round(frac * (rollouts * batch * n // gbs))


def _n(value: Any, default: float | None = 1) -> float | None:
    """A flag's number as argparse left it (a string), None if it is not one (the config then says so)."""
    try:
        return float(value if value is not None else default) if (value, default) != (None, None) else None
    except (TypeError, ValueError):
        return None


def _slime_layout(ns: dict, given: Given, ray: bool) -> None:
    """A slime command line's placement on one machine without a Ray cluster (same results, fewer devices)."""
    if not ray and "rollout.rollout_num_gpus" in ns:  # slime's GPUs for SGLang; the engines here are embedded
        given.placement["--rollout-num-gpus"] = ns.pop("rollout.rollout_num_gpus")
    nodes = _n(ns.get("resources.actor_num_nodes"))
    per_node = _n(ns.get("resources.actor_num_gpus_per_node"))
    if not ray and nodes and nodes > 1 and nodes.is_integer() and per_node and per_node.is_integer():
        # the same trainer ranks (so the same data-parallel size) as processes on this machine
        nodes, per_node = int(nodes), int(per_node)
        ns["resources.actor_num_nodes"], ns["resources.actor_num_gpus_per_node"] = 1, nodes * per_node
        given.notes.append(f"slime --actor-num-nodes {nodes} --actor-num-gpus-per-node {per_node}: "
                           f"{nodes * per_node} trainer processes on this machine (no --ray-address)")  # fmt: skip
    pp = _n(ns.get("resources.pipeline_model_parallel_size"))
    if pp and pp > 1:  # pipeline stages split the layers over devices: the same computation at 1
        given.placement["--pipeline-model-parallel-size"] = ns.pop("resources.pipeline_model_parallel_size")
    cp = _n(given.flags.get("--context-parallel-size"))
    tp, ranks = _n(ns.get("resources.tensor_model_parallel_size")), _n(ns.get("resources.actor_num_gpus_per_node"))
    if all(x and x.is_integer() for x in (pp, cp, tp, ranks)) and pp * cp > 1 and ranks % (tp * pp * cp) == 0:
        # slime's data-parallel size, without its pipeline stages and context-parallel ranks
        pp, cp, tp, ranks = int(pp), int(cp), int(tp), int(ranks)
        ns["resources.actor_num_gpus_per_node"] = ranks // (pp * cp)
        given.notes.append(f"slime's {ranks} trainer GPUs at TP {tp} x PP {pp} x CP {cp}: {ranks // (pp * cp)} "
                           f"trainer processes here (TP {tp}, the same data-parallel size)")  # fmt: skip
    if ns.get("algorithm.use_kl_loss") and _n(ns.get("algorithm.kl_loss_coef"), None) == 0:
        # slime computes the KL against the reference and logs it with weight 0; the loss, so the run, is the same
        ns["algorithm.use_kl_loss"] = False
        given.notes.append(
            "slime --use-kl-loss --kl-loss-coef 0: the KL term has weight 0, so it is left out of "
            "the loss as slime leaves it (no reference model runs; slime would log its value)"
        )


def _yaml_keys(args: argparse.Namespace) -> dict[str, Any]:
    """`group.field` -> value of the YAML config file, if one was given."""
    if not getattr(args, "config_file", None):
        return {}
    from sluiceway.flows.config import load_yaml

    base = load_yaml(args.config_file)
    return {f"{g}.{k}": v for g, fields in base.items() if isinstance(fields, dict) for k, v in fields.items()}


def _ray_address(args: argparse.Namespace) -> bool:
    return bool(vars(args).get("resources.ray_address") or _yaml_keys(args).get("resources.ray_address"))


# slime's defaults (its arguments.py, and Megatron's for the optimizer) where sluiceway's differ and the result
# depends on them: a slime command line that leaves one out means slime's value.
SLIME_DEFAULTS: dict[str, Any] = {
    "rollout.rollout_temperature": 1.0,
    "rollout.n_samples_per_prompt": 1,
    "algorithm.kl_loss_type": "k1",
    "training.weight_decay": 0.01,  # Megatron's
    "training.adam_beta2": 0.999,  # Megatron's
    "training.lr_decay_style": "linear",  # Megatron's, over the run's optimizer steps as slime sets lr_decay_iters
    "training.micro_batch_size": 1,  # Megatron's (no effect on results: gradient accumulation)
    # slime's loss is the mean over samples of each sample's token mean unless --calculate-per-token-loss
    "algorithm.loss_agg_mode": "seq_mean_token_mean",
}


def _slime_defaults(ns: dict, given: Given, yaml_keys: dict) -> None:
    if "--calculate-per-token-loss" in given.flags:
        if ns.get("algorithm.loss_agg_mode", "token_mean") != "token_mean":
            raise UserError(f"--calculate-per-token-loss contradicts --loss-agg-mode {ns['algorithm.loss_agg_mode']}")
        ns["algorithm.loss_agg_mode"] = "token_mean"
    applied = []
    for key, value in SLIME_DEFAULTS.items():
        if key not in ns and key not in yaml_keys:
            ns[key] = value
            applied.append(f"--{key.split('.', 1)[1].replace('_', '-')} {value}")
    if applied:
        given.notes.append("slime's defaults for what this slime command line leaves out: " + ", ".join(applied))
    if "--rollout-shuffle" not in given.flags:
        given.notes.append("slime reads the prompts in file order without --rollout-shuffle; sluiceway shuffles "
                           "them each epoch (seeded by --seed), as slime does with it")  # fmt: skip
    undropped = [f for f in ("--attention-dropout", "--hidden-dropout") if f not in given.flags]
    if undropped:
        given.notes.append(f"slime leaves {' and '.join(undropped)} at Megatron's default 0.1 here; sluiceway "
                           "trains without dropout (deterministic log-probs): give them as 0.0, as slime's "
                           "scripts/ do, to say so")  # fmt: skip


def _load_elsewhere(load: str, out: str | None) -> None:
    """--load not the run directory: fine only while it holds nothing to continue from (slime's first run)."""
    p = Path(load)
    if not p.exists() or (p.is_dir() and not any(p.iterdir())):
        return
    from sluiceway.flows.resume import RECORD

    if (p / RECORD).is_file():
        raise UserError(f"--load {load} holds a sluiceway run: continue it with `sluiceway resume {load}`")
    raise UserError(f"--load {load}: sluiceway continues only its own runs (from the run directory, --save/"
                    f"--output-dir{' ' + out if out else ''}); to start from converted Megatron weights, convert "
                    "them to HF (slime's tools/convert_torch_dist_to_hf.py) and pass --hf-checkpoint")  # fmt: skip


def check_architecture(given: Given, hf_checkpoint: str) -> None:
    """One error line for the first architecture flag the checkpoint's config.json contradicts."""
    arch = given.of_kind(ARCHITECTURE)
    if not arch:
        return
    cfg = hf_config_of(hf_checkpoint)
    for flag, value in arch.items():
        ok, says = SLIME_FLAGS[flag].check(cfg, value)
        if not ok:
            raise UserError(f"{flag}{_shown(value)} contradicts --hf-checkpoint {hf_checkpoint}: its config.json "
                            f"has {says}")  # fmt: skip


def report(given: Given, cfg) -> list[str]:
    """The lines the run logs once: flags not applicable here, and what the mapped ones became."""
    hf_checkpoint = cfg.training.hf_checkpoint
    lines = []
    na = {**given.of_kind(NOT_APPLICABLE), **given.placement}
    if cfg.rollout.sglang_server_args and cfg.rollout.rollout_engine != "sglang":
        na["--sglang-*"] = cfg.rollout.sglang_server_args  # SGLang's own settings; the engines here are embedded
    if given.flags.get("--update-weight-transport") == "nccl":
        na["--update-weight-transport"] = "nccl"
    if na:
        lines.append("slime flags not applicable on this device (accepted, no effect on results): "
                     + ", ".join(f"{f}{_shown(v)}" for f, v in na.items()))  # fmt: skip
    lines.extend(given.notes)
    if "--ref-load" in given.flags:
        lines.append(f"slime --ref-load {given.flags['--ref-load']}: the reference model is --hf-checkpoint "
                     f"{hf_checkpoint}")  # fmt: skip
    arch = given.of_kind(ARCHITECTURE)
    if arch:
        lines.append(f"slime architecture flags agree with {hf_checkpoint}'s config.json: " + ", ".join(arch))
    held_lines.replace("slime", lines)  # logged once the run starts (infra/held_lines.py)
    return lines


def classify(flag: str) -> str | None:
    """How sluiceway treats one of slime's flags: implemented (a config field of that name, or handled here),
    mapped, not applicable, architecture; None: unknown."""
    from sluiceway.flows.config import field_flags

    if flag in SLIME_FLAGS:
        return SLIME_FLAGS[flag].kind
    if flag in field_flags() or flag.startswith("--sglang-"):
        return IMPLEMENTED
    return None


# sluiceway fields whose value may be one of slime's functions (its dotted path): run as slime calls them
_PORT = {
    "--custom-generate-function-path": "a sluiceway field; slime's generate (args, sample, sampling_params) runs as it "
    "is (tasks/rollout/slime_plugins/, docs/slime.md)",
    "--custom-rm-path": "a sluiceway field; slime's reward function (args, sample), or (args, samples) with "
    "--group-rm, runs as it is (docs/slime.md)",
    "--dynamic-sampling-filter-path": "a sluiceway field; slime's filter (args, group) runs as it is (docs/slime.md)",
}


def describe(argv: list[str]) -> list[str]:
    """One line per flag of a slime command line: how it is treated (what --from-slime-script prints)."""
    out = []
    for i, word in enumerate(argv):
        if not word.startswith("--"):
            continue
        values = []
        for w in argv[i + 1 :]:
            if w.startswith("--"):
                break
            values.append(w)
        kind = classify(word)
        spec = SLIME_FLAGS.get(word)
        if word in _PORT and values and ":" not in values[0]:
            how = _PORT[word]
        elif word.startswith("--sglang-"):
            how = "passed to SGLang engines (--rollout-engine sglang); the embedded engine's own settings otherwise"
        elif spec is None:
            how = "a sluiceway field of the same name" if kind else "unknown to sluiceway"
        elif spec.kind == ARCHITECTURE:
            how = f"checked against config.json: {spec.note}"
        else:
            how = spec.note
        shown = ["***"] if word == "--wandb-key" else values  # a secret is never printed
        out.append(f"  {' '.join([word, *shown])}  ->  {kind or 'unknown'}: {how}")
    return out
