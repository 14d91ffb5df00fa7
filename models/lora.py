"""LoRA adapters on a megatron-core GPTModel, laid out as peft lays them out on the HF model.

Each adapted HF projection (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) gets peft's pair
A [r, in] and B [out, r]; its output gains  scale * B @ A @ dropout(x),  scale = alpha / r. megatron fuses q/k/v
into `linear_qkv` and gate/up into `linear_fc1`, so a forward hook on each fused linear adds the adapted pieces'
outputs where they sit in the fused layout (q/k/v interleaved by query group, gate then up). The base model is
not touched: its state dict keeps megatron's keys, and the adapters live in their own module (`LoraAdapters`),
which is what the optimizer, gradient all-reduce and checkpoints see.

Tensor parallelism follows the base layer (each rank holds a fixed slice of every adapter):
    column-parallel (linear_qkv, linear_fc1): A replicated, B sharded on its output rows like the weight; A @ x
        goes through megatron's copy-to-TP region, so its gradient (and A's) is summed over the TP group.
    row-parallel (linear_proj, linear_fc2): A sharded on its input columns like the weight, B replicated; the
        rank's partial A @ x is summed over the TP group (megatron's reduce-from-TP region) before B.
Sharded adapter weights carry megatron's `tensor_model_parallel` attribute, so the gradient norm counts them once.
The initial values (peft's: A kaiming-uniform, B zero) are drawn for the whole adapter from a seed and then sliced,
so every TP layout starts from the same adapter.

Adapters stay fp32 whatever the model computes in (peft's default too): they are small, and fp32 makes them their
own optimizer masters. `merge_into_hf` folds an adapter into HF weights (what an engine without LoRA serves).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# HF projection -> (its place in the HF model, the megatron module that holds it)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "self_attention.linear_qkv"),
    "k_proj": ("self_attn", "self_attention.linear_qkv"),
    "v_proj": ("self_attn", "self_attention.linear_qkv"),
    "o_proj": ("self_attn", "self_attention.linear_proj"),
    "gate_proj": ("mlp", "mlp.linear_fc1"),
    "up_proj": ("mlp", "mlp.linear_fc1"),
    "down_proj": ("mlp", "mlp.linear_fc2"),
}
# Megatron-Bridge's names for the fused layers, accepted as shorthands for the HF projections they hold.
MEGATRON_NAMES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_ROW_PARALLEL = {"o_proj", "down_proj"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def resolve_targets(names: Sequence[str]) -> list[str]:
    """HF projection names from peft's or Megatron-Bridge's spellings ("all-linear" is every projection)."""
    out: list[str] = []
    for name in names:
        if name == "all-linear":
            picked: Sequence[str] = list(TARGETS)
        elif name in MEGATRON_NAMES:
            picked = MEGATRON_NAMES[name]
        elif name in TARGETS:
            picked = (name,)
        else:
            known = ", ".join(["all-linear", *TARGETS, *MEGATRON_NAMES])
            raise ValueError(f"unknown LoRA target module {name!r} (expected one of: {known})")
        out += [p for p in picked if p not in out]
    return [t for t in TARGETS if t in out]  # canonical order


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str | None = None) -> dict[str, Any]:
        """adapter_config.json as peft writes it for these settings (what peft and SGLang read)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }


def lora_spec(lora: Any) -> LoraSpec:
    """The LoraSpec of the config's LoRA part (TrainingConfig.lora: --lora-rank, --lora-alpha, --lora-dropout,
    --target-modules)."""
    return LoraSpec(lora.rank, float(lora.alpha), float(lora.dropout), tuple(resolve_targets(lora.target_modules)))


def _field(hf_config: Any, key: str) -> Any:
    """A field of an HF config, given as the config object or as its config.json dict (None if absent)."""
    return hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)


