"""A custom generate function for tests: two model turns with an environment reply between them."""

ENV_REPLY = "<result>42</result>"


async def generate(ctx, prompt, params):
    buf = ctx.new_buffer(prompt.token_ids)
    await ctx.generate(buf, dict(params, max_new_tokens=5, stop_token_ids=[]))
    buf.add_env(ctx.encode(ENV_REPLY))
    await ctx.generate(buf, dict(params, max_new_tokens=5, stop_token_ids=[]))
    return buf
