"""A client that goes away mid-request (killed, timed out) has its non-streamed requests aborted, as SGLang does:
they stop spending compute and their rids are free at once for the run that resumes them (the fresh-clone suite
once failed a resume on 'rid ... is already in use by a running request'). Through a real server process:
tests/integration/test_engine_server.py::test_a_client_that_goes_away_frees_its_rid."""

import asyncio

import torch

from sluiceway.models.engine.core import Engine
from sluiceway.models.engine.server import EngineServer


def test_a_gone_client_aborts_its_requests_and_frees_their_rids(tiny):
    engine = Engine(tiny[0], dtype=torch.float32, max_running_requests=4, max_total_len=2048, load_tokenizer=False)
    server = EngineServer(engine)
    asked = []

    async def gone() -> bool:  # the HTTP request's is_disconnected: the client leaves at the second question
        asked.append(1)
        return len(asked) >= 2

    long = {"max_new_tokens": 2000, "ignore_eos": True}
    try:
        out = asyncio.run(server.generate({"input_ids": [[5, 6], [7, 8]], "rid": ["gone-a", "gone-b"],
                                           "sampling_params": long}, gone))  # fmt: skip
        assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["abort", "abort"]
        assert all(len(o["output_ids"]) < 2000 for o in out)
        again = asyncio.run(server.generate({"input_ids": [5, 6], "rid": "gone-a",
                                             "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}))
        assert again["meta_info"]["finish_reason"]["type"] == "length" and len(again["output_ids"]) == 3
        # A client that stays is never cut short.
        stays = asyncio.run(server.generate({"input_ids": [5, 6], "rid": "stays",
                                             "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}},
                                            lambda: asyncio.sleep(0, result=False)))  # fmt: skip
        assert len(stays["output_ids"]) == 40
    finally:
        engine.shutdown()
