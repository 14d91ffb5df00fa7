"""slime.utils.http_utils: init_http_client, post, get, get_rollout_num_engines (slime's slime/utils/http_utils.py).

As in slime, `post` and `get` use one module-wide httpx.AsyncClient made by `init_http_client(args)` (slime's
RolloutManager calls it at start; sluiceway's runner of slime plugins does the same), sized to
`sglang_server_concurrency x rollout engines`, no timeout, no proxy from the environment. `post` retries any failure
(HTTP status, connection, timeout) up to `max_retries` times one second apart, then raises the last error (an HTTP
status error's message here ends with the server's answer, which slime only logs); it returns the parsed JSON or, if
the body is not JSON, the text. `get` does not retry.

Differences, each said where it is: slime runs every rollout coroutine on one event loop, and an httpx client's
connections belong to the loop that opened them, so here a client is made per event loop (the same limits); `post`
before `init_http_client` raises at once (slime's retries an AttributeError for a minute first); Ray-distributed posting
(`--use-distributed-post`) is not provided (posts go out from this process). Not here: the port, host and router
helpers (find_available_port, is_port_available, get_host_info, run_router, terminate_process).
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx

logger = logging.getLogger(__name__)

# Module state as slime keeps it, on purpose: a plugin calls init_http_client(args) once and post() anywhere after
# with no handle to pass, so the client lives here (a process runs one rollout's plugins at a time).
_http_client: httpx.AsyncClient | None = None
_client_concurrency: int = 0
_client_loop: asyncio.AbstractEventLoop | None = None  # the loop _http_client's connections belong to (None: unused)


def get_rollout_num_engines(args) -> int:
    """The number of engines behind the router: args.rollout_num_engines, else rollout_num_gpus //
    rollout_num_gpus_per_engine (at least 1), 0 without rollout GPUs. slime's http_utils.py:201-210."""
    if getattr(args, "rollout_num_engines", None) is not None:
        return int(args.rollout_num_engines)
    gpus = getattr(args, "rollout_num_gpus", None) or 0
    if gpus <= 0:
        return 0
    return max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", None) or 1))


def _new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=_client_concurrency), timeout=httpx.Timeout(None),
                             trust_env=False)  # fmt: skip


def init_http_client(args):
    """Make the shared client, once; with no rollout engines (get_rollout_num_engines(args) <= 0) there is none,
    as in slime (http_utils.py:213-231). Returns None."""
    global _http_client, _client_concurrency
    engines = get_rollout_num_engines(args)
    if engines <= 0:
        return
    _client_concurrency = args.sglang_server_concurrency * engines
    if _http_client is None:
        _http_client = _new_client()
    if getattr(args, "use_distributed_post", False):
        logger.info("slime.utils.http_utils: --use-distributed-post is not provided by sluiceway; posting locally")


def _client() -> httpx.AsyncClient:
    """The shared client, for the running event loop (a loop other than the one it first ran on gets a new one)."""
    global _http_client, _client_loop
    if _http_client is None:
        raise RuntimeError("slime.utils.http_utils: no HTTP client: call init_http_client(args) first (with "
                           "args.rollout_num_engines, or rollout_num_gpus, giving at least one engine)")  # fmt: skip
    loop = asyncio.get_running_loop()
    if _client_loop is None:
        _client_loop = loop
    elif _client_loop is not loop:
        _http_client, _client_loop = _new_client(), loop  # the old one's connections belong to the other loop
    return _http_client


async def _post(client, url, payload, max_retries=60, headers=None):
    """POST `payload` as JSON; the parsed body (text if not JSON). slime's http_utils.py:165-198."""
    for attempt in range(1, max_retries + 1):
        response = None
        try:
            response = await client.post(url, json=payload or {}, headers=headers)
            response.raise_for_status()
            content = await response.aread()
            try:
                return json.loads(content)
            except json.JSONDecodeError:
                return content.decode()
        except Exception as e:
            body = e.response.text if isinstance(e, httpx.HTTPStatusError) else None
            logger.info(f"Error: {e}, retrying... (attempt {attempt}/{max_retries}, url={url}, response={body})")
            if attempt >= max_retries:
                logger.info(f"Max retries ({max_retries}) reached, failing... (url={url})")
                if body:  # the server's reason, in the error the run reports (slime leaves it in an INFO line)
                    raise httpx.HTTPStatusError(f"{str(e).splitlines()[0]}; the server said: {body[:500]}",
                                                request=e.request, response=e.response) from None  # fmt: skip
                raise
            await asyncio.sleep(1)
        finally:
            if response is not None:
                await response.aclose()


async def post(url, payload, max_retries=60, headers=None):
    """POST `payload` (JSON) to `url` with the shared client, retrying; see the module's docstring."""
    return await _post(_client(), url, payload, max_retries, headers=headers)


async def get(url):
    """GET `url` with the shared client; the parsed JSON body. No retries. slime's http_utils.py:312-317."""
    response = await _client().get(url)
    response.raise_for_status()
    return json.loads(await response.aread())
