"""Per-token log-prob and entropy from full-vocabulary logits, without a full-size fp32 tensor.

The straightforward way (`logits.float()`, `log_softmax`, `gather`, entropy from the log-probs) makes three or
four fp32 copies of the logits and keeps one for backward: with SmolLM2's 49k vocabulary that is ~200 MB a
micro-batch on the trainer's hot path, and on CPU about a tenth of a training step goes to moving it around.

Here rows go through in chunks that stay in cache: forward keeps the logits the output layer made anyway (in
their own dtype) plus two floats a row (the log-normaliser and the entropy); backward recomputes each chunk's
softmax from them. Plain torch, so it runs wherever the model does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sluiceway.models.batch_invariant import row_sums

# Rows per chunk: 32 x 49k fp32 is 6 MiB, which stays in cache (on CPU 2x faster than 256 rows).
CHUNK_ROWS = 32


class TokenLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per row of `logits` [N, V] at `temperature`, both fp32 [N].

    d logp_t / dx_j = 1[j = t] - p_j and dH / dx_j = -p_j (log p_j + H), with x = logits / temperature.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        n = logits.size(0)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy, log_norm = torch.empty_like(logp), torch.empty_like(logp)
        for a in range(0, n, CHUNK_ROWS):
            rows = slice(a, a + CHUNK_ROWS)
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
        for a in range(0, logits.size(0), CHUNK_ROWS):
            rows = slice(a, a + CHUNK_ROWS)
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
