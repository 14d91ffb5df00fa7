"""slime.rollout.filter_hub.base_types: DynamicFilterOutput, call_dynamic_filter, should_drop_dynamic_filter_output
(slime's filter_hub/base_types.py). sluiceway's rollout calls a filter through
sluiceway.tasks.rollout.slime_plugins.reward.slime_filter, which reads `keep` and `reason` the same way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn, *args, **kwargs) -> DynamicFilterOutput:
    """None keeps everything; a bare bool (slime's older filters) becomes DynamicFilterOutput(keep=it)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=output)


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, remaining_batch_size: int,
                                      target_data_size: int) -> bool:  # fmt: skip
    """Drop unless kept, or kept because too few groups remain and the filter said keep_when_insufficient."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)
