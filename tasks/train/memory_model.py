"""What the memory plan (tasks/train/memory_plan.py) knows of a run before anything is built: the model's
shape from its HF config.json, the layout of the trainer ranks and engines a config asks for, the largest
micro-batch the trainer lays out, and the activations autograd keeps for one micro-batch (or what recompute keeps
instead). Formulas only: no torch, no weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError

GIB = 2**30
# Resident memory of a process after importing torch, megatron-core and the trainer (0.43 GiB measured for a
# trainer rank on this project's torch CPU build); an engine process is of the same order.
PROCESS_RUNTIME = int(0.45 * GIB)
# A CUDA context and its kernels on the device (typical for a recent torch on an H100, order of magnitude).
CUDA_CONTEXT = int(0.75 * GIB)
# models/megatron_gpt.py: on CPU in bf16, attention with fewer scores than this is an explicit product whose
# softmax is kept (fp32, plus its bf16 copy); otherwise SDPA's flash kernel keeps only its output.
EXPLICIT_ATTENTION_MAX_SCORES = 1 << 22


# ---------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of an HF Llama / Qwen2 / Qwen3 config.json."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    max_positions: int | None = None

    @classmethod
    def from_hf(cls, hf: dict, name: str = "model") -> ModelShape:
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            model_type = hf.get("model_type", "llama")
            return cls(
                name=name,
                vocab=int(hf["vocab_size"]),
                hidden=hidden,
                layers=int(hf["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                ffn=int(hf["intermediate_size"]),
                tied=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2",
                qk_norm=model_type == "qwen3",
                max_positions=hf.get("max_position_embeddings"),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise UserError(f"{name}: not a Llama/Qwen-style config.json ({type(e).__name__}: {e})") from None

    def check_tp(self, tp: int) -> None:
        for what, n in (("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads),
                        ("intermediate_size", self.ffn), ("vocab_size", self.vocab)):  # fmt: skip
            if n % tp:
                raise UserError(f"{self.name}: {what} {n} is not divisible by tensor_model_parallel_size {tp}")

    def parameters(self, tp: int = 1, lm_head: bool = True) -> int:
        """Parameters held by one tensor-parallel rank (all of them at tp=1); `lm_head` False: a value model's
        (the output layer is a [1, hidden] head)."""
        h, d = self.hidden, self.head_dim
        a, g = self.heads // tp, self.kv_heads // tp
        attn = h * a * d + 2 * h * g * d + a * d * h
        attn += (a + 2 * g) * d if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0  # q_norm, k_norm: [head_dim], replicated
        layer = attn + 3 * h * (self.ffn // tp) + 2 * h  # gate, up, down; two RMSNorms
        embed = self.vocab // tp * h
        head = (0 if self.tied else embed) if lm_head else h
        return embed + head + self.layers * layer + h

    def kv_bytes_per_token(self, width: int) -> int:
        """KV cache bytes per token of a request (all layers, keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * width


# ---------------------------------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recompute:
    granularity: str | None = None  # full | selective
    method: str | None = None  # uniform | block (full)
    num_layers: int | None = None

    def __str__(self) -> str:
        if self.granularity is None:
            return "no recompute"
        if self.granularity == "selective":
            return "selective recompute (core attention)"
        return f"full recompute, {self.method or 'uniform'} {self.num_layers or 1}"


FULL_RECOMPUTE = Recompute("full", "uniform", 1)


@dataclass(frozen=True)
class Layout:
    device: str = "cpu"
    ranks: int = 1  # trainer processes
    tp: int = 1
    bf16: bool = False
    rows: int = 1  # rows of one micro-batch
    seq: int = 288  # tokens of the longest row
    loss_tokens: int = 32  # positions of one micro-batch whose logits are computed (the trained ones)
    masked: bool = False  # rows laid out with an attention mask (shared prompts, packing)
    micro_batches: int = 2  # per optimizer step on a rank: above 1, a backward runs with every gradient held
    distributed_optimizer: bool = False
    lora_rank: int = 0  # --lora-rank: only adapters train (fp32 weights, grads, moments); no reference model
    lora_targets: tuple[str, ...] = ()
    recompute: Recompute = field(default_factory=Recompute)
    reference: bool = False
    teacher: ModelShape | None = None  # --use-opd --opd-type megatron: the frozen teacher in every trainer rank
    critic: bool = False
    engines: int = 0  # embedded engines (CPU)
    engine_bf16: bool = False
    engine_requests: int = 64
    engine_total_len: int = 288
    sglang_engines: int = 0

    @property
    def dp(self) -> int:
        return self.ranks // self.tp

    @classmethod
    def from_config(cls, cfg: RunConfig, command: str, bf16: bool | None, teacher: ModelShape | None,
                    engine_total_len: int) -> Layout:  # fmt: skip
        """The layout `cfg` runs for `command` (run, sft, replay: a trainer; eval: engines only); `bf16`
        overrides the config's precision (which may still be `auto`). `teacher`: the OPD teacher the trainer
        holds (--opd-type megatron), from its own config.json; `engine_total_len`: tokens per request the
        engines are sized for."""
        res, t, r = cfg.resources, cfg.training, cfg.rollout
        lora = t.lora
        if lora is not None:  # models/ imports torch: `sluiceway plan` without LoRA does not pay for it
            from sluiceway.models.lora import resolve_targets
        a = cfg.algorithm
        bf16 = bool(t.bf16) if bf16 is None else bf16
        command = "sft" if a.loss_type == "sft_loss" else command
        rows, seq, loss, masked = micro_batch_shape(cfg, command)
        trains = command in ("run", "sft", "replay")
        starts_engines = command in ("run", "eval") and r.rollout_num_engines > 0
        return cls(
            device=res.device,
            ranks=res.actor_num_gpus_per_node * res.actor_num_nodes if trains else 0,
            tp=res.tensor_model_parallel_size,
            bf16=bf16,
            rows=rows,
            seq=seq,
            loss_tokens=loss,
            masked=masked,
            micro_batches=micro_batches_per_step(cfg, command, seq, rows),
            distributed_optimizer=t.use_distributed_optimizer,
            lora_rank=lora.rank if lora is not None else 0,
            lora_targets=tuple(resolve_targets(lora.target_modules)) if lora is not None else (),
            recompute=Recompute(t.recompute_granularity, t.recompute_method, t.recompute_num_layers),
            # With LoRA the reference is the base model with the adapters off: no second copy.
            reference=lora is None
            and (a.use_kl_loss or (a.advantage_estimator in ("ppo", "reinforce_plus_plus") and a.kl_coef > 0)),
            teacher=teacher if command in ("run", "replay") else None,
            critic=a.advantage_estimator == "ppo" and a.loss_type != "sft_loss",
            engines=r.rollout_num_engines if starts_engines and r.rollout_engine == "embedded" else 0,
            engine_bf16=bf16,
            engine_requests=r.engine_max_running_requests,
            engine_total_len=engine_total_len,
            sglang_engines=r.rollout_num_engines if starts_engines and r.rollout_engine == "sglang" else 0,
        )


def micro_batch_shape(cfg: RunConfig, command: str = "run") -> tuple[int, int, int, bool]:
    """(rows, tokens per row, trained positions, attention mask?) of the largest micro-batch the trainer lays out
    (tasks/train/micro_batches.py) for samples of the longest length the config allows.

    Without packing a micro-batch holds micro_batch_size samples; RL runs with share_prompts lay one prompt's
    samples out in one row (the prompt once, then each response; a mask keeps them apart), at most
    micro_batch_size of them: a full group's worth per row, as a whole GRPO batch gives. With max_tokens_per_gpu
    (packing) a micro-batch is one row of up to that many tokens (a longer sample gets a row of its own).
    """
    t, r = cfg.training, cfg.rollout
    if command == "sft" or cfg.algorithm.loss_type == "sft_loss":
        prompt, response, unit = 0, cfg.data.sft_max_len, 1
    else:
        prompt, response = r.rollout_max_prompt_len, r.rollout_max_response_len
        unit = min(r.n_samples_per_prompt, t.micro_batch_size) if t.share_prompts else 1
    if t.max_tokens_per_gpu:
        while unit > 1 and prompt + unit * response > t.max_tokens_per_gpu:
            unit -= 1
    shared = unit > 1
    width = (prompt if shared else 0) + unit * (response if shared else prompt + response)
    if t.max_tokens_per_gpu:
        seq = max(t.max_tokens_per_gpu, width)
        return 1, seq, ceil_div(seq * unit * response, width), True
    rows = ceil_div(t.micro_batch_size, unit)
    return rows, width, t.micro_batch_size * response, shared


def micro_batches_per_step(cfg: RunConfig, command: str, seq: int, rows: int) -> int:
    """Micro-batches of one optimizer step on one data-parallel rank (at the longest lengths)."""
    t, res = cfg.training, cfg.resources
    dp = max(1, res.actor_num_gpus_per_node * res.actor_num_nodes // res.tensor_model_parallel_size)
    samples = ceil_div(t.global_batch_size, dp)
    if t.max_tokens_per_gpu:
        sft = command == "sft" or cfg.algorithm.loss_type == "sft_loss"
        per_sample = cfg.data.sft_max_len if sft else cfg.rollout.rollout_max_response_len
        return ceil_div(samples * per_sample, max(1, seq))
    return ceil_div(samples, t.micro_batch_size)


# ---------------------------------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------------------------------


def _explicit_attention(m: ModelShape, lay: Layout) -> bool:
    """Whether attention is models/megatron_gpt.py's explicit product (CPU, bf16, few scores) rather than SDPA."""
    return (
        lay.device == "cpu"
        and lay.bf16
        and lay.rows * (m.heads // lay.tp) * lay.seq**2 <= EXPLICIT_ATTENTION_MAX_SCORES
    )


def _layer_token_bytes(m: ModelShape, lay: Layout, selective: bool) -> int:
    """Bytes autograd keeps per token for one transformer layer's backward (this TP rank's share), as measured
    with saved-tensor hooks on this trainer's layers on CPU (tests/unit/flows/test_plan.py checks the sum).

    On CPU each RMSNorm (torch's composite) keeps an fp32 copy of its input and its fp32 normalised value
    (whatever the compute dtype); on CUDA torch's fused kernel keeps the input and the fp32 rstd (not measured
    here); the next linear keeps the norm's output. SDPA keeps q (after RoPE), k and v as it got them (repeated
    to every query head under GQA), its output, which the output projection keeps as its input, and the row
    log-sum-exp; the explicit bf16 attention keeps q, k, v and the projection's input, and its softmax
    (`_layer_sequence_bytes`). Where v reaches attention as a view of the fused qkv output (no GQA repeat), or
    Qwen3's k norm keeps a view of it (fp32, or CUDA's fused norm), the whole fused output stays; those norms
    also keep their normalised q and k, and their inputs (q's reshaped copy; on CPU in bf16, fp32 copies of q and
    k). SwiGLU keeps fc1's output (gate and up), silu's output, the up half plus its offset, and their product
    (fc2's input). Selective recompute keeps the core attention's inputs (q, k after RoPE and the fused qkv
    output v is a view of) instead of what attention keeps.
    """
    width, tp = (2 if lay.bf16 else 4), lay.tp
    h, d, f = m.hidden, m.head_dim, m.ffn // tp
    a, g = m.heads // tp, m.kv_heads // tp
    fused_norm = lay.device == "cuda"
    repeated = a != g
    fused = (a + 2 * g) * d
    if fused_norm:
        norms = 2 * (2 * h * width + 4)  # input, output (the next linear's input), fp32 rstd
    else:
        norms = 2 * (2 * h * 4 + h * width + 4)  # fp32 input and normalised value, the output, the fp32 rstd
    keeps_fused = not repeated or (m.qk_norm and (width == 4 or fused_norm))
    if selective:
        attn = (a * d + g * d + fused + a * d) * width  # + the output (computed again in backward)
    else:
        elems = a * d + (a * d if repeated else g * d) + (a * d if repeated else 0)  # q, k, v
        elems += fused if keeps_fused else 0
        attn = (elems + a * d) * width + (0 if _explicit_attention(m, lay) else a * 4)  # + output; log-sum-exp
    if m.qk_norm and fused_norm:  # q's reshaped copy, rstd (k's input is a view of the fused output)
        attn += a * d * width + (a + g) * 4
    elif m.qk_norm:  # fp32 normalised q, k and rstd; inputs: q's reshaped copy (fp32), fp32 copies of both (bf16)
        attn += (a + g) * (d * 4 + 4) + (a * d * 4 if width == 4 else (a + g) * d * 4)
    return norms + attn + 5 * f * width


def _layer_sequence_bytes(m: ModelShape, lay: Layout, width: int, selective: bool) -> int:
    """Per layer, what does not grow with the tokens: RoPE's cos and sin (both kept twice); and what grows with the
    square of the row: with the explicit attention (models/megatron_gpt.py, CPU bf16) its fp32 softmax, the
    softmax's bf16 copy and the (causal, and laid-out rows') mask; with SDPA and laid-out rows, the mask SDPA
    keeps in the compute dtype. Selective recompute keeps none of them."""
    rope = 4 * lay.seq * m.head_dim * width
    if selective:
        return rope
    if _explicit_attention(m, lay):
        return (
            rope
            + lay.rows * (m.heads // lay.tp) * lay.seq**2 * (4 + width)
            + (lay.rows if lay.masked else 1) * lay.seq**2
        )
    return rope + (lay.rows * lay.seq**2 * width if lay.masked else 0)


@dataclass(frozen=True)
class Activations:
    saved: int  # kept through forward for backward
    peak: int  # the most at once in backward (saved plus the logits' gradient, or a recomputed group)
    detail: str


def activation_bytes(m: ModelShape, lay: Layout, recompute: Recompute | None = None) -> Activations:
    """Activation bytes of one micro-batch on one rank, at `recompute` (default: the layout's)."""
    rc = lay.recompute if recompute is None else recompute
    w = 2 if lay.bf16 else 4
    tokens = lay.rows * lay.seq
    selective = rc.granularity == "selective"
    per_layer = tokens * _layer_token_bytes(m, lay, selective)
    per_layer += _layer_sequence_bytes(m, lay, w, selective)
    boundary = tokens * m.hidden * w  # a layer's input: what full recompute keeps of a layer or group
    # The final norm (fp32 input copy, normalised value, rstd), and the output layer's input at the trained
    # positions only; logits at those positions (the fused log-prob keeps only them, in the compute dtype; under
    # TP an fp32 copy of this rank's vocabulary shard), and their gradient in backward.
    head = tokens * ((m.hidden * w if lay.device == "cuda" else 8 * m.hidden) + 4) + lay.loss_tokens * m.hidden * w
    head += tokens * 8 + lay.seq * m.head_dim * 4  # the token ids, RoPE's table
    head += lay.rows * lay.seq**2 if lay.masked else 0  # the rows' attention mask (bool)
    logits = lay.loss_tokens * (m.vocab // lay.tp) * (w if lay.tp == 1 else 4)
    if rc.granularity == "full":
        n = min(rc.num_layers or 1, m.layers)
        if (rc.method or "uniform") == "uniform":
            groups = ceil_div(m.layers, n)
            saved_layers = groups * boundary
            recomputing = n * per_layer  # one group's activations, rebuilt in backward
        else:  # block: the first n layers recomputed one at a time, the rest keep everything
            saved_layers = n * boundary + (m.layers - n) * per_layer
            recomputing = per_layer
        saved = saved_layers + head + logits
        peak = max(saved + logits, saved_layers + recomputing)
        detail = f"{saved_layers / GIB:.2f} GiB kept by the layers, {recomputing / GIB:.2f} GiB recomputed at a time"
    else:
        saved = m.layers * per_layer + head + logits
        peak = saved + logits
        detail = f"{per_layer / GIB:.3f} GiB a layer"
    return Activations(saved, peak, detail + f", logits {logits / GIB:.2f} GiB")


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) in integers: config values reach 2**63, whose products overflow a float."""
    return -(-a // b)
