"""Megatron-core GPTModel for HF Llama-family checkpoints (Llama, Qwen2, Qwen3), usable on CPU and CUDA.

megatron-core's stock local spec uses `DotProductAttention` (a CUDA memory buffer and CUDA RNG forks) and its
RoPE moves `inv_freq` to CUDA on first use; both are replaced (the attention in models/megatron_attention.py, the
RoPE here) so the same model trains on CPU (gloo, for tests and the one-machine path) and on GPUs.
Weight mapping lives in `hf_megatron.py`.

Data parallelism on CPU: megatron's `DistributedDataParallel` (and its optimizers, which expect its grad buffers)
allocate their contiguous grad buffers with `device=torch.cuda.current_device()` and overlap the reduction on
CUDA streams, so they cannot run without a GPU. On CPU use `allreduce_gradients` (below) after `backward()`, or
torch's own DDP over `parallel_state.get_data_parallel_group()`; both reduce over gloo.

Activation recompute (Megatron's --recompute-granularity/-method/-num-layers, `recompute_overrides`) is
megatron's own: TransformerBlock's full recompute and Attention's selective (core attention) recompute both go
through `tensor_parallel.checkpoint`, whose RNG bookkeeping saves and restores the CUDA generator's state with
`torch.cuda` calls that fail without CUDA ("Torch not compiled with CUDA enabled"). On CPU `init_parallel_state`
swaps megatron's two RNG-state helpers for ones that keep the CPU generator and the tracker states only (the
CPU path's dropout draws from the CPU generator), so the same checkpoint function replays the forward exactly.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.infra.proc import loopback_collectives, loopback_store
from sluiceway.models.batch_invariant import rows_vary
from sluiceway.models.fused_logprobs import (
    compiled_on,
    or_eager,
)
from sluiceway.models.megatron_attention import cpu_layer_spec
from sluiceway.models.megatron_import import megatron_import, traceable_linear_layers
from sluiceway.models.megatron_row_blocks import use_row_blocks

with megatron_import():  # quiet, and torch.compile deferred (models/megatron_import.py)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


__all__ = [
    "allreduce_gradients",
    "build_gpt_model",
    "init_parallel_state",
    "recompute_overrides",
    "rope_theta_from_hf",
    "transformer_config_from_hf",
]

DEFAULT_SEED = 1234


# --------------------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------------------


def init_parallel_state(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    backend: str | None = None,
    seed: int = DEFAULT_SEED,
) -> None:
    """Initialise torch.distributed, megatron's model-parallel groups and its RNG tracker. Idempotent.

    Under torchrun (RANK/WORLD_SIZE in the environment) the env:// rendezvous is used; a plain single process
    gets a world of one on a free loopback port, so scripts and tests need no launcher.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        loopback_collectives()
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend=backend, init_method="env://")
        else:
            # A store of our own: the tcp:// init method's store would listen on every interface.
            torch.distributed.init_process_group(backend=backend, store=loopback_store(), world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )
    else:
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tensor_model_parallel_size, pipeline_model_parallel_size):
            raise RuntimeError(
                f"megatron parallel state already initialised with (tp, pp)={have}, "
                f"asked for ({tensor_model_parallel_size}, {pipeline_model_parallel_size})"
            )
    _seed_rng_tracker(seed, cuda=backend == "nccl" or torch.cuda.is_available())


def _seed_rng_tracker(seed: int, cuda: bool) -> None:
    """Seed megatron's RNG tracker (used for dropout forks under TP) in a way that works without CUDA.

    `model_parallel_cuda_manual_seed` calls torch.cuda.*; on CPU we install megatron's inference tracker, whose
    `fork()` is a no-op, so dropout there draws from torch's CPU generator (seeded per TP rank).
    """
    if cuda:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        if mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    if not mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True)
        torch.manual_seed(seed + parallel_state.get_tensor_model_parallel_rank())
    if not torch.cuda.is_available():
        # Activation recompute's checkpoint function saves the RNG states before a forward and restores them to
        # replay it; megatron's helpers include the CUDA generator's. Without CUDA: the CPU generator and the
        # tracker's states (empty with the inference tracker) are the whole RNG state.
        mcore_random._get_all_rng_states = _cpu_rng_states
        mcore_random._set_all_rng_states = _set_cpu_rng_states


