"""Per-token log-prob and entropy from full-vocabulary logits, without a full-size fp32 tensor.

The straightforward way (`logits.float()`, `log_softmax`, `gather`, entropy from the log-probs) makes three or
four fp32 copies of the logits and keeps one for backward: with SmolLM2's 49k vocabulary that is ~200 MB a
micro-batch on the trainer's hot path, and on CPU about a tenth of a training step goes to moving it around.

Here rows go through in chunks: forward keeps two floats a row (the log-normaliser and the entropy), backward
recomputes each chunk's softmax from them. Two forms:

- `TokenLogProbEntropy` takes logits the output layer made (kept for backward in their own dtype). On CPU its
  chunks stay in cache (32 rows); on a GPU they are sized for the device (`chunk_rows`): 32-row chunks made 256
  chunks of small kernels per micro-batch on an H100, 1.2 s of host time a 1.5B step (issue 44).
- `LinearTokenLogProbEntropy` takes the hidden states and the output layer's weight and makes each chunk's
  logits itself, forward and again in backward, so neither the [tokens, vocab] logits nor their gradient exist
  whole (2 x 2.2 GB a micro-batch for a 152k vocabulary at 7k tokens); the cost is the output layer's product
  once more. The trainer takes it on CUDA (models/megatron_logprobs.py, `logprobs_at`).

On CUDA each chunk's softmax arithmetic runs as one or two fused kernels (`torch.compile` of `_chunk_stats` and
`_chunk_grad`) instead of about ten passes over fp32 copies; where compiling fails, the same functions run eagerly.
On CPU nothing changes: the eager in-place path below, whose numbers the embedded engine shares (issue 31).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluiceway.models.batch_invariant import row_sums

log = logging.getLogger("sluiceway")

# Rows per chunk on CPU: 32 x 49k fp32 is 6 MiB, which stays in cache (on CPU 2x faster than 256 rows).
CHUNK_ROWS = 32
# Elements per chunk on a GPU (logits rows x vocabulary): no cache to fit, so chunks big enough that each kernel
# and matrix product fills the device, small enough that a chunk's temporaries stay ~1 GiB (768 rows of a 152k
# vocabulary, 2,688 of 49k). On the 1.5B shape of issue 44, 512-row chunks took a step from 2,352 to 2,070 ms.
DEVICE_CHUNK_ELEMENTS = 1 << 27


def chunk_rows(device: torch.device, vocab: int) -> int:
    """Rows per chunk on `device` for a `vocab`-wide row: CHUNK_ROWS on CPU; on GPUs a multiple of 128 (the
    matrix products' tile) near DEVICE_CHUNK_ELEMENTS / vocab."""
    if device.type == "cpu":
        return CHUNK_ROWS
    return max(128, DEVICE_CHUNK_ELEMENTS // max(vocab, 1) // 128 * 128)


class TokenLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per row of `logits` [N, V] at `temperature`, both fp32 [N].

    d logp_t / dx_j = 1[j = t] - p_j and dH / dx_j = -p_j (log p_j + H), with x = logits / temperature.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        n = logits.size(0)
        step = chunk_rows(logits.device, logits.size(-1))
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy, log_norm = torch.empty_like(logp), torch.empty_like(logp)
        fused = _fused_kernels(logits.device)
        for a in range(0, n, step):
            rows = slice(a, a + step)
            if fused is not None:
                logp[rows], entropy[rows], log_norm[rows] = fused[0](logits[rows], targets[rows], temperature)
                continue
            x = _scaled_fp32(logits[rows], temperature)
            logp[rows], top, e, z, log_z = _target_logprob(x, targets[rows])
            entropy[rows] = log_z - e.mul_(x).sum(-1) / z  # H = log Z - sum_j p_j x_j (shifted x)
            log_norm[rows] = top.squeeze(-1) + log_z
        ctx.save_for_backward(logits, targets, log_norm, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) costs nothing in backward
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, None, None]:
        if g_logp is None and g_entropy is None:
            return None, None, None
        logits, targets, log_norm, entropy = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        step = chunk_rows(logits.device, logits.size(-1))
        fused = _fused_kernels(logits.device)
        if fused is not None:
            g_logp, g_entropy = _zeros_for_none(g_logp, g_entropy)
            for a in range(0, logits.size(0), step):
                rows = slice(a, a + step)
                grad[rows] = fused[1](logits[rows], targets[rows], log_norm[rows], entropy[rows], g_logp[rows],
                                      g_entropy[rows], t, logits.dtype)  # fmt: skip
            return grad, None, None
        for a in range(0, logits.size(0), step):
            rows = slice(a, a + step)
            logp_all = _scaled_fp32(logits[rows], t).sub_(log_norm[rows].unsqueeze(-1))
            p = torch.exp(logp_all)
            if g_entropy is not None:
                g = logp_all.add_(entropy[rows].unsqueeze(-1)).mul_(p).mul_(-g_entropy[rows].unsqueeze(-1))
                if g_logp is not None:
                    g.addcmul_(p, g_logp[rows].unsqueeze(-1), value=-1.0)
            else:
                g = p.mul_(-g_logp[rows].unsqueeze(-1))
            if g_logp is not None:
                g.scatter_add_(-1, targets[rows].unsqueeze(-1), g_logp[rows].unsqueeze(-1))
            if t != 1.0:
                g.div_(t)
            grad[rows] = g
        return grad, None, None


class LinearTokenLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) fp32 [N] of softmax(hidden @ weight^T / temperature): `hidden` [N, H] (the output
    layer's input), `weight` [V, H] (the output layer's, or the tied embedding's). Chunks of rows make their
    logits, use them and drop them, in forward and again in backward; the weight's gradient sums the chunks' in
    fp32 (as the one product over all rows would accumulate them) and comes back in the weight's dtype.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        n = hidden.size(0)
        step = chunk_rows(hidden.device, weight.size(0))
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, log_norm = torch.empty_like(logp), torch.empty_like(logp)
        stats = _chunk_kernels(hidden.device)[0]
        for a in range(0, n, step):
            rows = slice(a, a + step)
            logp[rows], entropy[rows], log_norm[rows] = stats(F.linear(hidden[rows], weight), targets[rows],
                                                              temperature)  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, log_norm, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        if g_logp is None and g_entropy is None:
            return None, None, None, None
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        g_logp, g_entropy = _zeros_for_none(g_logp, g_entropy)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        step = chunk_rows(hidden.device, weight.size(0))
        grad_fn = _chunk_kernels(hidden.device)[1]
        for a in range(0, hidden.size(0), step):
            rows = slice(a, a + step)
            h = hidden[rows]
            g = grad_fn(F.linear(h, weight), targets[rows], log_norm[rows], entropy[rows], g_logp[rows],
                        g_entropy[rows], ctx.temperature, hidden.dtype)  # fmt: skip
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight = _accumulate_product(grad_weight, g.t(), h)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None


_FP32_OUT_PRODUCT: list[bool] = []  # whether addmm's out_dtype works here (CUDA builds since torch 2.8), tried once


def _accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc (fp32) + a @ b. Low-precision a, b: on CUDA one product whose fp32 accumulator adds into acc
    (`out_dtype`), else a low-precision product added in fp32 (a separate pass over acc: 0.08 s of a 1.5B step
    on an H100, issue 44)."""
    if a.dtype == torch.float32:
        return acc.addmm_(a, b)
    if a.is_cuda and _FP32_OUT_PRODUCT != [False]:
        try:
            out = torch.addmm(acc, a, b, out_dtype=torch.float32)
            _FP32_OUT_PRODUCT[:] = [True]
            return out
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_PRODUCT[:] = [False]
    return acc.add_(torch.mm(a, b))


def _zeros_for_none(g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor, Tensor]:
    """The fused kernels take both output gradients; an unused output's is zeros ([N] floats: nothing to save)."""
    like = g_logp if g_logp is not None else g_entropy
    return (g_logp if g_logp is not None else torch.zeros_like(like),
            g_entropy if g_entropy is not None else torch.zeros_like(like))  # fmt: skip


def _chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(target), entropy, log-normaliser) fp32 [c] of one chunk of logits [c, V]: the functional form of
    the eager path's arithmetic, for torch.compile to fuse (reads the logits two or three times, writes no [c, V])."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    top = x.amax(-1, keepdim=True)
    x = x - top
    e = torch.exp(x)
    z = e.sum(-1)
    log_z = torch.log(z)
    target = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return target - log_z, log_z - (e * x).sum(-1) / z, top.squeeze(-1) + log_z


