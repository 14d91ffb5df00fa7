"""The agent endpoint's HTTP server: loopback only, its own thread and event loop, one key per session.

Routes, under a session's prefix `/sessions/SID` or the root (then the key alone names the session):

    POST /v1/chat/completions, /v1/completions    OpenAI (openai.py)
    POST /v1/responses                            OpenAI Responses (responses.py)
    POST /v1/messages                             Anthropic Messages (anthropic.py)
    GET  /v1/models
    POST /reward, /v1/reward                      {"reward": x}
    POST /abort, /v1/abort                        {"reason": "..."}

Every session has its own key (`Authorization: Bearer KEY` or `x-api-key: KEY`), made when it opens and dropped
when it closes; a key opens its own session's routes and no other: another session's id in the path (or in an
`X-Session-Id` header) is a 404, an unknown key a 401. There is no run-wide key.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
import threading
import uuid
from collections.abc import AsyncIterator

from sluiceway.tasks.rollout.agent.anthropic import Messages
from sluiceway.tasks.rollout.agent.api import Adapter, Call
from sluiceway.tasks.rollout.agent.openai import ChatCompletions, Completions
from sluiceway.tasks.rollout.agent.render import SessionError
from sluiceway.tasks.rollout.agent.responses import Responses
from sluiceway.tasks.rollout.agent.session import DROPPED, AgentSession, ModelTurn
from sluiceway.tasks.rollout.client import WeightVersionRefused
from sluiceway.tasks.rollout.multiturn import GenerateContext

SESSION_HEADER = "x-session-id"
KEY_PREFIX = "sk-sluiceway-"
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is a 413 before it is read
KEEPALIVE_S = 10.0  # a stream waiting on the engine sends a keep-alive this often
ADAPTERS: tuple[Adapter, ...] = (ChatCompletions(), Completions(), Responses(), Messages())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class AgentProxy:
    """The loopback HTTP server of a run's agent sessions, on its own thread and event loop."""

    def __init__(self):
        self.sessions: dict[str, AgentSession] = {}
        self._by_key: dict[bytes, AgentSession] = {}  # sha256(key) -> session
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    # -------------------------------------------------------------------------------- sessions
    def open(self, ctx: GenerateContext, params: dict, tokenizer, renderer, prompt_ids: list[int]) -> AgentSession:
        sid = uuid.uuid4().hex
        key = KEY_PREFIX + secrets.token_urlsafe(32)  # the session's alone; never logged or stored
        s = AgentSession(sid, ctx, params, renderer, loop=asyncio.get_running_loop(), key=key,
                         ctx_prompt_ids=prompt_ids)  # fmt: skip
        self.sessions[sid] = s
        self._by_key[_digest(key)] = s
        return s

    def close(self, s: AgentSession) -> None:
        s.closed = True
        self.sessions.pop(s.sid, None)
        self._by_key.pop(_digest(s.key), None)

    def session_for(self, key: str, sid: str | None, header_sid: str | None) -> AgentSession:
        """The session a key opens; SessionError 401 for no or an unknown key, 404 when the path or the header
        names another session."""
        s = self._by_key.get(_digest(key)) if key else None
        if s is None or not secrets.compare_digest(s.key.encode(), key.encode()):
            raise SessionError("invalid API key: use the key your session was given", 401)
        for named in (sid, header_sid):
            if named is not None and named != s.sid:
                raise SessionError(f"unknown session {named}", 404)
        return s

    # -------------------------------------------------------------------------------- the thread
    def start(self) -> None:
        with self._lock:
            if self.port is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            self._thread = threading.Thread(target=self._serve, args=(sock,), name="sluiceway-agent-proxy", daemon=True)
            self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the agent proxy did not start")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and join the server's thread (a daemon: a process may also just exit)."""
        with self._lock:
            thread, server = self._thread, self._server
            if thread is None:
                return
            if server is not None:
                server.should_exit = True
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"the agent proxy did not stop within {timeout_s:g} s")
            self._thread, self._server, self.port, self.loop = None, None, None, None
            self._started.clear()

    def _serve(self, sock) -> None:
        import uvicorn

        # log_config=None: uvicorn's default runs logging.config.dictConfig, which closes the process's handlers
        # under logging's lock; Prefect's API log handler, flushing there, waits on threads that wait for that same
        # lock -- a run hung for good at start-up (issue 30). The server logs through the run's own handlers.
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off", log_config=None)
        server = self._server = uvicorn.Server(config)
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main():
            loop.call_soon(self._started.set)
            await server.serve(sockets=[sock])

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    # -------------------------------------------------------------------------------- the app
    def _app(self):
        """Plain Starlette routes (no FastAPI parameter injection): every handler takes the request."""
        from starlette.applications import Starlette
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        openai_errors = Adapter()

        def err(api: Adapter, message: str, status: int) -> JSONResponse:
            return JSONResponse(api.error_body(message, status), status_code=status)

        def key_of(request) -> str:
            auth = request.headers.get("authorization", "")
            if auth[:7].lower() == "bearer ":
                return auth[7:].strip()
            return request.headers.get("x-api-key", "").strip()

        def who(request) -> AgentSession:
            return self.session_for(key_of(request), request.path_params.get("sid"),
                                    request.headers.get(SESSION_HEADER))  # fmt: skip

        async def read(request, api: Adapter) -> tuple[AgentSession | None, dict | None, JSONResponse | None]:
            try:
                s = who(request)
            except SessionError as e:
                return None, None, err(api, str(e), e.status)
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > MAX_BODY_BYTES:
                return s, None, err(api, f"the request is {int(size)} bytes, more than {MAX_BODY_BYTES}", 413)
            try:
                body = await request.json()
            except ValueError:
                return s, None, err(api, "the body is not JSON", 400)
            except ClientDisconnect:  # gone before its request was read: the session is abandoned all the same
                s.aborted = s.aborted or DROPPED
                return s, None, err(api, "the client disconnected", 400)
            if not isinstance(body, dict):
                return s, None, err(api, "the body must be a JSON object", 400)
            return s, body, None

        def failed(s: AgentSession, e: Exception) -> str:
            """An engine's failure ends the session: it cannot go on from a turn it does not have. A pool that
            refused the turn's pinned version is kept apart: the group is then made on another pool."""
            if isinstance(e, WeightVersionRefused):
                s.refused = s.refused or e
            s.aborted = s.aborted or f"the model call failed: {type(e).__name__}: {str(e)[:300]}"
            return f"the model call failed: {type(e).__name__}: {str(e)[:300]}"

        async def api_call(request, api: Adapter):
            s, body, error = await read(request, api)
            if error is not None:
                return error
            await s.lock.acquire()
            try:
                call = api.parse(s, body)
                s.begin(call.req)
            except SessionError as e:
                s.lock.release()
                return err(api, str(e), e.status)
            except Exception as e:  # noqa: BLE001 - a request this endpoint failed to read: its shape, not a trace
                s.lock.release()
                return err(api, f"the request could not be read: {type(e).__name__}: {str(e)[:300]}", 500)
            except BaseException:
                s.lock.release()
                raise
            if call.stream:
                return stream(request, api, s, call)
            try:
                turn = await s.generate(call.req)
                out = api.reply(call, turn)
            except SessionError as e:
                return err(api, str(e), e.status)
            except Exception as e:  # noqa: BLE001 - the engines failed the turn
                return err(api, failed(s, e), 502)
            finally:
                s.lock.release()
            if await request.is_disconnected():  # the agent never sees this turn: the trajectory is not its
                s.aborted = s.aborted or DROPPED
            return JSONResponse(out)

        def stream(request, api: Adapter, s: AgentSession, call: Call):
            async def run() -> ModelTurn:
                try:
                    return await s.generate(call.req)
                finally:
                    s.lock.release()

            task = asyncio.ensure_future(run())
            head = api.stream_head(call, s)

            async def events() -> AsyncIterator[str]:
                sent = False
                try:
                    for e in head:
                        yield e
                    while True:
                        try:
                            turn = await asyncio.wait_for(asyncio.shield(task), KEEPALIVE_S)
                            tail = api.stream_turn(call, turn)
                            break
                        except TimeoutError:
                            yield api.keepalive()
                        except SessionError as e:
                            tail = api.stream_error(call, str(e), e.status)
                            break
                        except Exception as e:  # noqa: BLE001 - the engines failed the turn
                            tail = api.stream_error(call, failed(s, e), 502)
                            break
                    for e in tail:
                        yield e
                    sent = True  # reached only once the last event was handed to the connection
                finally:
                    if not sent:  # the agent hung up mid-answer: it never saw this turn
                        s.aborted = s.aborted or DROPPED

            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

        async def control(request, what: str):
            s, body, error = await read(request, openai_errors)
            if error is not None:
                return error
            if what == "reward":
                try:
                    s.set_reward(body.get("reward"))
                except SessionError as e:
                    return err(openai_errors, str(e), e.status)
            else:
                s.aborted = s.aborted or str(body.get("reason") or "the agent aborted the session")
            return JSONResponse({"ok": True})

        def handler(api: Adapter):
            async def h(request):
                return await api_call(request, api)

            return h

        def control_handler(what: str):
            async def h(request):
                return await control(request, what)

            return h

        async def models(request):
            try:
                who(request)
            except SessionError as e:
                return err(openai_errors, str(e), e.status)
            card = {"id": "policy", "object": "model", "created": 0, "owned_by": "sluiceway"}
            return JSONResponse({"object": "list", "data": [card]})

        routes = []
        for prefix in ("/sessions/{sid}", ""):
            for api in ADAPTERS:
                routes += [Route(f"{prefix}/v1{p}", handler(api), methods=["POST"]) for p in api.paths]
            routes.append(Route(f"{prefix}/v1/models", models, methods=["GET"]))
            for what in ("reward", "abort"):
                routes += [Route(f"{prefix}/{what}", control_handler(what), methods=["POST"]),
                           Route(f"{prefix}/v1/{what}", control_handler(what), methods=["POST"])]  # fmt: skip
        return Starlette(routes=routes)