def _cpu_rng_states() -> tuple[Tensor, None, dict]:
    """megatron's `_get_all_rng_states` for a machine without CUDA: (CPU state, no CUDA state, tracker states)."""
    return torch.get_rng_state(), None, mcore_random.get_cuda_rng_tracker().get_states()


def _set_cpu_rng_states(cpu_state: Tensor, _cuda_state: None, tracker_states: dict) -> None:
    torch.set_rng_state(cpu_state)
    mcore_random.get_cuda_rng_tracker().set_states(tracker_states)


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def rope_theta_from_hf(hf_config: Any) -> float:
    """HF 5.x keeps rope settings in `rope_parameters`; 4.x used `rope_theta` / `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _rope_scaling_from_hf(hf_config: Any) -> tuple[bool, float]:
    """Map HF rope types onto GPTModel's (rope_scaling, rope_scaling_factor); refuse what it cannot express."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return False, 8.0
    if rope_type == "llama3":
        # megatron hard-codes low=1, high=4, original=8192 (Llama 3.1's values).
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in expected.items():
            if key in params and float(params[key]) != want:
                raise NotImplementedError(f"rope_parameters.{key}={params[key]} (GPTModel supports {want})")
        return True, float(params.get("factor", 8.0))
    raise NotImplementedError(f"rope_type={rope_type!r} is not supported by the Megatron mapping")


def _head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _qkv_bias(hf_config: Any) -> bool:
    """Qwen2 has q/k/v biases and no o_proj bias; Llama's and Qwen3's `attention_bias` also bias o_proj
    (unsupported: GPTModel's add_bias_linear would bias the MLP too)."""
    if getattr(hf_config, "model_type", "") == "qwen2":
        return True
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError("attention_bias / mlp_bias are not supported by the Megatron mapping")
    return False


def _qk_layernorm(hf_config: Any) -> bool:
    """Qwen3 RMS-normalises every q and k head (`q_norm`, `k_norm`, weight [head_dim]) before RoPE."""
    return getattr(hf_config, "model_type", "") == "qwen3"


def recompute_overrides(training: Any) -> dict[str, Any]:
    """TransformerConfig fields for Megatron's activation-recompute flags, from anything with
    `recompute_granularity`, `recompute_method` and `recompute_num_layers` (the run's TrainingConfig).

    full recomputes whole transformer layers in backward, keeping only the input of each recomputed group:
    `uniform` splits the layers into groups of `recompute_num_layers`, `block` recomputes the first
    `recompute_num_layers` layers and keeps the rest's activations. Megatron needs both with full; here they
    default to uniform and 1 (every layer recomputed, each keeping only its input). selective recomputes the
    core attention only (megatron's default `recompute_modules`, ["core_attn"]) and takes neither.
    """
    granularity = getattr(training, "recompute_granularity", None)
    method = getattr(training, "recompute_method", None)
    num_layers = getattr(training, "recompute_num_layers", None)
    if granularity is None:
        if method is not None or num_layers is not None:
            raise ValueError("recompute_method and recompute_num_layers need recompute_granularity full")
        return {}
    if granularity == "selective":
        if method is not None or num_layers is not None:
            raise ValueError("recompute_granularity selective takes no recompute_method or recompute_num_layers")
        return {"recompute_granularity": "selective"}
    if granularity != "full":
        raise ValueError(f"recompute_granularity {granularity!r}: expected full or selective")
    return {"recompute_granularity": "full", "recompute_method": method or "uniform",
            "recompute_num_layers": num_layers or 1}  # fmt: skip


