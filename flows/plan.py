"""The memory plan of a layout: what a trainer rank and an engine hold, in bytes, against the memory there is.

`sluiceway plan [CONFIG] [flags]` prints it; `sluiceway run` (flows/preflight.py) refuses a layout it says cannot
fit, in one line, before anything starts. Formulas over the model's HF config.json only (no torch, no weights),
for the trainer as it is built here (models/megatron_gpt.py, tasks/train/trainer.py):

- weights: the model's parameters of this rank (tensor-parallel shards: embeddings, attention and MLP split over
  TP; norms replicated) at the compute width (bf16 2 bytes, fp32 4);
- fp32 master weights (bf16 only: with fp32 the parameters are the masters) and AdamW's two fp32 moments, 12 (or
  8) bytes a parameter, divided over the data-parallel group with the distributed optimizer (ZeRO-1);
- gradients: the compute width during backward (accumulated over micro-batches: from the second micro-batch of
  a step on, a backward runs with all of them held; with one micro-batch a step they appear as the activations
  are freed), fp32 at the optimizer step (bf16 grads become fp32 master grads); the step comes after the
  activations are freed, so the peak is the larger of the two phases;
- activations of one micro-batch (micro_batch_size rows of prompt + response tokens, or max_tokens_per_gpu packed):
  per layer and token, what autograd keeps for the layer's backward (norm inputs and outputs, q/k/v, the attention
  output, the SwiGLU's input, activation and product: `_layer_token_bytes`), plus the output layer's logits at the
  trained positions and their gradient; with recompute, what megatron's checkpointing keeps instead (a group's
  input per recompute group, and one group's activations recomputed at a time);
- a reference model (use_kl_loss / kl_coef) and an on-policy distillation teacher in the trainer (--opd-type
  megatron, its own config.json: it may be larger than the student) hold weights only; a PPO critic holds
  weights, grads and an optimizer;
- with --lora-rank the base weights are frozen (no gradients, masters or moments) and the fp32 adapters hold
  weights, gradients and AdamW's moments (r x (in + out) per adapted projection and layer); the reference of a KL
  loss is the base with the adapters off, so there is no reference model; activations are counted as without LoRA;
- each embedded engine holds its weights and a KV cache allocated whole when it starts: keys and values per layer,
  KV head and head dim, for max_running_requests x (prompt + response) tokens;
- each process holds its runtime (torch, megatron, Python: ~0.45 GiB resident measured for a trainer rank on this
  project's CPU build); a CUDA rank also holds its CUDA context on the device.

On CPU every trainer rank and embedded engine shares the machine's memory; with --device cuda each rank is
checked against its GPU's memory and the embedded engines (which run on the CPU) against the machine's.
docs/benchmarks.md compares the plan with measured peak memory (benchmarks/bench_plan.py): on CPU it is within a
few percent of the peak the tensors need, and 20-30% under the resident peak with glibc's default malloc, which
keeps freed memory of medium-sized tensors. Activations were measured on CPU; on CUDA the plan assumes torch's
fused RMSNorm and SDPA keep what their kernels document (not measured here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

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

    def lora_parameters(self, rank: int, targets: tuple[str, ...], tp: int = 1) -> int:
        """LoRA adapter parameters held by one TP rank: r x (in + out) per adapted projection and layer, the
        sharded factor (B of column-parallel, A of row-parallel projections) divided over TP (models/lora.py)."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip
        per_layer = 0
        for t in targets:
            fan_in, fan_out = dims[t]
            row_parallel = t in ("o_proj", "down_proj")
            per_layer += rank * (fan_in // tp + fan_out if row_parallel else fan_in + fan_out // tp)
        return self.layers * per_layer

    def kv_bytes_per_token(self, width: int) -> int:
        """KV cache bytes per token of a request (all layers, keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * width


def read_hf_config(source: str) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) for a path to a .json file, a model directory (or a run's
    weights root), or a zoo name (built once, as a run would)."""
    p = Path(source).expanduser()
    if p.is_file():
        try:
            hf = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{source}: cannot read it as a config.json ({e})") from None
        if not isinstance(hf, dict):
            raise UserError(f"{source}: expected a JSON object")
        return hf, str(p)
    from sluiceway.flows.preflight import check_model, model_config

    check_model(source, weights_root_ok=True)
    hf = model_config(source)
    if hf is None:
        raise UserError(f"--hf-checkpoint {source}: no readable config.json")
    return hf, source


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
    def from_config(cls, cfg: RunConfig, command: str = "run", bf16: bool | None = None) -> Layout:
        """The layout `cfg` runs for `command` (run, sft, replay: a trainer; eval: engines only); `bf16`
        overrides the config's precision (which may still be `auto`)."""
        from sluiceway.flows.preflight import engine_max_total_len

        res, t, r = cfg.resources, cfg.training, cfg.rollout
        if t.lora_rank:  # models/ imports torch: `sluiceway plan` without LoRA does not pay for it
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
            lora_rank=t.lora_rank,
            lora_targets=tuple(resolve_targets(t.target_modules)) if t.lora_rank else (),
            recompute=Recompute(t.recompute_granularity, t.recompute_method, t.recompute_num_layers),
            # With LoRA the reference is the base model with the adapters off: no second copy.
            reference=not t.lora_rank
            and (a.use_kl_loss or (a.advantage_estimator in ("ppo", "reinforce_plus_plus") and a.kl_coef > 0)),
            teacher=opd_teacher_shape(cfg) if command in ("run", "replay") else None,
            critic=a.advantage_estimator == "ppo" and a.loss_type != "sft_loss",
            engines=r.rollout_num_engines if starts_engines and r.rollout_engine == "embedded" else 0,
            engine_bf16=bf16,
            engine_requests=r.engine_max_running_requests,
            engine_total_len=engine_max_total_len(cfg),
            sglang_engines=r.rollout_num_engines if starts_engines and r.rollout_engine == "sglang" else 0,
        )


