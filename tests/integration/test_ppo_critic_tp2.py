"""The megatron-core value model under TP=2 over gloo (two spawned processes) matches TP=1, with a replicated head."""

import os

import torch
import torch.multiprocessing as mp
from model_helpers import LENGTHS, padded_batch, tiny_config, tiny_hf_model

from sluiceway.infra.proc import free_port
from sluiceway.models.hf_megatron import merge_tp_shards
from sluiceway.models.megatron_gpt import init_parallel_state
from sluiceway.models.value_model import build_value_model, init_value_head, token_values

# ---------------------------------------------------------------------------------------------------------------------
# By hand
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# The critic on megatron-core
# ---------------------------------------------------------------------------------------------------------------------


def _value_model_and_grads():
    """Values of a padded batch under an untied tiny Llama's value model, and the gradients of sum(V^2)."""
    hf = tiny_hf_model(tied=False)  # untied: the vocab-parallel LM head is built, loaded, then replaced
    model = build_value_model(hf.config, hf.state_dict(), init_value_head(hf.config.hidden_size, seed=3))
    ids, _ = padded_batch(LENGTHS)
    values = token_values(model, ids)
    values.square().sum().backward()
    return values.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _value_tp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_parallel_state(tensor_model_parallel_size=2, backend="gloo")
    values, grads = _value_model_and_grads()
    torch.save({"values": values, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_value_model_under_tp2_matches_tp1_with_a_replicated_head(tmp_path):
    """TP=2 over gloo: every rank computes the full values and the full head gradient; the sharded decoder's
    gradients merge into the TP=1 ones (so the gradient reaching the decoder through the head is complete)."""
    mp.start_processes(_value_tp_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    init_parallel_state()
    values, grads = _value_model_and_grads()
    head = "output_layer.weight"
    for r in ranks:
        torch.testing.assert_close(r["values"], values, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r["grads"][head], grads[head], atol=1e-5, rtol=1e-4)
    merged = merge_tp_shards([{k: v for k, v in r["grads"].items() if k != head} for r in ranks], tiny_config(False))
    for name, g in grads.items():
        if name != head:
            torch.testing.assert_close(merged[name], g, atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# REINFORCE++ with the reward-side KL
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
