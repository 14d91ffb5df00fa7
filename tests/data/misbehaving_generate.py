"""A generate function (--custom-generate-function-path) that misbehaves on purpose, for
tests/integration/test_nothing_to_train_run.py.

While the file SLUICEWAY_TEST_BROKEN exists every sample raises (a tool server down: the step has nothing to
train). Otherwise one sample a step misbehaves, the first of the step's first group (its group id a multiple of
4: a step generated again numbers its groups on): at step 0 it returns None, at step 1 it never returns, at step
2 it returns a million tokens; every other sample generates as usual.
"""

import asyncio
import os


async def generate(ctx, prompt, params):
    step, group, sample = (int(x) for x in ctx.rid.rsplit("/", 3)[-3:])
    broken = os.environ.get("SLUICEWAY_TEST_BROKEN")
    if broken and os.path.exists(broken):
        raise RuntimeError("the tool server is down")
    if group % 4 == 0 and sample == 0:
        if step == 0:
            return None
        if step == 1:
            await asyncio.Event().wait()
        if step == 2:
            buf = ctx.new_buffer(prompt.token_ids)
            buf.add_env([5] * 1_000_000)
            return buf
    buf = ctx.new_buffer(prompt.token_ids)
    await ctx.generate(buf, params)
    return buf
