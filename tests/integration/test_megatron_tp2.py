"""Megatron GPTModel at TP=2 over gloo (two spawned processes) against TP=1.

Models are tiny and built in code (nothing is downloaded); fp32 throughout so 1e-5 is a real bound."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from model_helpers import LENGTHS, padded_batch, tiny_hf_model

from sluiceway.infra.proc import free_port
from sluiceway.models.hf_megatron import (
    load_hf_weights,
    megatron_state_dict,
    megatron_to_hf,
    merge_tp_shards,
)
from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state
from sluiceway.models.megatron_logprobs import token_logprobs_and_entropy

# megatron-core 0.16 emits DeprecationWarnings for its own defaults (tp_group=None, ffn_hidden_size): not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()
    init_parallel_state()  # idempotent


# ---------------------------------------------------------------------------------------------------------
# TP=2 over gloo (two spawned processes) against TP=1
# ---------------------------------------------------------------------------------------------------------


def _tp_worker(rank: int, port: int, tied: bool, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_parallel_state(tensor_model_parallel_size=2, backend="gloo")
    hf = tiny_hf_model(tied)
    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf)
    ids, _ = padded_batch(LENGTHS)
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7)
    (logp.sum() + ent.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in gpt.named_parameters()}
    torch.save(
        {"logp": logp.detach(), "ent": ent.detach(), "grads": grads, "weights": megatron_state_dict(gpt)},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp2_matches_tp1(tmp_path, tied):
    mp.start_processes(_tp_worker, args=(free_port(), tied, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    hf = tiny_hf_model(tied)
    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf)
    ids, _ = padded_batch(LENGTHS)
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7)
    (logp.sum() + ent.sum()).backward()

    for r in ranks:  # every TP rank ends with the full (reduced) result
        assert (r["logp"] - logp.detach()).abs().max().item() <= 1e-5
        assert (r["ent"] - ent.detach()).abs().max().item() <= 1e-5
    # Gradients of the TP=2 shards, merged like weights, equal the TP=1 gradients.
    merged = merge_tp_shards([r["grads"] for r in ranks], hf.config)
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(merged[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    # And the TP=2 weights merge back into the HF checkpoint.
    back = megatron_to_hf([r["weights"] for r in ranks], hf.config)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(back[key], tensor), key
