"""Helpers shared by the megatron-core parity tests (imported by name: pytest puts tests/ on sys.path)."""

import torch

VOCAB = 300


def padded_batch(lengths: list[int], seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, right-padded with 0 to the longest of `lengths`, and the mask of real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    return ids, mask
