"""A Llama-family forward pass over HF weights that reads and writes a slot-based KV cache.

HF's own forward keeps one DynamicCache for a rectangular batch; continuous batching needs sequences of
different lengths that join and leave at different steps, so the engine runs its own forward: embedding,
RMSNorm (torch's, as the trainer's), RoPE (inv_freq from transformers' own rope functions, so `rope_parameters`
mean what HF means), GQA attention (SDPA, or an explicit product where that is faster: see `attention`), SwiGLU
MLP, tied or untied lm_head.
Supports Llama and Qwen2 shapes (optional q/k/v bias); logits come out in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.models.batch_invariant import masked_attention, padded_span, rows_vary, single_row_safe, stable_linear
from sluiceway.models.engine import packed_linear
from sluiceway.models.engine.kv_cache import SlotKVCache


def rope_inv_freq(config: Any) -> tuple[Tensor, float]:
    """(inv_freq, attention_scaling) exactly as transformers' LlamaRotaryEmbedding computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK rescales with the running length; a fixed table would silently differ from HF.
        raise ValueError("rope_type 'dynamic' is not supported by the embedded engine")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Largest fp32 score tensor (rows x heads x queries x keys) the explicit attention below builds; beyond it SDPA.
_EXPLICIT_ATTENTION_MAX_SCORES = 1 << 23


def attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """GQA attention, [b, heads, t, d] queries over [b, kv_heads, s, d] keys/values -> [b, heads, t, d].

    `allowed` (bool, True = may attend) is [b or 1, 1, t or 1, s]; None means causal with t == s. In fp32 this is
    SDPA. In bf16/fp16 on CPU, SDPA's kernels are 1.5-5x slower at the engine's shapes (a decode step's
    attention: 1.5 vs 0.34 ms a layer for 32 rows), so up to a size bound the scores are an explicit product
    with the softmax in fp32; query heads are grouped by KV head, so K and V are never repeated.
    """
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    explicit = (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and b * h * t * s <= _EXPLICIT_ATTENTION_MAX_SCORES
    )
    if not explicit:
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, scale=scale)
    rep = h // g
    # Query head i uses KV head i // rep (HF's grouping): rows (i % rep, query) of group i // rep.
    if allowed is None:
        allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
    allowed = allowed.unsqueeze(2).expand(-1, -1, rep, -1, -1).reshape(allowed.size(0), 1, rep * t, s)
    # The trainer's arithmetic (models/batch_invariant.py): a row's bits do not depend on the span or the batch.
    return masked_attention(q.reshape(b, g, rep * t, d), k, v, ~allowed, scale).view(b, h, t, d)


