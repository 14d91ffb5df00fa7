"""LoRA at TP=2 over gloo (two spawned processes) against peft's LoraModel on the same HF weights and adapter.

Column-parallel adapters (q/k/v, gate/up) hold B's rows of their rank, row-parallel ones (o, down) A's columns;
the merged TP=2 gradients must equal peft's whole-adapter gradients (fp32, 1e-5)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from lora_helpers import (
    batch,
    hf_model,
    megatron_logprobs,
    megatron_with_adapter,
    peft_adapter,
    peft_logprobs,
    peft_model,
)

from sluiceway.infra.proc import free_port
from sluiceway.models.lora import merge_tp_adapters, peft_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _worker(rank: int, port: int, kind: str, out_dir: str) -> None:
    from sluiceway.models.megatron_gpt import init_parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_parallel_state(tensor_model_parallel_size=2, backend="gloo")
    adapter = peft_adapter(peft_model(kind))
    gpt, lora = megatron_with_adapter(hf_model(kind), adapter)
    ids, mask = batch()
    logp = megatron_logprobs(gpt, ids)
    (logp * mask).sum().backward()
    grads = {peft_key(i, t, w): p[f"{t}_{w}"].grad.clone() for i, p in enumerate(lora.layers)
             for t in lora.spec.targets for w in ("A", "B")}  # fmt: skip
    torch.save({"logp": logp.detach(), "grads": grads, "weights": lora.local_state()},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2"])
def test_lora_tp2_matches_peft(tmp_path, kind):
    mp.start_processes(_worker, args=(free_port(), kind, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    pm = peft_model(kind)
    adapter = peft_adapter(pm)
    ids, mask = batch()
    ref = peft_logprobs(pm, ids)
    (ref * mask).sum().backward()
    for r in ranks:
        torch.testing.assert_close(r["logp"] * mask, ref.detach() * mask, atol=1e-5, rtol=0)
    # Each rank held a slice (some of them halves): merged, they are peft's adapter and its gradients.
    assert any(ranks[0]["weights"][k].shape != v.shape for k, v in adapter.items())
    weights = merge_tp_adapters([r["weights"] for r in ranks])
    assert all(torch.equal(weights[k], v) for k, v in adapter.items())
    grads = merge_tp_adapters([r["grads"] for r in ranks])
    for name, p in pm.named_parameters():
        if p.requires_grad:
            key = name.replace(".default", "")
            torch.testing.assert_close(grads[key], p.grad, atol=1e-5, rtol=1e-4, msg=name)
