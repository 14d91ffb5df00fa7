"""SGLang's dynamic LoRA loading as the run drives it (`EngineClient.load_lora_adapter`, what a run with SGLang engines
and --lora-sync adapter calls), here against real embedded engines behind the real sglang-router: every engine
loads the adapter, reports its version, requests name it (`lora_path` passes the router), and the tokens and
log-probs are those of the merged model; an unknown adapter name is a 400; older adapters are unloaded."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.models.lora import LoraAdapters, LoraSpec, write_adapter_dir
from sluiceway.models.megatron_gpt import init_parallel_state
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.tasks.rollout.client import EngineCallError, EngineClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SPEC = LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj", "down_proj"))
PARAMS = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}


def adapter_dir(model_dir, out, seed: int):
    from transformers import AutoConfig

    init_parallel_state()
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    adapter = LoraAdapters(cfg, SPEC, seed=seed).local_state()
    g = torch.Generator().manual_seed(seed)
    adapter = {k: (0.1 * torch.randn(v.shape, generator=g) if "lora_B" in k else v) for k, v in adapter.items()}
    write_adapter_dir(adapter, SPEC, out, base_model=str(model_dir))
    return out


def test_client_loads_adapters_through_the_lora_endpoints(tmp_path):
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    dirs = [adapter_dir(model_dir, tmp_path / f"v{i}", seed=i) for i in (1, 2, 3)]
    env = {"SLUICEWAY_CACHE": str(tmp_path / "cache")}
    with SGLangRouter(tmp_path / "logs", health_check_interval_s=1) as router:
        with EngineGroup(str(model_dir), 2, tmp_path / "logs", router=router, env=env, startup_timeout_s=120) as pool:

            async def go():
                client = EngineClient(router.url, pool.urls)
                try:
                    base = await client.generate([1, 5, 9, 11], PARAMS, rid="base")
                    await client.load_lora_adapter(str(dirs[0]), 1)
                    assert await client.weight_versions() == dict.fromkeys(pool.urls, 1)
                    first = await client.generate([1, 5, 9, 11], PARAMS, rid="a1")
                    # The same adapter through the disk path (what the embedded engines of a run get) samples the
                    # same tokens with the same log-probs: one merge, two ways in.
                    await client.update_weights_from_disk(str(dirs[0]), 1)
                    disk = await client.generate([1, 5, 9, 11], PARAMS, rid="d1")
                    assert (first.token_ids, first.logprobs) == (disk.token_ids, disk.logprobs)
                    assert first.logprobs != base.logprobs
                    for v in (2, 3):
                        await client.load_lora_adapter(str(dirs[v - 1]), v)
                    assert client.lora_names == ["v2", "v3"]  # v1 unloaded, v2 kept for requests in flight
                    body = {"input_ids": [1, 5], "sampling_params": PARAMS, "lora_path": "v1"}
                    async with httpx.AsyncClient() as http:
                        r = await http.post(f"{pool.urls[0]}/generate", json=body, timeout=30)
                    assert r.status_code == 400 and "no such adapter" in r.text
                    client.lora_names = ["nope"]
                    with pytest.raises(EngineCallError, match="no such adapter"):
                        await client.generate([1, 5, 9, 11], PARAMS, rid="bad")
                finally:
                    await client.aclose()

            asyncio.run(go())
