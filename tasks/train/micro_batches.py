"""Which samples a training step puts in which micro-batch and row, and which data-parallel rank trains each.

Plain planning over sample lengths (no tensors, no process group): micro-batches of similar lengths, rows packed
to a token budget, one prompt's samples laid out in one row, and a deterministic split of the micro-batches over
DP ranks, so every rank computes the same plan without talking to the others. tasks/train/collation.py turns a
plan into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchPlan:
    samples: list[int]  # indices into the optimizer step's samples
    rows: list[list[int]] | None  # laid-out rows (indices into `samples`), or None for one sample per row
    tokens: int  # tokens the forward pass processes, padding included


def plan_micro_batches(
    lengths: list[int],
    micro_batch_size: int,
    max_tokens: int | None,
    prompts: list[int] | None = None,
    prompt_lengths: list[int] | None = None,
) -> list[MicroBatchPlan]:
    """Split an optimizer step's samples (their lengths, prompt + response) into micro-batches.

    Without `max_tokens`: runs of `micro_batch_size` samples in order of length, one per row, so rows padded to
    their micro-batch's longest waste little (the losses' global normalisers make the grouping irrelevant to the
    gradient). With it (packing): samples, longest first, are packed first-fit into rows of at most `max_tokens`
    tokens, one row per micro-batch; a sample longer than the budget gets a row of its own rather than being dropped.

    With `prompts` (a key per sample: equal keys, equal prompts) and their `prompt_lengths`, samples of one prompt
    go into a row together (see `_shared_prompt_rows`).
    """
    if prompts is not None:
        assert prompt_lengths is not None
        return _shared_prompt_rows(lengths, micro_batch_size, max_tokens, prompts, prompt_lengths)
    if not max_tokens:
        by_length = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        out = []
        for start in range(0, len(lengths), micro_batch_size):
            idx = sorted(by_length[start : start + micro_batch_size])
            out.append(MicroBatchPlan(idx, None, len(idx) * max(lengths[i] for i in idx)))
        return out
    return _first_fit([[i] for i in range(len(lengths))], lengths, max_tokens)


def _shared_prompt_rows(
    lengths: list[int], micro_batch_size: int, max_tokens: int | None, prompts: list[int], prompt_lengths: list[int]
) -> list[MicroBatchPlan]:
    """Micro-batches of rows that lay out one prompt followed by the responses of its samples.

    GRPO's n samples of a prompt share it token for token, so the forward pass computes it once and every
    response attends to it (collate lays the row out; the attention mask keeps the responses apart). The
    prompt's activations and gradients are the sum of what the separate rows would compute: the same gradient
    from (1 + r/p)/(1/n + r/p) times fewer tokens. A run of one prompt's samples (the unit) holds at most
    `micro_batch_size` samples and, with `max_tokens`, fits the budget (or is a single sample). Without
    `max_tokens`, units sorted by length fill micro-batches of at most `micro_batch_size` samples; with it, units
    are packed first-fit into one row per micro-batch, as samples are without sharing.
    """
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(prompts):
        groups.setdefault(key, []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        unit: list[int] = []
        for i in members:
            grown = prompt_lengths[i] + sum(lengths[j] - prompt_lengths[j] for j in [*unit, i])
            if unit and (len(unit) == micro_batch_size or (max_tokens and grown > max_tokens)):
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    size = {tuple(u): prompt_lengths[u[0]] + sum(lengths[j] - prompt_lengths[j] for j in u) for u in units}
    if max_tokens:
        return _first_fit(units, [size[tuple(u)] for u in units], max_tokens)
    out: list[MicroBatchPlan] = []
    rows: list[list[int]] = []
    for u in sorted(units, key=lambda u: (size[tuple(u)], u)):
        if rows and sum(map(len, rows)) + len(u) > micro_batch_size:
            out.append(_plan_of(rows, size))
            rows = []
        rows.append(u)
    if rows:
        out.append(_plan_of(rows, size))
    return out


def _plan_of(rows: list[list[int]], size: dict[tuple[int, ...], int]) -> MicroBatchPlan:
    """A micro-batch of whole rows (units of sample indices), as indices into its own sample list."""
    samples = [i for row in rows for i in row]
    local = {i: k for k, i in enumerate(samples)}
    width = max(size[tuple(row)] for row in rows)
    return MicroBatchPlan(samples, [[local[i] for i in row] for row in rows], len(rows) * width)


def _first_fit(units: list[list[int]], sizes: list[int], max_tokens: int) -> list[MicroBatchPlan]:
    """Units (runs of sample indices), largest first, packed first-fit into one row per micro-batch."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-sizes[u], units[u])):
        for r, used in enumerate(fill):
            if used + sizes[u] <= max_tokens:
                rows[r] += units[u]
                fill[r] += sizes[u]
                break
        else:
            rows.append(list(units[u]))
            fill.append(sizes[u])
    return [MicroBatchPlan(row, [list(range(len(row)))], used) for row, used in zip(rows, fill)]


def shard_for_rank(plans: list[MicroBatchPlan], dp_size: int, dp_rank: int) -> list[MicroBatchPlan]:
    """This DP rank's micro-batches: the heaviest first, each to the least-loaded rank (ties to the lower rank).

    Deterministic, so every rank computes the same assignment without talking to the others.
    """
    if dp_size == 1:
        return plans
    load = [0] * dp_size
    mine = []
    for i in sorted(range(len(plans)), key=lambda i: (-plans[i].tokens, i)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        load[rank] += plans[i].tokens
        if rank == dp_rank:
            mine.append(i)
    return [plans[i] for i in sorted(mine)]
