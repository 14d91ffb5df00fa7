"""The memory plan of a layout: what a trainer rank and an engine hold, in bytes, against the memory there is.

`sluiceway plan [CONFIG] [flags]` prints it; `sluiceway run` refuses a layout it says cannot fit, in one line,
before anything starts (both through flows/preflight.py, which reads the config.json files). Formulas over the
model's HF config.json only (no torch, no weights; the model's shape, the layout and the activations are in
memory_model.py), for the trainer as it is built here (models/megatron_gpt.py, tasks/train/trainer.py). What a
trainer component holds is its own answer, asked without building it: what trains and whether it has fp32 masters
(model_transform.planned_training, LoRA's adapter count from models/lora.py), the optimizer's state per rank
(optim.state_bytes_per_rank), the OPD teacher (opd.DistillationTerm.trainer_bytes):

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

import os
import shutil
import subprocess
from dataclasses import dataclass

from sluiceway.infra.errors import UserError
from sluiceway.tasks.train.memory_model import (
    CUDA_CONTEXT,
    FULL_RECOMPUTE,
    GIB,
    PROCESS_RUNTIME,
    Activations,
    Layout,
    ModelShape,
    Recompute,
    activation_bytes,
)
from sluiceway.tasks.train.model_transform import planned_training
from sluiceway.tasks.train.opd import DistillationTerm
from sluiceway.tasks.train.optim import MASTER_BYTES, MOMENT_BYTES, state_bytes_per_rank

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
    # What trains (every weight, or LoRA's adapters on a frozen base) is the model transform's answer, the state
    # its optimizer keeps the optimizer's (tasks/train/model_transform.py, optim.py).
    trained = planned_training(hf, lay.lora_rank, lay.lora_targets, p, lay.bf16, lay.tp)
    t, tw = trained.parameters, trained.width
    masters, moments = state_bytes_per_rank(t, trained.separate_masters, shard)
    static = [Item(f"weights ({'bf16' if lay.bf16 else 'fp32'})", p * w, f"{p:,} x {w} B")]
    if lay.lora_rank:  # the base is frozen: the adapters are the only trained (and optimizer) state, all fp32
        static.append(Item("LoRA adapters (fp32)", t * tw, f"{t:,} x {tw} B, rank {lay.lora_rank}"))
    if trained.separate_masters:
        static.append(Item("fp32 master weights", masters, f"{t:,} x {MASTER_BYTES} B{over}"))
    static.append(Item("Adam moments (fp32 m, v)", moments, f"{t:,} x {MOMENT_BYTES} B{over}"))
    if lay.reference and trained.reference_bytes:
        static.append(Item("reference model (weights)", trained.reference_bytes, "use_kl_loss / kl_coef"))
    if lay.teacher is not None:
        lay.teacher.check_tp(lay.tp)
        pt = lay.teacher.parameters(lay.tp)
        static.append(Item("OPD teacher (weights)", DistillationTerm.trainer_bytes(pt, w),
                           f"{pt:,} x {w} B, --opd-type megatron"))  # fmt: skip
    if lay.critic:  # the value model trains every weight, with the policy's optimizer
        pc = m.parameters(lay.tp, lm_head=False)
        crit = pc * w + sum(state_bytes_per_rank(pc, lay.bf16, shard)) + pc * 4
        static.append(Item("critic (weights, grads, optimizer)", crit, "ppo's value model"))
    if lay.device == "cuda":  # the process's own resident memory is the host's, not the GPU's
        static.append(Item("CUDA context", CUDA_CONTEXT, "typical"))
    else:
        static.append(Item("runtime (torch, megatron)", PROCESS_RUNTIME, "resident, per process"))
    act = activation_bytes(m, lay)
    if lay.lora_rank:
        grads = Item("gradients (LoRA adapters, fp32)", t * tw, "the frozen base has none")
    elif lay.micro_batches > 1:
        grads = Item(f"gradients ({'bf16' if lay.bf16 else 'fp32'})", t * tw,
                     f"accumulated over {lay.micro_batches} micro-batches")  # fmt: skip
    else:  # one micro-batch a step: gradients appear as backward frees the activations, the output layer's first
        grads = Item(
            f"gradients ({'bf16' if lay.bf16 else 'fp32'})",
            m.vocab // lay.tp * m.hidden * w,
            "one micro-batch a step: the output layer's first, the rest as activations are freed",
        )
    backward = [grads, Item("activations", act.peak, act.detail)]
    step = [Item("gradients (fp32, at the step)", t * 4, "master grads" if trained.separate_masters else "")]
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