def opd_teacher_shape(cfg: RunConfig) -> ModelShape | None:
    """The teacher of --use-opd --opd-type megatron, from its config.json (None: no teacher in the trainer)."""
    a = cfg.algorithm
    if not (a.use_opd and a.opd_type == "megatron" and a.opd_teacher_load):
        return None
    try:
        hf, _ = read_hf_config(a.opd_teacher_load)
    except UserError as e:
        raise UserError(str(e).replace("--hf-checkpoint", "--opd-teacher-load", 1)) from None
    return ModelShape.from_hf(hf, f"--opd-teacher-load {a.opd_teacher_load}")


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
        return 1, seq, _ceil_div(seq * unit * response, width), True
    rows = _ceil_div(t.micro_batch_size, unit)
    return rows, width, t.micro_batch_size * response, shared


def micro_batches_per_step(cfg: RunConfig, command: str, seq: int, rows: int) -> int:
    """Micro-batches of one optimizer step on one data-parallel rank (at the longest lengths)."""
    t, res = cfg.training, cfg.resources
    dp = max(1, res.actor_num_gpus_per_node * res.actor_num_nodes // res.tensor_model_parallel_size)
    samples = _ceil_div(t.global_batch_size, dp)
    if t.max_tokens_per_gpu:
        sft = command == "sft" or cfg.algorithm.loss_type == "sft_loss"
        per_sample = cfg.data.sft_max_len if sft else cfg.rollout.rollout_max_response_len
        return _ceil_div(samples * per_sample, max(1, seq))
    return _ceil_div(samples, t.micro_batch_size)


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
            groups = _ceil_div(m.layers, n)
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


# ---------------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    label: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    model: ModelShape
    layout: Layout
    static: list[Item]  # per trainer rank, held throughout
    backward: list[Item]  # per trainer rank, during forward/backward of a micro-batch
    step: list[Item]  # per trainer rank, at the optimizer step
    alternative: Activations  # activations at the other recompute setting (none vs the configured or full)
    alternative_label: str
    engine: list[Item]  # per embedded engine
    sglang_kv: int = 0  # per SGLang engine: what its requests' KV needs (SGLang sizes its own cache)
    cpu_memory: int | None = None
    device_memory: int | None = None
    device_label: str = ""

    @property
    def rank_peak(self) -> int:
        if not self.layout.ranks:
            return 0
        return sum(i.bytes for i in self.static) + max(sum(i.bytes for i in self.backward),
                                                       sum(i.bytes for i in self.step))  # fmt: skip

    @property
    def engine_total(self) -> int:
        return sum(i.bytes for i in self.engine)

    @property
    def cpu_need(self) -> int:
        """What the machine's memory must hold: every trainer rank on CPU, and the embedded engines."""
        ranks = self.layout.ranks * self.rank_peak if self.layout.device == "cpu" else 0
        return ranks + self.layout.engines * self.engine_total

    def verdicts(self) -> list[tuple[str, int, int | None, str]]:
        """(what, needed, available, where) for each memory the layout is checked against."""
        out = []
        if self.layout.device == "cuda" and self.layout.ranks:
            out.append(("per GPU (one trainer rank)", self.rank_peak, self.device_memory, self.device_label))
        if self.cpu_need:
            out.append(("this machine's memory", self.cpu_need, self.cpu_memory, "CPU memory"))
        return out

    @property
    def fits(self) -> bool:
        return all(avail is None or need <= avail for _, need, avail, _ in self.verdicts())

    def summary(self) -> str:
        """One line: what does not fit, with the numbers (the run's refusal)."""
        lay = self.layout
        parts = []
        for what, need, avail, where in self.verdicts():
            if avail is None or need <= avail:
                continue
            if what.startswith("per GPU"):
                parts.append(f"a trainer rank needs {_gib(need)} ({self._rank_terms()}), more than the"
                             f" {_gib(avail)} of {where}")  # fmt: skip
            else:
                terms = []
                if lay.device == "cpu" and lay.ranks:
                    terms.append(f"{lay.ranks} trainer rank(s) x {_gib(self.rank_peak)} ({self._rank_terms()})")
                if lay.engines:
                    kv = next(i.bytes for i in self.engine if i.label.startswith("KV"))
                    terms.append(f"{lay.engines} engine(s) x {_gib(self.engine_total)} (KV cache {_gib(kv)})")
                parts.append(f"{' + '.join(terms)} = {_gib(need)}, more than this machine's {_gib(avail)} of memory")
        return f"memory plan for {self.model.name}: " + "; ".join(parts) + " (sluiceway plan for the breakdown)"

    def _rank_terms(self) -> str:
        by = {i.label.split(" (")[0]: i.bytes for i in self.static + self.backward + self.step}
        keys = ("weights", "fp32 master weights", "Adam moments", "gradients", "activations")
        return ", ".join(f"{k} {_gib(by[k])}" for k in keys if by.get(k))

    def render(self) -> str:
        m, lay = self.model, self.layout
        lines = [
            f"model: {m.name}: {m.parameters() / 1e9:.3f} B parameters, {m.layers} layers, hidden {m.hidden}, "
            f"{m.heads} heads ({m.kv_heads} KV) x {m.head_dim}, vocabulary {m.vocab}",
        ]
        if lay.ranks:
            lines.append(
                f"trainer: {lay.ranks} rank(s) on {lay.device} = TP {lay.tp} x DP {lay.dp}, "
                f"{'bf16 over fp32 masters' if lay.bf16 else 'fp32'}, micro-batch {lay.rows} x {lay.seq} tokens "
                f"({lay.loss_tokens} trained), {'distributed' if lay.distributed_optimizer else 'replicated'} "
                f"optimizer, {lay.recompute}"
            )
            lines.append(f"per trainer rank ({m.parameters(lay.tp) / 1e9:.3f} B parameters):")
            for i in self.static:
                lines.append(_row(i))
            lines.append("  during forward/backward of a micro-batch:")
            for i in self.backward:
                lines.append(_row(i, 4))
            alt = self.alternative
            lines.append(f"    ({self.alternative_label}: activations {_gib(alt.peak)}: {alt.detail})")
            lines.append("  at the optimizer step (activations freed):")
            for i in self.step:
                lines.append(_row(i, 4))
            lines.append(_row(Item("peak per rank", self.rank_peak, "held throughout + the larger phase")))
            if lay.device == "cpu":
                lines.append("  (tensors; resident memory under glibc's default malloc measured 20-30% more: "
                             "docs/benchmarks.md)")  # fmt: skip
        if lay.engines:
            lines.append(
                f"engines: {lay.engines} embedded (CPU), {'bf16' if lay.engine_bf16 else 'fp32'}, "
                f"{lay.engine_requests} requests x {lay.engine_total_len} tokens each:"
            )
            for i in self.engine:
                lines.append(_row(i))
        if lay.sglang_engines:
            lines.append(
                f"engines: {lay.sglang_engines} SGLang: their requests' KV needs {_gib(self.sglang_kv)} each "
                f"({lay.engine_requests} x {lay.engine_total_len} tokens; SGLang sizes its own cache)"
            )
        for what, need, avail, where in self.verdicts():
            if avail is None:
                lines.append(f"{what}: needs {_gib(need)}; {where or 'the memory there'} unknown (--available-gib)")
            else:
                verdict = "fits" if need <= avail else "DOES NOT FIT"
                lines.append(f"{what}: needs {_gib(need)} of {_gib(avail)} ({where}): {verdict}")
        return "\n".join(lines) + "\n"


def _ceil_div(a: int, b: int) -> int:
    """ceil(a / b) in integers: config values reach 2**63, whose products overflow a float."""
    return -(-a // b)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _row(i: Item, indent: int = 2) -> str:
    note = f"  {i.note}" if i.note else ""
    return f"{' ' * indent}{i.label:<{44 - indent}}{i.bytes / GIB:>10.3f} GiB{note}"


def plan(
    hf: dict,
    layout: Layout,
    name: str = "model",
    cpu_memory: int | None = None,
    device_memory: int | None = None,
    device_label: str = "",
) -> MemoryPlan:
    """The memory plan of `layout` for the model of `hf` (its config.json). Memories: None is unknown."""
    m = ModelShape.from_hf(hf, name)
    lay = layout
    m.check_tp(lay.tp)
    if lay.ranks and lay.ranks % lay.tp:
        raise UserError(f"{lay.ranks} trainer ranks are not a multiple of tensor_model_parallel_size {lay.tp}")
    w = 2 if lay.bf16 else 4
    p = m.parameters(lay.tp)
    shard = lay.dp if lay.distributed_optimizer and lay.dp > 1 else 1
    over = f" / DP {shard}" if shard > 1 else ""
    static = [Item(f"weights ({'bf16' if lay.bf16 else 'fp32'})", p * w, f"{p:,} x {w} B")]
    if lay.lora_rank:  # the base is frozen: the adapters are the only trained (and optimizer) state, all fp32
        p = m.lora_parameters(lay.lora_rank, lay.lora_targets, lay.tp)
        static.append(Item("LoRA adapters (fp32)", p * 4, f"{p:,} x 4 B, rank {lay.lora_rank}"))
    elif lay.bf16:
        static.append(Item("fp32 master weights", _ceil_div(p, shard) * 4, f"{p:,} x 4 B{over}"))
    static.append(Item("Adam moments (fp32 m, v)", _ceil_div(p, shard) * 8, f"{p:,} x 8 B{over}"))
    if lay.reference:
        static.append(Item("reference model (weights)", p * w, "use_kl_loss / kl_coef"))
    if lay.teacher is not None:
        lay.teacher.check_tp(lay.tp)
        pt = lay.teacher.parameters(lay.tp)
        static.append(Item("OPD teacher (weights)", pt * w, f"{pt:,} x {w} B, --opd-type megatron"))
    if lay.critic:
        pc = m.parameters(lay.tp, lm_head=False)
        crit = pc * w + (_ceil_div(pc, shard) * 4 if lay.bf16 else 0) + _ceil_div(pc, shard) * 8 + pc * 4
        static.append(Item("critic (weights, grads, optimizer)", crit, "ppo's value model"))
    if lay.device == "cuda":  # the process's own resident memory is the host's, not the GPU's
        static.append(Item("CUDA context", CUDA_CONTEXT, "typical"))
    else:
        static.append(Item("runtime (torch, megatron)", PROCESS_RUNTIME, "resident, per process"))
    act = activation_bytes(m, lay)
    if lay.lora_rank:
        grads = Item("gradients (LoRA adapters, fp32)", p * 4, "the frozen base has none")
    elif lay.micro_batches > 1:
        grads = Item(f"gradients ({'bf16' if lay.bf16 else 'fp32'})", p * w,
                     f"accumulated over {lay.micro_batches} micro-batches")  # fmt: skip
    else:  # one micro-batch a step: gradients appear as backward frees the activations, the output layer's first
        grads = Item(
            f"gradients ({'bf16' if lay.bf16 else 'fp32'})",
            m.vocab // lay.tp * m.hidden * w,
            "one micro-batch a step: the output layer's first, the rest as activations are freed",
        )
    backward = [grads, Item("activations", act.peak, act.detail)]
    step = [Item("gradients (fp32, at the step)", p * 4, "master grads" if lay.bf16 and not lay.lora_rank else "")]
    if lay.recompute.granularity is None:
        alt_rc, alt_label = FULL_RECOMPUTE, "with --recompute-granularity full"
    else:
        alt_rc, alt_label = Recompute(), "without recompute"
    alternative = activation_bytes(m, lay, alt_rc)
    we = 2 if lay.engine_bf16 else 4
    total_len = lay.engine_total_len
    engine = [
        Item(f"weights ({'bf16' if lay.engine_bf16 else 'fp32'})", m.parameters() * we),
        Item("KV cache", m.kv_bytes_per_token(we) * total_len * lay.engine_requests,
             f"{lay.engine_requests} x {total_len} tokens x {m.kv_bytes_per_token(we):,} B"),
        Item("runtime", PROCESS_RUNTIME),
    ]  # fmt: skip
    sglang_kv = m.kv_bytes_per_token(2) * total_len * lay.engine_requests
    return MemoryPlan(m, lay, static, backward, step, alternative, alt_label, engine, sglang_kv,
                      cpu_memory, device_memory, device_label)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The memory there is
# ---------------------------------------------------------------------------------------------------------------------


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_memory() -> tuple[int | None, str]:
    """(bytes, name) of GPU 0, from nvidia-smi (no torch import), else torch if CUDA is there; (None, "") if
    neither knows."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
            total, name = out.splitlines()[0].split(",", 1)
            return int(float(total)) * 2**20, name.strip()
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), props.name
    except ImportError:
        pass
    return None, ""


def plan_for_config(
    cfg: RunConfig,
    command: str = "run",
    hf: dict | None = None,
    available_gib: float | None = None,
    bf16: bool | None = None,
) -> MemoryPlan:
    """The plan of the run `cfg` describes; `available_gib` replaces the memory found here (the GPU's with
    --device cuda, else the machine's)."""
    source = cfg.training.hf_checkpoint
    name = source
    if hf is None:
        hf, name = read_hf_config(source)
    lay = Layout.from_config(cfg, command, bf16)
    cpu, gpu, label = machine_memory(), None, ""
    if lay.device == "cuda":
        gpu, label = gpu_memory()
        label = label or "the GPU"
    if available_gib is not None:
        if lay.device == "cuda":
            gpu, label = int(available_gib * GIB), "--available-gib"
        else:
            cpu = int(available_gib * GIB)
    return plan(hf, lay, name, cpu, gpu, label)


def check_fits(cfg: RunConfig, hf: dict, command: str) -> None:
    """Refuse (UserError, one line) a layout that cannot fit. `precision auto` is checked at whichever of bf16
    and fp32 takes less, since the choice is made later."""
    if cfg.training.precision == "auto":
        plans = [plan_for_config(cfg, command, hf, bf16=b) for b in (True, False)]
    else:
        plans = [plan_for_config(cfg, command, hf)]
    if any(p.fits for p in plans):
        return
    best = min(plans, key=lambda p: max((need - (avail or need)) for _, need, avail, _ in p.verdicts()))
    raise UserError(best.summary())


def print_plan(cfg: RunConfig, available_gib: float | None = None) -> int:
    """`sluiceway plan`: print the plan of the run `cfg` describes; 0 if it fits, 1 if not."""
    t = cfg.training
    bf16, note = None, ""
    if t.precision == "auto":
        if cfg.resources.device == "cuda":  # planned for the GPU the layout names, not for this machine
            bf16, note = True, "auto: planned as bf16 (what a GPU with native bf16 computes in)"
        else:
            from sluiceway.infra.precision import choose

            choice = choose("auto", "cpu")
            bf16, note = choice.bf16, choice.reason
    command = "sft" if cfg.algorithm.loss_type == "sft_loss" else "run"
    p = plan_for_config(cfg, command, available_gib=available_gib, bf16=bf16)
    if note:
        print(f"precision: {'bf16' if bf16 else 'fp32'} ({note})")
    print(p.render(), end="")
    return 0 if p.fits else 1