def transformer_config_from_hf(
    hf_config: Any, dtype: torch.dtype = torch.float32, **overrides: Any
) -> TransformerConfig:
    """TransformerConfig for an HF Llama/Qwen2/Qwen3 config. `overrides` set any other TransformerConfig field.

    Qwen3 sets `qk_layernorm=True` (RMSNorm over head_dim with the model's rms_norm_eps, applied before RoPE, as
    HF does) and `kv_channels=head_dim`, which may differ from hidden_size / num_attention_heads.
    """
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type={model_type!r}: only {', '.join(SUPPORTED_MODEL_TYPES)} map to GPTModel here"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf_config.hidden_act!r} (expected silu for SwiGLU)")
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("Qwen2/Qwen3 sliding-window attention (use_sliding_window) is not supported")
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    pp = (
        parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    )
    kwargs: dict[str, Any] = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "kv_channels": _head_dim(hf_config),
        "ffn_hidden_size": hf_config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": _qkv_bias(hf_config),
        "qk_layernorm": _qk_layernorm(hf_config),
        # RL needs deterministic log-probs: no hidden dropout; attention dropout as the checkpoint says (0).
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(getattr(hf_config, "initializer_range", 0.02)),
        # Fusions need CUDA kernels (apex / TE); the unfused paths are exact and run everywhere.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "sequence_parallel": False,
        "use_cpu_initialization": True,
        # Weights come from the HF checkpoint; skip megatron's (slow, RNG-tracker-bound) init.
        "perform_initialization": False,
    }
    kwargs.update(overrides)
    with warnings.catch_warnings():
        # 0.16.1's default cuda_graph_scope trips its own deprecation warning; CUDA graphs are unused here.
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        # Selective recompute warns that Transformer Engine's fused attention would not need it; ours is SDPA.
        warnings.filterwarnings("ignore", message="If you are using transformer_engine", category=UserWarning)
        return TransformerConfig(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------


class _DeviceLocalRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose frequencies stay on the device they were put on (stock one forces CUDA).

    Megatron's GPTModel gives RoPE the positions 0..s-1 of every row. While `positions` ([s, b]) is set (see
    `gpt_logits(position_ids=...)`), each token gets its own: rows that share one prompt between several
    responses need every response to continue from the prompt's end.
    """

    positions: Tensor | None = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        if self.positions is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)  # memoised per length
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1:
            raise ValueError("per-token RoPE positions (shared prompts) do not support context parallelism")
        return self.get_emb(max_seq_len, offset)  # never memoised: the positions change with every batch

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        if self.positions is not None:
            # A token's position never exceeds its column (a sample's prompt is laid out before it), so a table
            # of the row's length covers them all without reading their max back from the device (a sync).
            table = self._emb(max(max_seq_len, self.positions.size(0)), 0)
            return table[self.positions].unsqueeze(2)  # [s, b, 1, d]: broadcasts over heads like [s, 1, 1, d]
        return self._emb(max_seq_len, offset)[:, None, None, :]

    def _emb(self, n: int, offset: int) -> Tensor:
        freqs = self.get_freqs_non_repeated(n, offset)
        if not self.rotary_interleaved:
            return torch.cat((freqs, freqs), dim=-1)
        return torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)


def build_gpt_model(
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layer_spec: ModuleSpec | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """A GPTModel shaped like the HF Llama/Qwen2/Qwen3 config (weights uninitialised: load them with hf_megatron).

    Needs `init_parallel_state()` first. With TP>1 the output layer stays vocab-parallel (parallel_output=True):
    use `token_logprobs`, which reduces across the TP group.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call init_parallel_state() before build_gpt_model()")
    device = torch.device(device)
    if device.type == "cuda" and "bias_activation_fusion" not in config_overrides and compiled_on(device):
        # megatron's fused SwiGLU (torch.compile'd, so only where compiling works): one kernel each way instead
        # of four, and backward recomputes silu from the fc1 output instead of keeping its result (a
        # [tokens, ffn] tensor a layer: 3.8 GiB at the 1.5B shape of issue 44). CPU keeps the exact unfused ops.
        config_overrides["bias_activation_fusion"] = True
    config = transformer_config_from_hf(hf_config, dtype=dtype, **config_overrides)
    rope_scaling, rope_factor = _rope_scaling_from_hf(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if hf_config.vocab_size % tp:
        raise ValueError(f"vocab_size={hf_config.vocab_size} is not divisible by tensor_model_parallel_size={tp}")
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec if layer_spec is not None else cpu_layer_spec(config.qk_layernorm),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta_from_hf(hf_config),
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_factor,
    )
    # inv_freq is a plain attribute (not a buffer): .to() does not move it, so place it ourselves.
    rope = model.rotary_pos_emb
    rope.__class__ = _DeviceLocalRotaryEmbedding
    rope.inv_freq = rope.inv_freq.to(device)
    # Megatron's torch-norm wrapper ignores params_dtype; a bf16 model with fp32 norm weights takes torch's
    # slow unfused RMSNorm path. inv_freq is not a parameter, so this leaves RoPE in fp32.
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)
    model = model.to(device)
    if device.type == "cpu" and dtype != torch.float32 and rows_vary(dtype):
        use_row_blocks(model)  # the engine's row blocks on AMX: same log-probs (models/megatron_row_blocks.py)
    if compile_layers_on(device):
        compile_layers(model)
    return model