class LlamaRunner:
    """Weights (plain tensors, the matrices packed for oneDNN on CPU) plus the forward passes the scheduler needs
    (prefill one, decode many)."""

    def __init__(
        self,
        config: Any,
        state_dict: Mapping[str, Tensor],
        dtype: torch.dtype = torch.float32,
        pack_weights: bool | None = None,
    ):
        """`pack_weights`: keep the matrix weights in oneDNN's layout (`packed_linear`); None = where available."""
        self.config = config
        self.dtype = dtype
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: the embedded engine implements SwiGLU (silu)")
        self.scale = self.head_dim**-0.5
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.inv_freq = inv_freq
        self.pack_weights = packed_linear.available(dtype) if pack_weights is None else pack_weights
        # Where this CPU's bf16 products depend on the rows beside a row (AMX), every product runs in blocks of
        # the same rows as the trainer's (models/batch_invariant.py `stable_linear`).
        self.row_blocks = dtype != torch.float32 and rows_vary(dtype)
        self.w: dict[str, Tensor] = {}
        self.packed: dict[str, Tensor] = {}  # name -> packed weight; such a name has no plain tensor in self.w
        self.load_state_dict(state_dict)

    # ---------------------------------------------------------------------------------------------- weights
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, hd = self.config.hidden_size, self.config.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        bias = bool(getattr(self.config, "attention_bias", False)) or self.config.model_type == "qwen2"
        for n in range(self.n_layers):
            p = f"model.layers.{n}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.n_heads * hd, h),
                p + "self_attn.k_proj.weight": (self.n_kv * hd, h),
                p + "self_attn.v_proj.weight": (self.n_kv * hd, h),
                p + "self_attn.o_proj.weight": (h, self.n_heads * hd),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
            if bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (self.n_heads * hd,),
                    p + "self_attn.k_proj.bias": (self.n_kv * hd,),
                    p + "self_attn.v_proj.bias": (self.n_kv * hd,),
                }
        return shapes

    def check_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        """Raise ValueError unless `sd` holds exactly this model's tensors (a tied lm_head may be present)."""
        want = self.expected_shapes()
        extra = set(sd) - set(want) - {"lm_head.weight"}
        extra = {k for k in extra if not k.endswith("rotary_emb.inv_freq")}
        missing = set(want) - set(sd)
        if missing or extra:
            raise ValueError(
                f"weights do not fit the model: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
            )
        for k, shape in want.items():
            if tuple(sd[k].shape) != shape:
                raise ValueError(f"weights do not fit the model: {k} has shape {tuple(sd[k].shape)}, expected {shape}")

    def load_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        """Validate everything first, then swap: a bad checkpoint leaves the old weights in place."""
        self.check_state_dict(sd)
        new: dict[str, Tensor] = {}
        for k in self.expected_shapes():
            new[k] = sd[k].detach().to(self.dtype).contiguous()
        for n in range(self.n_layers):
            # One matmul for q/k/v and one for gate/up: fewer, larger GEMMs are faster on CPU.
            p = f"model.layers.{n}."
            a = p + "self_attn."
            new[p + "qkv"] = torch.cat(
                [new.pop(a + "q_proj.weight"), new.pop(a + "k_proj.weight"), new.pop(a + "v_proj.weight")]
            )
            if a + "q_proj.bias" in new:
                new[p + "qkv_bias"] = torch.cat(
                    [new.pop(a + "q_proj.bias"), new.pop(a + "k_proj.bias"), new.pop(a + "v_proj.bias")]
                )
            new[p + "gate_up"] = torch.cat([new.pop(p + "mlp.gate_proj.weight"), new.pop(p + "mlp.up_proj.weight")])
        if self.tied:
            new["lm_head.weight"] = new["model.embed_tokens.weight"]
        packed: dict[str, Tensor] = {}
        if self.pack_weights:
            for name in self._matrix_names():
                # Packed weights live only in packed form (a tied head's embedding stays, under its own name).
                packed[name] = packed_linear.pack(new.pop(name))
        # Own every tensor: safetensors maps files, and a weight directory may be rewritten in place later
        # (tasks/sync/disk.py), which must not change what this engine serves.
        loaded = {t.data_ptr() for t in sd.values()}
        new = {k: t.clone() if t.data_ptr() in loaded else t for k, t in new.items()}
        self.w, self.packed = new, packed

    def _matrix_names(self) -> list[str]:
        names = ["lm_head.weight"]
        for n in range(self.n_layers):
            p = f"model.layers.{n}."
            names += [p + "qkv", p + "self_attn.o_proj.weight", p + "gate_up", p + "mlp.down_proj.weight"]
        return names

    # ---------------------------------------------------------------------------------------------- forward
    def _linear(self, x: Tensor, name: str, bias: Tensor | None = None) -> Tensor:
        packed = self.packed.get(name)
        if self.row_blocks:
            if packed is not None:
                return stable_linear(x, packed, bias, packed_linear.linear)
            return stable_linear(x, self.w[name], bias)
        rows, single = single_row_safe(x)  # a lone decode row gets the bits the trainer's batch gives it
        out = packed_linear.linear(rows, packed, bias) if packed is not None else F.linear(rows, self.w[name], bias)
        return out[:1].reshape(*x.shape[:-1], out.size(-1)) if single else out

    def _rms(self, x: Tensor, weight: Tensor) -> Tensor:
        # torch's RMSNorm, as the trainer's megatron layers use it (torch.nn.RMSNorm): one rounding of the scaled
        # result. HF's Llama rounds the normalised x to bf16 before scaling: in bf16 that differed from the trainer
        # in a quarter of the elements and made a 0.06 per-token log-prob gap on SmolLM2 (issue 31).
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(self.dtype), (emb.sin() * self.rope_scaling).to(self.dtype)

    def _layer(self, n: int, x: Tensor, cos: Tensor, sin: Tensor, attend: Any) -> Tensor:
        p = f"model.layers.{n}."
        w = self.w
        b, t, _ = x.shape
        hd = self.head_dim
        h = self._rms(x, w[p + "input_layernorm.weight"])
        qkv = self._linear(h, p + "qkv", w.get(p + "qkv_bias"))
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_kv, hd).transpose(1, 2)
        v = v.view(b, t, self.n_kv, hd).transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        o = attend(n, q, k, v)  # [b, heads, t, hd]
        o = o.transpose(1, 2).reshape(b, t, self.n_heads * hd)
        x = x + self._linear(o, p + "self_attn.o_proj.weight")
        h = self._rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = self._linear(h, p + "gate_up").chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, p + "mlp.down_proj.weight")

    def _logits(self, x: Tensor) -> Tensor:
        x = self._rms(x, self.w["model.norm.weight"])
        if "lm_head.weight" in self.packed or self.row_blocks:
            return self._linear(x, "lm_head.weight").float()
        w = self.w["lm_head.weight"]
        if x.dim() == 2 and x.dtype == torch.float32:
            # fp32 on CPU: the vocabulary-major product is faster for the few rows of a decode step (SmolLM2's
            # 49152 x 576 head, copy included: 32 rows 31.6 -> 28.2 ms, 4 rows 19.7 -> 5.8 ms); in bf16 it is slower.
            return (w @ x.t()).t().contiguous()  # rows contiguous again for the sampler
        return F.linear(x, w).float()

    @torch.inference_mode()
    def forward_full(self, input_ids: Tensor) -> Tensor:
        """Causal forward of a [b, t] batch without a cache -> fp32 logits [b, t, vocab] (for checks)."""
        t = input_ids.shape[1]
        positions = torch.arange(t)[None].expand(input_ids.shape[0], t)
        cos, sin = self._cos_sin(positions)

        def attend(_n: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return attention(q, k, v, None, self.scale)

        x = F.embedding(input_ids, self.w["model.embed_tokens.weight"])
        for n in range(self.n_layers):
            x = self._layer(n, x, cos, sin, attend)
        return self._logits(x)

    @torch.inference_mode()
    def prefill(self, cache: SlotKVCache, first_slot: int, prompts: list[Tensor]) -> Tensor:
        """Run prompts into slots first_slot, first_slot+1, ... (positions 0..len-1) in one right-padded
        batch -> fp32 logits of each prompt's last position [n, vocab].

        Pad positions are written to the cache too; they lie beyond the row's length, where decode masks
        them until it overwrites them.
        """
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts])
        t = int(lens.max())
        ids = torch.zeros((n, t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        cos, sin = self._cos_sin(torch.arange(t)[None])
        mask = None
        if n > 1 and bool((lens != t).any()):
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            mask = causal[None] & (torch.arange(t)[None, None, :] < lens[:, None, None])
            mask |= torch.eye(t, dtype=torch.bool)[None]  # pad queries attend to themselves: no NaN rows
            mask = mask[:, None]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[layer, first_slot : first_slot + n, :, :t] = k
            cache.v[layer, first_slot : first_slot + n, :, :t] = v
            return attention(q, k, v, mask, self.scale)

        x = F.embedding(ids, self.w["model.embed_tokens.weight"])
        for layer in range(self.n_layers):
            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x[torch.arange(n), lens - 1])

    @torch.inference_mode()
    def decode(self, cache: SlotKVCache, tokens: Tensor, positions: Tensor) -> Tensor:
        """One token for each of the slots 0..b-1 at their own `positions` [b] -> fp32 logits [b, vocab].

        The running batch always occupies the first b slots (the scheduler compacts it), so the cache reads
        below are views, not gathers; each row attends to its own first `position + 1` entries.
        """
        b = tokens.shape[0]
        span = int(positions.max()) + 1
        if self.dtype != torch.float32:  # the explicit attention's padded span, read from the cache without a copy
            span = min(padded_span(span), cache.max_len)
        rows = torch.arange(b)
        cos, sin = self._cos_sin(positions[:, None])
        # Keys beyond a row's own length are stale or empty: mask them out per row.
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]

        def attend(n: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache.k[n, rows, :, positions] = k[:, :, 0]
            cache.v[n, rows, :, positions] = v[:, :, 0]
            kk = cache.k[n, :b, :, :span]
            vv = cache.v[n, :b, :, :span]
            return attention(q, kk, vv, mask, self.scale)

        x = F.embedding(tokens[:, None], self.w["model.embed_tokens.weight"])
        for n in range(self.n_layers):
            x = self._layer(n, x, cos, sin, attend)
        return self._logits(x[:, -1])
