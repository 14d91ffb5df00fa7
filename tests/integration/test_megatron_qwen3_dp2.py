"""Qwen3 on Megatron GPTModel: DP=2 vs DP=1 gradients over gloo (two spawned processes).

Tiny models built in code, fp32 throughout, so 1e-5 is a real bound."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from model_helpers import padded_batch
from qwen3_helpers import LENGTHS, TEMPERATURE, masked_loss, qwen3_model

from sluiceway.infra.proc import free_port
from sluiceway.models.hf_megatron import (
    load_hf_weights,
)
from sluiceway.models.megatron_gpt import allreduce_gradients, build_gpt_model, init_parallel_state
from sluiceway.models.megatron_logprobs import token_logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()


# ---------------------------------------------------------------------------------------------------------
# DP=2 (two spawned processes, gloo, TP=1) against one process on the full batch
# ---------------------------------------------------------------------------------------------------------


def _dp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    init_parallel_state(tensor_model_parallel_size=1, backend="gloo")
    assert parallel_state.get_data_parallel_world_size() == 2
    assert parallel_state.get_data_parallel_rank() == rank
    hf = qwen3_model()
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    n_global = int(mask[:, 1:].sum())  # every rank knows (or all-reduces) the global loss-token count
    half = len(LENGTHS) // 2
    rows = slice(rank * half, (rank + 1) * half)
    ids, valid = ids[rows], mask[rows, 1:].float()
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=TEMPERATURE)
    loss = masked_loss(logp, ent, valid, n_global)
    loss.backward()
    allreduce_gradients(gpt)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    grads = {n: p.grad.detach().clone() for n, p in gpt.named_parameters()}
    torch.save({"loss": total, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_dp2_matches_single_process_full_batch(tmp_path):
    mp.start_processes(_dp_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    hf = qwen3_model()
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    valid = mask[:, 1:].float()
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=TEMPERATURE)
    loss = masked_loss(logp, ent, valid, int(valid.sum()))
    loss.backward()

    for r in ranks:
        assert abs(r["loss"].item() - loss.item()) <= 1e-5
        assert set(r["grads"]) == {n for n, _ in gpt.named_parameters()}
        for name, p in gpt.named_parameters():
            assert (r["grads"][name] - p.grad).abs().max().item() <= 1e-5, name
    # The ranks hold identical gradients (the optimizer steps stay in lockstep).
    assert all(torch.equal(ranks[0]["grads"][n], ranks[1]["grads"][n]) for n in ranks[0]["grads"])
