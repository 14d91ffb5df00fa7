"""Tinker's built-in losses, per token, as its documentation defines them (tinker-docs.thinkingmachines.ai/losses;
the SDK 0.38.0 names them in tinker/types/loss_fn_type.py and types the per-token inputs in types/datum.py).
`logp` is the trainer's log-probability of each target token; every loss is summed over tokens by the caller
(the metric `loss:sum`), with no normalisation: the client scales its advantages or weights.

- cross_entropy:        -weights * logp
- importance_sampling:  -(exp(logp - q) * A)                                           (q: the sampler's log-probs)
- ppo:                  -min(r * A, clip(r, low, high) * A),      r = exp(logp - q); default low 0.8, high 1.2
- cispo:                -(sg(clip(r, low, high)) * logp * A);                           default low 0.0, high 4.0

ppo's and cispo's thresholds come from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`) or, per
token, from `loss_fn_inputs` of the same names (which win where given).
"""

from __future__ import annotations

import math

import torch

from sluiceway.flows.tinker.futures import TinkerUserError, not_implemented

# What each loss reads of loss_fn_inputs (required, then optional: defaults below).
LOSS_INPUTS = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("target_tokens", "logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
}
# The SDK's other names (tinker/types/loss_fn_type.py): answered as not implemented, named.
NOT_IMPLEMENTED = ("dro", "gspo", "stable_reinforce", "custom")
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}


def loss_config(loss_fn: str, config: dict) -> dict[str, float]:
    """The loss's settings from `loss_fn_config` (defaults filled in); a key the loss does not take, or a value that
    is not a number, is the user's error."""
    if loss_fn not in LOSS_INPUTS:
        if loss_fn in NOT_IMPLEMENTED:
            raise not_implemented(f"the loss function {loss_fn!r} (implemented: {', '.join(LOSS_INPUTS)})")
        raise TinkerUserError(f"unknown loss function {loss_fn!r} (implemented: {', '.join(LOSS_INPUTS)})")
    if loss_fn not in CLIP_DEFAULTS:
        if config:
            raise TinkerUserError(f"loss_fn_config: {loss_fn} takes no settings (given {sorted(config)})")
        return {}
    known = ("clip_low_threshold", "clip_high_threshold")
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise TinkerUserError(f"loss_fn_config: {loss_fn} takes {list(known)}, not {unknown}")
    out = dict(zip(known, CLIP_DEFAULTS[loss_fn]))
    for k in known:
        if k in config:
            v = config[k]
            if isinstance(v, str | bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise TinkerUserError(f"loss_fn_config[{k!r}] must be a finite number, got {v!r}")
            out[k] = float(v)
    if out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise TinkerUserError(f"loss_fn_config: clip_low_threshold {out['clip_low_threshold']} is above "
                              f"clip_high_threshold {out['clip_high_threshold']}")  # fmt: skip
    return out


def elementwise_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The per-token loss of one datum (its sum is the datum's contribution to `loss:sum`); differentiable
    through `logp`."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(logp if weights is None else weights * logp)
    advantages, sampler_logp = inputs["advantages"], inputs["logprobs"]
    ratio = torch.exp(logp - sampler_logp)
    if loss_fn == "importance_sampling":
        return -(ratio * advantages)
    low = inputs.get("clip_low_threshold", torch.full_like(ratio, config["clip_low_threshold"]))
    high = inputs.get("clip_high_threshold", torch.full_like(ratio, config["clip_high_threshold"]))
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages)
    if loss_fn == "cispo":
        return -(clipped.detach() * logp * advantages)
    raise AssertionError(loss_fn)