def _dims(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of every HF projection (`hf_config`: the config object or its config.json dict)."""
    h, nh, f = (int(_field(hf_config, k)) for k in ("hidden_size", "num_attention_heads", "intermediate_size"))
    ng = int(_field(hf_config, "num_key_value_heads") or nh)
    hd = int(_field(hf_config, "head_dim") or h // nh)
    return {
        "q_proj": (h, nh * hd),
        "k_proj": (h, ng * hd),
        "v_proj": (h, ng * hd),
        "o_proj": (nh * hd, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }


def adapter_parameters(hf_config: Any, rank: int, targets: Sequence[str], tp_size: int = 1) -> int:
    """Adapter parameters one TP rank of `LoraAdapters` holds, counted without building them (the memory plan,
    tasks/train/memory_plan.py, asks): r x (in + out) per adapted projection and layer, the sharded factor (B of a
    column-parallel, A of a row-parallel projection) divided over TP as `LoraAdapters._local` slices it."""
    dims, per_layer = _dims(hf_config), 0
    for t in targets:
        fan_in, fan_out = dims[t]
        per_layer += rank * (fan_in // tp_size + fan_out if t in _ROW_PARALLEL else fan_in + fan_out // tp_size)
    return int(_field(hf_config, "num_hidden_layers")) * per_layer


def peft_key(layer: int, target: str, which: str) -> str:
    """The key peft saves an adapter weight under (adapter_model.safetensors), which = "A" or "B"."""
    return f"{_PEFT_PREFIX}model.layers.{layer}.{TARGETS[target][0]}.{target}.lora_{which}.weight"


def _tp() -> tuple[int, int]:
    from sluiceway.models.megatron_gpt import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class LoraAdapters(torch.nn.Module):
    """Every adapter of one model (this TP rank's slices), in parameters named `{layer}.{target}.lora_{A|B}`."""

    def __init__(self, hf_config: Any, spec: LoraSpec, seed: int, device: torch.device | str = "cpu"):
        super().__init__()
        if spec.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {spec.rank}")
        self.spec, self.hf_config = spec, hf_config
        self.enabled = True
        self.tp_rank, self.tp_size = _tp()
        self.layers = torch.nn.ModuleList()
        self.dims = dims = _dims(hf_config)
        gen = torch.Generator().manual_seed(seed)
        for _layer in range(hf_config.num_hidden_layers):
            pairs = torch.nn.ParameterDict()
            for t in spec.targets:
                fan_in, fan_out = dims[t]
                bound = 1 / math.sqrt(fan_in)
                a = torch.empty(spec.rank, fan_in).uniform_(-bound, bound, generator=gen)
                b = torch.zeros(fan_out, spec.rank)  # peft's kaiming_uniform(a=sqrt(5)) for A, zeros for B
                a, b = self._local(t, a, b)
                pairs[f"{t}_A"] = torch.nn.Parameter(a.to(device))
                pairs[f"{t}_B"] = torch.nn.Parameter(b.to(device))
                sharded = pairs[f"{t}_A"] if t in _ROW_PARALLEL else pairs[f"{t}_B"]
                sharded.tensor_model_parallel = True  # read by tasks/train/parallel.is_tensor_parallel
            self.layers.append(pairs)
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()

    def _local(self, target: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """This TP rank's slices of a whole adapter (A on its input columns for row-parallel, else B on rows)."""
        if self.tp_size == 1:
            return a.clone(), b.clone()
        if target in _ROW_PARALLEL:
            return a.chunk(self.tp_size, dim=1)[self.tp_rank].clone(), b.clone()
        return a.clone(), b.chunk(self.tp_size, dim=0)[self.tp_rank].clone()

    # ----------------------------------------------------------------------------------------- forward hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Add the adapters' outputs to the GPTModel's fused linear layers (forward hooks; weights untouched)."""
        fused: dict[str, list[str]] = {}
        for t in self.spec.targets:
            fused.setdefault(TARGETS[t][1], []).append(t)
        for i, layer in enumerate(model.decoder.layers):
            for path, targets in fused.items():
                module = layer.get_submodule(path)
                kind = path.rsplit(".", 1)[-1]
                module.register_forward_hook(self._hook(i, kind, targets))

    def _hook(self, layer: int, kind: str, targets: list[str]):
        def hook(_module, args, output):
            if not self.enabled:
                return output
            out, bias = output
            return out + self._delta(layer, kind, targets, args[0]).to(out.dtype), bias

        return hook

    def _delta(self, layer: int, kind: str, targets: list[str], x: Tensor) -> Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        p, scale = self.layers[layer], self.spec.scale
        x = x.float()
        # Dropout only in a training forward: log-probs taken without gradient (old, reference) are deterministic.
        dropout = self.dropout if self.training and torch.is_grad_enabled() else torch.nn.Identity()
        if kind in ("linear_proj", "linear_fc2"):  # row-parallel: x is this rank's input slice
            t = targets[0]
            partial = dropout(x) @ p[f"{t}_A"].T
            if self.tp_size > 1:
                partial = reduce_from_tensor_model_parallel_region(partial)
            return partial @ p[f"{t}_B"].T * scale

        def piece(t: str, width: int) -> Tensor:
            if t not in targets:
                return x.new_zeros(*x.shape[:-1], width)
            h = dropout(x) @ p[f"{t}_A"].T
            if self.tp_size > 1:  # every rank's B rows add to A's gradient: sum it over TP in backward
                h = copy_to_tensor_model_parallel_region(h)
            return h @ p[f"{t}_B"].T * scale

        d = self.dims
        if kind == "linear_fc1":  # [gate | up], each this rank's rows
            f = d["gate_proj"][1] // self.tp_size
            return torch.cat([piece("gate_proj", f), piece("up_proj", f)], dim=-1)
        # linear_qkv: per query group g of this rank, [q heads of g | k of g | v of g]
        nh_hd, ng_hd = d["q_proj"][1] // self.tp_size, d["k_proj"][1] // self.tp_size
        groups = self._local_groups()
        lead = x.shape[:-1]
        q = piece("q_proj", nh_hd).reshape(*lead, groups, -1)
        k = piece("k_proj", ng_hd).reshape(*lead, groups, -1)
        v = piece("v_proj", ng_hd).reshape(*lead, groups, -1)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    def _local_groups(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", c.num_attention_heads) // self.tp_size

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model alone (the frozen reference of a KL loss costs no second model)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    # ----------------------------------------------------------------------------------------- state
    @torch.no_grad()
    def load_whole(self, adapter: Mapping[str, Tensor]) -> None:
        """Set every adapter from whole adapters in peft's keys (this rank takes its slices)."""
        want = set(self.local_state())
        if set(adapter) != want:
            missing, extra = sorted(want - set(adapter)), sorted(set(adapter) - want)
            raise ValueError(f"adapter does not fit: missing {missing[:3]}, unexpected {extra[:3]}")
        for i, p in enumerate(self.layers):
            for t in self.spec.targets:
                a, b = self._local(t, adapter[peft_key(i, t, "A")], adapter[peft_key(i, t, "B")])
                p[f"{t}_A"].copy_(a)
                p[f"{t}_B"].copy_(b)

    def local_params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's adapter parameters under peft's key names (TP slices)."""
        return {
            peft_key(i, t, w): p[f"{t}_{w}"]
            for i, p in enumerate(self.layers)
            for t in self.spec.targets
            for w in ("A", "B")
        }

    def local_state(self) -> dict[str, Tensor]:
        """This rank's adapter slices, in peft's key names (TP shards not merged)."""
        return {k: v.detach() for k, v in self.local_params().items()}


def merge_tp_adapters(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Whole adapters (peft keys) from every TP rank's `local_state`, in rank order."""
    if len(shards) == 1:
        return {k: v.clone() for k, v in shards[0].items()}
    out = {}
    for k in shards[0]:
        target, which = k.split(".")[-3], k.split(".")[-2][-1]
        if which == "A" and target in _ROW_PARALLEL:
            out[k] = torch.cat([s[k] for s in shards], dim=1)
        elif which == "B" and target not in _ROW_PARALLEL:
            out[k] = torch.cat([s[k] for s in shards], dim=0)
        else:
            out[k] = shards[0][k].clone()
    return out


def spec_from_peft_config(cfg: Mapping[str, Any]) -> LoraSpec:
    """The LoraSpec of a peft adapter_config.json (only plain LoRA: no DoRA, rsLoRA or per-module ranks)."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter is {cfg.get('peft_type')!r}, not LORA")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ValueError(f"adapter sets {flag}, which is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError("adapter has per-module ranks (rank_pattern/alpha_pattern), which are not supported")
    targets = cfg["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    return LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)),
                    tuple(resolve_targets(targets)))  # fmt: skip


def merge_into_hf(hf_state: Mapping[str, Tensor], adapter: Mapping[str, Tensor], spec: LoraSpec) -> dict[str, Tensor]:
    """HF weights with the adapter folded in: W + scale * B @ A for every adapted projection (in fp32, then back to
    each weight's dtype). Other tensors are passed through (not copied)."""
    out = dict(hf_state)
    for key, a in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = adapter.get(key.replace(".lora_A.", ".lora_B."))
        wkey = key[len(_PEFT_PREFIX) :].replace(".lora_A.weight", ".weight")
        if b is None or wkey not in out:
            raise ValueError(f"adapter weight {key} has no lora_B pair or no base weight {wkey}")
        w = out[wkey]
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
            raise ValueError(
                f"adapter for {wkey} does not fit: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)}, "
                f"weight {tuple(w.shape)}"
            )
        out[wkey] = (w.float() + spec.scale * (b.float() @ a.float())).to(w.dtype)
    return out


def write_adapter_dir(adapter: Mapping[str, Tensor], spec: LoraSpec, out_dir: Path, base_model: str | None,
                      metadata: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """peft's adapter directory: adapter_config.json and adapter_model.safetensors (fp32)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(spec.peft_config(base_model), indent=2))
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in sorted(adapter.items())}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt", **(metadata or {})})


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_dir(path: str | Path) -> tuple[LoraSpec, dict[str, Tensor]]:
    """A peft adapter directory's spec and weights (keys as peft saves them)."""
    from safetensors.torch import load_file

    path = Path(path)
    spec = spec_from_peft_config(json.loads((path / ADAPTER_CONFIG).read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: adapter directory has no .safetensors file")
    adapter: dict[str, Tensor] = {}
    for f in files:
        adapter.update(load_file(str(f)))
    adapter = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in adapter.items()}  # fmt: skip
    return spec, adapter


def lora_server_args(cfg) -> list[str]:
    """SGLang's LoRA serving flags when each weight version is a LoRA adapter (--lora-sync adapter): dynamic
    loading needs the largest rank and the target modules fixed at start."""
    t = cfg.training
    if not t.lora_rank or cfg.sync.lora_sync != "adapter":
        return []
    return ["--enable-lora", "--max-lora-rank", str(t.lora_rank),
            "--lora-target-modules", *resolve_targets(t.target_modules)]  # fmt: skip
