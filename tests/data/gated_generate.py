"""A generate function (--custom-generate-function-path) a test can pace and hold from outside the run:
every sample waits SLUICEWAY_TEST_PACE_S seconds, then while the file SLUICEWAY_TEST_GATE exists, then generates
as usual. tests/integration/test_elastic_pools.py holds the run while a pool starts, so the pool joins at the
step the test chose (tiny-llama makes a step in about a second; a pool takes longer to start)."""

import asyncio
import os


async def generate(ctx, prompt, params):
    await asyncio.sleep(float(os.environ.get("SLUICEWAY_TEST_PACE_S") or 0))
    gate = os.environ.get("SLUICEWAY_TEST_GATE")
    while gate and os.path.exists(gate):
        await asyncio.sleep(0.05)
    buf = ctx.new_buffer(prompt.token_ids)
    await ctx.generate(buf, params)
    return buf