def _chunk_grad(logits: Tensor, targets: Tensor, log_norm: Tensor, entropy: Tensor, g_logp: Tensor,
                g_entropy: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:  # fmt: skip
    """d loss / d logits [c, V] in `dtype` of one chunk, from the forward's per-row log-normaliser and entropy:
    -p_j (g_logp + g_H (log p_j + H)) + g_logp 1[j = target], over the temperature. Elementwise only (the target
    term by comparing column indices, not a scatter), so compiled it is one kernel writing `dtype` alone."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp_all = x - log_norm.unsqueeze(-1)
    g = torch.exp(logp_all) * -(g_logp.unsqueeze(-1) + g_entropy.unsqueeze(-1) * (logp_all + entropy.unsqueeze(-1)))
    hit = torch.arange(x.size(-1), device=x.device) == targets.unsqueeze(-1)
    g = torch.where(hit, g + g_logp.unsqueeze(-1), g)
    if temperature != 1.0:
        g = g / temperature
    return g.to(dtype)


def compile_enabled() -> bool:
    """Whether GPU paths may use torch.compile (SLUICEWAY_COMPILE=0 turns it off, e.g. to compare)."""
    return os.environ.get("SLUICEWAY_COMPILE", "1") != "0"


@functools.cache
def _compiled_chunk_kernels(device_type: str) -> tuple[Any, Any] | None:
    """`_chunk_stats` and `_chunk_grad` compiled for `device_type`, or None where torch.compile does not work
    there (no Triton, no compiler): tried once on a small chunk, which also pays the compile up front."""
    if not compile_enabled():
        return None
    try:
        stats = torch.compile(_chunk_stats, dynamic=True)
        grad = torch.compile(_chunk_grad, dynamic=True)
        x = torch.randn(3, 5, device=device_type)
        t = torch.tensor([0, 4, 2], device=device_type)
        _, ent, norm = stats(x, t, 1.0)
        grad(x, t, norm, ent, torch.ones(3, device=device_type), torch.ones(3, device=device_type), 1.0, x.dtype)
    except Exception as exc:  # noqa: BLE001 -- any failure to compile means: run the same functions eagerly
        log.warning("torch.compile unavailable on %s (%s): the log-prob chunks run eagerly", device_type, exc)
        return None
    return or_eager(stats, _chunk_stats), or_eager(grad, _chunk_grad)


def or_eager(compiled: Any, eager: Any, name: str | None = None, failures: tuple[type, ...] = (Exception,)) -> Any:
    """`compiled`, until a call fails with one of `failures` (a shape or dtype the compiler cannot handle): from then
    on `eager`, the same arithmetic, with a warning. Out of memory, and any error eager itself raises, still raise.
    models/megatron_gpt.py's compiled layers take it too, with only the compiler's own errors as `failures`."""
    state = {"fn": compiled}
    what = name or eager.__name__

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except failures as exc:
            if state["fn"] is eager:
                raise
            log.warning("torch.compile failed for %s (%s): running it eagerly from now on", what, exc)
            state["fn"] = eager
            return eager(*args, **kwargs)

    return call


def _fused_kernels(device: torch.device) -> tuple[Any, Any] | None:
    """Compiled chunk kernels for a GPU, None on CPU (the in-place eager path there is the engine's arithmetic)."""
    return None if device.type == "cpu" else _compiled_chunk_kernels(device.type)


def compiled_on(device: torch.device) -> bool:
    """Whether torch.compile works on `device` (a GPU; tried once): models/megatron_gpt.py then also takes
    megatron's compiled SwiGLU."""
    return _fused_kernels(device) is not None


def _chunk_kernels(device: torch.device) -> tuple[Any, Any]:
    """The chunk functions `LinearTokenLogProbEntropy` runs: compiled on GPUs where that works, else eager."""
    return _fused_kernels(device) or (_chunk_stats, _chunk_grad)


def _target_logprob(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """log softmax(x)[target] of fp32 rows x [N, V] (shifted in place by their max), and the parts the entropy
    and backward reuse: (logp [N], max [N, 1], exp(shifted) [N, V], Z [N], log Z [N]).

    The one formula for a sampled token's log-prob: the embedded engine reports its samples' log-probs with it
    (`sampled_logprobs`), so in bf16 the engine's and the trainer's log-probs of the same logits are the same
    bits, not log_softmax's and this one's reductions a few ulps apart (issue 31).
    """
    top = x.amax(-1, keepdim=True)
    x.sub_(top)  # shifted: exp cannot overflow
    target = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    e = torch.exp(x)
    z = row_sums(e)  # a lone row (the engine's last decode row, the trainer's last chunk) sums as in a batch
    log_z = z.log()
    return target - log_z, top, e, z, log_z


def sampled_logprobs(scaled_logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(scaled_logits)[targets] per row, fp32 [N], exactly as the trainer computes it
    (`TokenLogProbEntropy`); `scaled_logits` fp32 [N, V] = logits / temperature, left unchanged."""
    return _target_logprob(scaled_logits.clone(), targets)[0]


def _scaled_fp32(x: Tensor, temperature: float) -> Tensor:
    """A fresh fp32 copy of x / temperature (the callers write into it)."""
    out = x.to(torch.float32, copy=True)
    return out.div_(temperature) if temperature != 1.0 else out


def token_logprob_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """log p(targets) and entropy of softmax(logits / temperature) over the last dim; any leading shape.

    `logits` [..., V] (bf16, fp16 or fp32), `targets` [...] long; results are fp32 [...].
    """
    lead = targets.shape
    flat = logits.reshape(-1, logits.size(-1))  # a view when logits is contiguous
    logp, entropy = TokenLogProbEntropy.apply(flat, targets.reshape(-1), temperature)
    return logp.view(lead), entropy.view(lead)


def linear_token_logprob_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """log p(targets) and entropy of softmax(hidden @ weight^T / temperature), without the logits held whole:
    `hidden` [..., H], `weight` [V, H], `targets` [...] long; results fp32 [...] (`LinearTokenLogProbEntropy`)."""
    lead = targets.shape
    flat = hidden.reshape(-1, hidden.size(-1))
    logp, entropy = LinearTokenLogProbEntropy.apply(flat, weight, targets.reshape(-1), temperature)
    return logp.view(lead), entropy.view(lead)
