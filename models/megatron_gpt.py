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
    linear_token_logprob_entropy,
    or_eager,
    token_logprob_entropy,
)
from sluiceway.models.megatron_attention import cpu_layer_spec
from sluiceway.models.megatron_import import megatron_import, traceable_linear_layers
from sluiceway.models.megatron_row_blocks import use_row_blocks

with megatron_import():  # quiet, and torch.compile deferred (models/megatron_import.py)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


__all__ = [
    "allreduce_gradients",
    "build_gpt_model",
    "gpt_logits",
    "init_parallel_state",
    "recompute_overrides",
    "rope_theta_from_hf",
    "token_logprobs",
    "token_logprobs_and_entropy",
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


# --------------------------------------------------------------------------------------------------------------
# Log-probs
# --------------------------------------------------------------------------------------------------------------


def gpt_logits(
    model: GPTModel,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    first_position: int = 0,
    seq_first: bool = False,
    keep: Tensor | None = None,
    position_ids: Tensor | None = None,
    hidden_only: bool = False,
) -> Tensor:
    """Logits [b, s - first_position, vocab / tp] (this rank's vocab shard under TP), causal, no padding mask needed.

    `attention_mask` ([b, 1, s, s], True where attention is forbidden) is only for packed rows (see
    `packed_attention_mask`); causal masking is always applied on top of it. `position_ids` ([b, s]) are the
    RoPE positions of each token (default 0..s-1 in every row). `first_position` > 0 skips the
    output layer for the positions before it: with a 49k vocabulary the head and its log-softmax cost as much
    as several layers, and a policy loss needs no logits at prompt positions. `seq_first` returns the output
    layer's own [s - first_position, b, vocab] tensor, saving the model's batch-first copy of it. `keep` (flat
    indices into the [s, b] positions, seq-major) computes logits at those positions only: [len(keep), 1, vocab],
    seq-first. `hidden_only` returns the output layer's input instead (seq-first, hidden wide), for callers that
    apply the output layer themselves (`logprobs_at`'s fused path); the layer then runs on one row.
    """
    b, s = input_ids.shape
    default_positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    captured: list[Tensor] = []
    seq_first = seq_first or keep is not None

    def keep_tail(_module, args, kwargs):  # hidden states [s, b, h] reach the output layer as its first input
        h = args[0]
        h = h.reshape(-1, 1, h.size(-1)).index_select(0, keep) if keep is not None else h[max(first_position, 0) :]
        if hidden_only:
            captured.append(h)
            h = h[:1, :1]
        return (h, *args[1:]), kwargs

    def capture(_module, _args, output):  # (logits [s, b, v], bias): the model transposes a one-column view
        captured.append(output[0])
        return output[0][..., :1], output[1]

    hooks = []
    if first_position > 0 or keep is not None or hidden_only:
        hooks.append(model.output_layer.register_forward_pre_hook(keep_tail, with_kwargs=True))
    if seq_first and not hidden_only:
        hooks.append(model.output_layer.register_forward_hook(capture))
    rope = model.rotary_pos_emb
    rope.positions = position_ids.t() if position_ids is not None else None
    try:
        out = model(input_ids, default_positions, attention_mask=attention_mask)
    finally:
        rope.positions = None
        for h in hooks:
            h.remove()
    return captured[0] if seq_first or hidden_only else out


# Whether `logprobs_at` applies the output layer itself in chunks (`linear_token_logprob_entropy`): None means
# on GPUs only. On CPU the output layer's logits and the cache-sized chunks of `token_logprob_entropy` are as
# fast and give the embedded engine's numbers bit for bit; tests set True to check the fused path there.
FUSED_OUTPUT_LAYER: bool | None = None


def fused_output_weight(model: GPTModel, device: torch.device) -> Tensor | None:
    """The output layer's weight (the tied embedding's where shared) when `logprobs_at` may fuse the output layer
    with the log-prob: one tensor-parallel rank (the vocab whole), megatron's own bias-free output layer (not a
    value head), and FUSED_OUTPUT_LAYER (or, unset, a GPU). None: the output layer makes the logits."""
    wanted = FUSED_OUTPUT_LAYER if FUSED_OUTPUT_LAYER is not None else device.type != "cpu"
    layer = getattr(model, "output_layer", None)
    if not wanted or type(layer) is not ColumnParallelLinear or getattr(layer, "bias", None) is not None:
        return None
    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        return None
    # megatron's shared_embedding_or_output_weight() is the embedding's on the first stage, tied or not.
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight


def logprobs_at(
    model: GPTModel,
    input_ids: Tensor,
    rows: Tensor,
    positions: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log p(target), entropy) fp32 [k] of the next-token distribution at the k positions (rows[i], positions[i]).

    The general form of `token_logprobs`: the output layer runs at the listed positions only, and each names
    its own target, so one position may score several tokens (in a row where responses share a prompt, the
    prompt's last position predicts every response's first token). Under TP the logits are vocab-parallel.
    """
    b = input_ids.size(0)
    weight = fused_output_weight(model, input_ids.device)
    if weight is not None:  # neither the [k, vocab] logits nor their gradient are ever whole
        hidden = gpt_logits(model, input_ids, attention_mask, keep=positions * b + rows, position_ids=position_ids,
                            hidden_only=True)[:, 0]  # fmt: skip
        return linear_token_logprob_entropy(hidden, weight, targets, temperature)
    logits = gpt_logits(model, input_ids, attention_mask, keep=positions * b + rows, position_ids=position_ids)[:, 0]
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return token_logprob_entropy(logits, targets, temperature)
    return _vocab_parallel_logprob_entropy(logits, targets, temperature, True)


def packed_attention_mask(segment_ids: Tensor, members: Tensor | None = None) -> Tensor:
    """[b, 1, s, s] mask forbidding attention across the samples packed into one row (True = forbidden).

    `segment_ids` [b, s] numbers the samples of each row. Positions keep counting across a row: RoPE scores
    depend only on the distance between query and key, so a sample at an offset attends exactly as it would alone.
    With `members` [b, s], a segment is a prompt (member -1) shared by several responses (members 0, 1, ...):
    a response attends to its prompt and to itself, never to the other responses.
    """
    allowed = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    if members is not None:
        key, query = members.unsqueeze(-2), members.unsqueeze(-1)
        allowed &= (key == -1) | (key == query)
    return (~allowed).unsqueeze(1)


class _LocalSoftmaxStats(torch.autograd.Function):
    """Per-rank (sum_j exp(s_j), sum_j exp(s_j) s_j) of a vocab shard of shifted logits `s`, saving only `s`.

    Both are recomputed from `s` in backward: d/ds_j = exp(s_j) * (g_sum + g_wsum * (s_j + 1)).
    """

    @staticmethod
    def forward(ctx: Any, shifted: Tensor, with_weighted: bool) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(shifted)
        ctx.with_weighted = with_weighted
        exp = torch.exp(shifted)
        sum_exp = exp.sum(-1)
        weighted = exp.mul_(shifted).sum(-1) if with_weighted else torch.zeros_like(sum_exp)
        return sum_exp, weighted

    @staticmethod
    def backward(ctx: Any, g_sum: Tensor | None, g_weighted: Tensor | None) -> tuple[Tensor, None]:
        (shifted,) = ctx.saved_tensors
        out = torch.exp(shifted)
        if ctx.with_weighted and g_weighted is not None:
            coef = shifted + 1.0
            coef.mul_(g_weighted.unsqueeze(-1))
            if g_sum is not None:
                coef.add_(g_sum.unsqueeze(-1))
            out.mul_(coef)
        elif g_sum is not None:
            out.mul_(g_sum.unsqueeze(-1))
        else:
            out.zero_()
        return out, None


def _shifted_logprobs(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float,
    with_entropy: bool,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(input_ids[:, t+1]) and entropy at t from the model's (possibly vocab-parallel) logits [b, s, v_local].

    Memory: the logits are produced here, so this frame holds the only reference and each full-vocab tensor is
    dropped as soon as the next is made. At TP=1 the fused `token_logprob_entropy` keeps only the output layer's
    logits for backward (in the model's dtype); under TP one fp32 tensor of shifted logits stays saved, and the
    entropy reuses it.

    `first_target` > 0: positions before it get log-prob and entropy 0 without logits computed there (callers
    mask them out: they predict prompt tokens). `needed` (bool [b, s-1]) goes further: logits only where it is
    True (the positions a loss reads: no prompt, no padding), zeros elsewhere.
    """
    if needed is not None:
        b_idx, t_idx = needed.nonzero(as_tuple=True)
        logp, entropy = logprobs_at(model, input_ids, b_idx, t_idx, input_ids[b_idx, t_idx + 1], temperature,
                                    attention_mask)  # fmt: skip
        zeros = torch.zeros(needed.shape, dtype=logp.dtype, device=logp.device)
        logp = zeros.index_put((b_idx, t_idx), logp)
        return logp, zeros.index_put((b_idx, t_idx), entropy) if with_entropy else None
    first = max(0, min(first_target, input_ids.size(1) - 2))
    targets = input_ids[:, first + 1 :]
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        # Seq-first [s, b, v] as the output layer made it: the fused function reads it in place (no copies).
        logits = gpt_logits(model, input_ids, attention_mask, first_position=first, seq_first=True)[:-1]
        logp, entropy = token_logprob_entropy(logits, targets.t(), temperature)
        return _pad_left(logp.t(), first), _pad_left(entropy.t() if with_entropy else None, first)
    logits = gpt_logits(model, input_ids, attention_mask, first_position=first)[:, :-1]
    logp, entropy = _vocab_parallel_logprob_entropy(logits, targets, temperature, with_entropy)
    return _pad_left(logp, first), _pad_left(entropy, first)


def _vocab_parallel_logprob_entropy(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) and entropy from this TP rank's vocab shard of the logits [..., v_local]; fp32 [...]."""
    if logits.dtype != torch.float32:
        logits = logits.float()  # the low-precision copy is freed on rebinding (ToCopyBackward saves nothing)
    if temperature != 1.0:
        logits = logits / temperature  # DivBackward by a scalar saves nothing: the undivided copy is freed
    # Vocab-parallel: each rank holds a slice of the vocab. Per-rank partial sums are all-reduced with megatron's
    # mapping (all-reduce forward, identity backward) and only combined *after* the reduction. That keeps the
    # identity backward exact: a reduced value fed back into rank-local terms would miss the other ranks'
    # gradient contributions. The max is a detached stabiliser (the results do not depend on it).
    group = parallel_state.get_tensor_model_parallel_group()
    v_local = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    m = logits.detach().amax(-1)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    del logits
    local = targets - start
    in_shard = (local >= 0) & (local < v_local)
    tgt = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * in_shard
    local_sum, local_weighted = _LocalSoftmaxStats.apply(shifted, with_entropy)
    sum_exp = reduce_from_tensor_model_parallel_region(local_sum)
    log_z = sum_exp.log()
    logp = reduce_from_tensor_model_parallel_region(tgt) - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_i exp(s_i) s_i / Z
        weighted = reduce_from_tensor_model_parallel_region(local_weighted)
        entropy = log_z - weighted / sum_exp
    return logp, entropy


def _pad_left(t: Tensor | None, n: int) -> Tensor | None:
    """Zeros for the `n` skipped positions, so callers keep the [b, s-1] layout."""
    return t if t is None or n == 0 else F.pad(t, (n, 0))


def token_logprobs(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) as fp32 [b, s-1], from logits / temperature.

    Right padding is harmless: causal attention keeps valid positions independent of later pad tokens, so
    callers mask out the pad positions of the result. Differentiable (use under no_grad for inference).
    `first_target` and `needed` skip positions no caller reads (see `_shifted_logprobs`).
    """
    logp, _ = _shifted_logprobs(model, input_ids, temperature, False, attention_mask, first_target, needed)
    return logp


def token_logprobs_and_entropy(
    model: GPTModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    first_target: int = 0,
    needed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log-probs [b, s-1], entropy [b, s-1]) of the next-token distribution at logits / temperature, fp32.

    One pass over the logits feeds both outputs, and no full-vocab fp32 tensor is kept for backward (see
    `_shifted_logprobs`).
    """
    logp, entropy = _shifted_logprobs(model, input_ids, temperature, True, attention_mask, first_target, needed)
    assert entropy is not None
    return logp, entropy