def compile_layers_on(device: torch.device) -> bool:
    """Whether `build_gpt_model` compiles its transformer layers: on GPUs where torch.compile works, unless
    SLUICEWAY_COMPILE_LAYERS=0 (to compare). Never on CPU: there the eager ops are the engine's arithmetic."""
    return device.type == "cuda" and os.environ.get("SLUICEWAY_COMPILE_LAYERS", "1") != "0" and compiled_on(device)


def compile_layers(model: GPTModel) -> None:
    """Each transformer layer through torch.compile (issue 44): megatron's local spec runs RMSNorm, RoPE, the
    residual adds and the attention's reshapes as separate kernels, hundreds of launches a layer; compiled, the
    elementwise work between two matrix products is one kernel. The layers share one compiled graph (same code,
    their parameters are inputs), recompiled once for dynamic lengths. A layer whose compile fails runs eagerly,
    with a warning, from then on."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError, Unsupported

    traceable_linear_layers()
    compiler_errors = (BackendCompilerFailed, TorchRuntimeError, Unsupported)
    for layer in model.decoder.layers:
        layer.compile()
        layer._compiled_call_impl = or_eager(layer._compiled_call_impl, layer._call_impl, "a transformer layer",
                                             compiler_errors)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Data parallelism
# --------------------------------------------------------------------------------------------------------------


def allreduce_gradients(model: torch.nn.Module, group: Any = None, average: bool = False) -> None:
    """Sum (or with `average`, mean) every parameter's `.grad` over the data-parallel group, in place.

    Call after `backward()` and before the optimizer step. The loss convention that makes a sum exact: each DP
    rank normalises its loss by the *global* number of loss tokens (all ranks' micro-batches together), so the
    summed gradients equal the full-batch gradient. Parameters that need a grad but got none on this rank take
    part as zeros (and keep a zero grad), so every rank issues the same collective. One flat all-reduce per
    dtype. Works on any backend (gloo on CPU, NCCL on GPU).

    Why not megatron's `DistributedDataParallel`: its contiguous grad buffers are allocated on
    `torch.cuda.current_device()` and its reductions overlap on CUDA streams, so it is CUDA-only (as are
    megatron's optimizers, which read those buffers). torch's DDP over the same group also works on CPU, but it
    *averages* gradients and wraps the module; this helper keeps the GPTModel unwrapped and the loss scaling explicit.
    Under pipeline parallelism the tied embedding / output weights also need megatron's embedding-group
    reduction, which this helper does not do.
    """
    if group is None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("call init_parallel_state() before allreduce_gradients()")
        group = parallel_state.get_data_parallel_group()
    world = torch.distributed.get_world_size(group=group)
    if world == 1:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
        if average:
            flat.div_(world)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
