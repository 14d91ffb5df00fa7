"""The `args` slime's plugins receive: an argparse.Namespace with slime's attribute names, built from the run config.

slime hands every hook its parsed command line; plugins read it freely (`args.sglang_router_ip`,
`args.rollout_max_context_len`, `args.hf_checkpoint`, `args.reward_key`, ...). Here:

- every config field is an attribute of its own name: sluiceway's fields carry slime's names where slime has the
  setting (`--rollout-batch-size` is `rollout_batch_size` in both);
- every flag of slime's that is not a field (flows/slime/flag_table.py) is an attribute too: the mapped ones
  with the value of the field they map onto (`save` is the output directory, `ref_load` the HF checkpoint),
  the rest at slime's default (None, False for a switch), so a plugin's `args.X` never raises AttributeError;
- what slime computes at start and plugins read: the router's address (`sglang_router_ip`/`sglang_router_port`,
  set from the run's router once the rollout knows it: `set_router`), `hf_checkpoint` as the model's LOCAL
  directory (plugins call AutoTokenizer.from_pretrained on it), `rollout_num_engines`,
  `sglang_server_concurrency`, `rollout_seed`, `eval_reward_key`, and slime's values for settings sluiceway does
  not have (`rollout_top_k` -1, `rollout_stop` None, ...);
- slime's `--custom-config-path` YAML last: each top-level key set on `args` as YAML gives it (slime_validate_args).

One Namespace per run: slime has one `args`, and plugins that set attributes on it (slime's multi_agent example
does) must see them in every hook. The run's set-up builds it once (flows/runtime.py `prepare`, flows/eval.py) and
hands the same object to the generate, reward and filter builders.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from sluiceway.infra.errors import UserError

# slime's defaults (its arguments.py at 624b824a) for what plugins read and sluiceway has no field for
SLIME_DEFAULTS = {
    "rollout_top_k": -1,
    "rollout_stop": None,
    "rollout_stop_token_ids": None,
    "rollout_skip_special_tokens": False,
    "sglang_server_concurrency": 512,
    "sglang_dp_size": None,
    "sglang_router_ip": None,
    "sglang_router_port": None,
    "sglang_model_routers": None,
    "router_policy": None,
    "use_distributed_post": False,
    "use_rollout_routing_replay": False,
    "sglang_enable_deterministic_inference": False,
    "sglang_speculative_algorithm": None,
    "rollout_global_dataset": True,
    "ci_test": False,
    "debug_rollout_only": False,
    "debug_train_only": False,
    "rewards_normalization": True,
    "eval_max_context_len": None,
    "context_parallel_size": 1,
    "rollout_sample_hook_path": [],
}


def slime_args(cfg, hf_dir: str | Path, slime_flags: Mapping[str, bool] | None = None) -> argparse.Namespace:
    """A fresh Namespace for `cfg` (a RunConfig) whose model is at `hf_dir`. `slime_flags`: slime's flags that
    are not config fields -> whether each is a switch (flows/slime/flag_table.py `slime_flag_switches`; tasks/
    never import flows/), each an attribute at slime's default."""
    ns = argparse.Namespace()
    for flag, switch in (slime_flags or {}).items():  # first: a field of the same name (none should be) wins below
        setattr(ns, attr_name(flag), False if switch else None)
    for key, value in SLIME_DEFAULTS.items():
        setattr(ns, key, list(value) if isinstance(value, list) else value)
    for part in type(cfg).model_fields:
        group = getattr(cfg, part)
        for name in type(group).model_fields:
            setattr(ns, name, getattr(group, name))
    r, rw, tr = cfg.rollout, cfg.reward, cfg.training
    engines = r.rollout_num_engines + len(r.rollout_external_engine_addrs or [])
    ns.hf_checkpoint = str(Path(hf_dir).resolve())
    ns.ref_load = ns.hf_checkpoint
    ns.save = ns.load = cfg.storage.output_dir
    ns.rollout_num_engines = max(1, engines)  # init_http_client needs at least one engine behind the router
    ns.rollout_num_gpus = r.rollout_num_gpus or ns.rollout_num_engines * r.rollout_num_gpus_per_engine
    ns.sglang_server_concurrency = r.engine_max_running_requests
    ns.rollout_seed = tr.seed
    ns.eval_reward_key = rw.reward_key
    ns.eval_max_context_len = r.rollout_max_context_len
    ns.calculate_per_token_loss = cfg.algorithm.loss_agg_mode == "token_mean"
    ns.grpo_std_normalization = cfg.algorithm.normalize_advantages_by_std
    ns.use_dynamic_batch_size = getattr(tr, "max_tokens_per_gpu", None) is not None
    ns.update_weight_disk_dir = cfg.weights_uri
    if r.custom_config_path:
        apply_custom_config(ns, r.custom_config_path)
    return ns


def attr_name(flag: str) -> str:
    """slime's attribute of a flag: `--rollout-max-context-len` -> `rollout_max_context_len`."""
    return flag.lstrip("-").replace("-", "_")


def apply_custom_config(ns: argparse.Namespace, path: str) -> None:
    """slime's --custom-config-path: every top-level key of the YAML set on `ns` (slime's arguments.py:2013-2019)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"--custom-config-path {path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"--custom-config-path {path}: expected a mapping of argument names to values")
    for key, value in data.items():
        setattr(ns, str(key), value)


def set_router(ns: argparse.Namespace, router_url: str) -> None:
    """Point `ns` at the router (or engine) plugins post `/generate` to: slime's sglang_router_ip/port."""
    parts = urlsplit(router_url)
    host = parts.hostname or "127.0.0.1"
    ns.sglang_router_ip = f"[{host}]" if ":" in host else host  # slime wraps IPv6 in brackets
    ns.sglang_router_port = parts.port or (443 if parts.scheme == "https" else 80)


def router_of(ns: argparse.Namespace) -> str | None:
    if ns.sglang_router_ip is None:
        return None
    return f"http://{ns.sglang_router_ip}:{ns.sglang_router_port}"
