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
`X-Session-Id` header, which may also carry a name the session registered: `AgentSession.aliases`) is a 404, an
unknown key a 401. There is no run-wide key handed to agents; a gateway key (`gateway_key`, held by the run's own
verifiers client) opens only the sessions that registered an alias for it, each named by that alias in the header.

What the endpoint holds is bounded, whoever connects (issue 40): at most `max_connections` open connections (a
quarter of the process's file-handle limit, at most 1024); a connection with no request in flight (a fresh one
that has not sent its request's head, or one between requests) is closed after `IDLE_TIMEOUT_S`, and when the cap
is reached a new connection closes the one idle longest (or, with none idle, is closed itself). A body is read as
it streams, counted against `max_body_bytes` (413 past it, the rest never read, the connection closed) and
`BODY_TIMEOUT_S` (408). Every failure is an answer in the API's own error shape and at most one log line: an
exception no handler expected (a 500), uvicorn's own errors and the event loop's alike, never a traceback; the
endpoint's connection-cap line comes at most once a minute. An answer is serialised before the call counts as
answered: one that cannot be (a NaN, a lone surrogate) is a 500 and its session is aborted, never trained.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import resource
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator

from sluiceway.tasks.rollout.agent.anthropic import Messages
from sluiceway.tasks.rollout.agent.api import Adapter, Call, encode
from sluiceway.tasks.rollout.agent.openai import ChatCompletions, Completions
from sluiceway.tasks.rollout.agent.render import SessionError, loads_strict
from sluiceway.tasks.rollout.agent.responses import Responses
from sluiceway.tasks.rollout.agent.session import DROPPED, AgentSession, ModelTurn
from sluiceway.tasks.rollout.client import WeightVersionRefused
from sluiceway.tasks.rollout.multiturn import GenerateContext

SESSION_HEADER = "x-session-id"
KEY_PREFIX = "sk-sluiceway-"
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is a 413; no more of it is read
KEEPALIVE_S = 10.0  # a stream waiting on the engine sends a keep-alive this often
IDLE_TIMEOUT_S = 30.0  # a connection with no request in flight for this long is closed
BODY_TIMEOUT_S = 60.0  # a request body not all read this long after its head is a 408
MAX_CONNECTIONS = 1024  # at most; less where the process's file-handle limit is low (default_max_connections)
REPORT_EVERY_S = 60.0  # a repeated condition (the connection cap, a loop error) is one line this often at most
ADAPTERS: tuple[Adapter, ...] = (ChatCompletions(), Completions(), Responses(), Messages())
log = logging.getLogger("sluiceway")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def default_max_connections() -> int:
    """A quarter of the process's file-handle limit, within [16, MAX_CONNECTIONS]: a flood of connections can
    never take the run to its limit (21,000 idle ones did, issue 40)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft // 4))


def one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


class _Reporter:
    """One log line per condition at most every REPORT_EVERY_S, naming how many times it happened since."""

    def __init__(self):
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, line: str) -> None:
        now = time.monotonic()
        last, n = self._last.get(key, (float("-inf"), 0))
        if now - last < REPORT_EVERY_S:
            self._last[key] = (last, n + 1)
            return
        self._last[key] = (now, 0)
        log.warning("agent endpoint: %s%s", one_line(line, 500), f" ({n} more since the last such line)" if n else "")


class _UvicornLog:
    """What uvicorn's HTTP protocol logs through (its `logger`): each record one line on the run's logger, an
    exception's type and message in place of its traceback."""

    level = logging.WARNING  # uvicorn compares this with its TRACE level

    def __init__(self, report: _Reporter):
        self._report = report

    def log(self, level: int, msg: str, *args, exc_info=None, **_) -> None:
        if level < logging.WARNING:
            return
        text = msg % args if args else msg
        if isinstance(exc_info, BaseException):
            text = f"{text.strip()}: {type(exc_info).__name__}: {exc_info}"
        self._report(f"uvicorn {one_line(msg, 60)}", f"uvicorn: {text}")

    def debug(self, msg, *args, **kw):
        self.log(logging.DEBUG, msg, *args, **kw)

    def info(self, msg, *args, **kw):
        self.log(logging.INFO, msg, *args, **kw)

    def warning(self, msg, *args, **kw):
        self.log(logging.WARNING, msg, *args, **kw)

    def error(self, msg, *args, **kw):
        self.log(logging.ERROR, msg, *args, **kw)

    def exception(self, msg, *args, **kw):
        self.log(logging.ERROR, msg, *args, **kw)


class _Connections:
    """The endpoint's open connections: at most `cap`; those with no request in flight, oldest idle first."""

    def __init__(self, cap: int, idle_s: float, report: _Reporter):
        self.cap, self.idle_s, self._report = cap, idle_s, report
        self.open: set = set()
        self.idle: dict = {}  # protocol -> None, in the order they went idle
        self.evicted = self.refused = 0

    def admit(self, conn) -> bool:
        """False when the cap is reached and no connection is idle: the new one is closed."""
        if len(self.open) >= self.cap:
            if not self.idle:
                self.refused += 1
                self._report("cap", f"{self.cap} connections are open, every one with a request in flight: a new "
                                    f"connection was closed ({self.refused} so far)")  # fmt: skip
                return False
            oldest = next(iter(self.idle))
            self.left(oldest)
            oldest.drop()
            self.evicted += 1
            self._report("cap", f"{self.cap} connections are open (the cap): a new one closed the one idle longest "
                                f"({self.evicted} so far)")  # fmt: skip
        self.open.add(conn)
        return True

    def left(self, conn) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def set_idle(self, conn, idle: bool) -> None:
        self.idle.pop(conn, None)
        if idle and conn in self.open:
            self.idle[conn] = None


def _protocol_class(conns: _Connections, ulog: _UvicornLog):
    """uvicorn's h11 protocol, each connection counted in `conns` and closed when idle past `conns.idle_s` (from
    its opening, or its last answer, until its next request's head is whole: a slow or silent head is idle)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class AgentH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.logger = ulog
            self._idle_timer: asyncio.TimerHandle | None = None
            self._busy: bool | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if not conns.admit(self):
                transport.abort()
                return
            self._update()

        def connection_lost(self, exc) -> None:
            conns.left(self)
            self._cancel()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._update()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._update()

        def _cancel(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def _update(self) -> None:
            if self.transport is None or self.transport.is_closing():
                return
            busy = self.cycle is not None and not self.cycle.response_complete
            if busy == self._busy:
                return
            self._busy = busy
            conns.set_idle(self, not busy)
            self._cancel()
            if not busy:
                self._idle_timer = self.loop.call_later(conns.idle_s, self.drop)

        def drop(self) -> None:
            """Close an idle connection (timed out, or the oldest when the cap is reached)."""
            self._cancel()
            conns.left(self)
            if not self.transport.is_closing():
                self.transport.close()

    return AgentH11Protocol


def _expects_body(scope) -> bool:
    for name, value in scope.get("headers") or []:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def _api_of(path: str) -> Adapter:
    return Messages() if path.rstrip("/").endswith("/v1/messages") else Adapter()


class _Guard:
    """The ASGI app around the routes: an answer sent before its request's body was all read closes the
    connection (nothing more of that body is read), and an exception no handler caught is one log line and, when
    no answer was started, a 500 in the API's own error shape; uvicorn sees none (it would print a traceback)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done = not _expects_body(scope)
        started = False

        async def receive_counted():
            nonlocal body_done
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def send_guarded(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not body_done:
                    message = dict(message, headers=[*message.get("headers", []), (b"connection", b"close")])
            await send(message)

        try:
            await self.app(scope, receive_counted, send_guarded)
        except Exception as e:  # noqa: BLE001 - one line and the API's shape, never uvicorn's traceback
            where = f"{scope.get('method')} {scope.get('path')}"
            log.warning("agent endpoint: %s failed: %s: %s", where, type(e).__name__, one_line(e))
            if not started:
                body = _api_of(scope.get("path", "")).error_body(f"internal error: {type(e).__name__}", 500)
                await send_guarded(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
                    }
                )
                await send_guarded({"type": "http.response.body", "body": encode(body)})


class AgentProxy:
    """The loopback HTTP server of a run's agent sessions, on its own thread and event loop."""

    def __init__(self, max_connections: int | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_body_bytes: int = MAX_BODY_BYTES):  # fmt: skip
        self.max_connections = max_connections or default_max_connections()
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes
        self._report = _Reporter()
        self.connections = _Connections(self.max_connections, idle_timeout_s, self._report)
        self.sessions: dict[str, AgentSession] = {}
        self._by_key: dict[bytes, AgentSession] = {}  # sha256(key) -> session
        # A client that serves many sessions and names each in an X-Session-Id header (verifiers' relay, one per
        # run: tasks/rollout/agent/verifiers.py) holds a gateway key: it opens only the sessions that registered
        # an alias for it, each by that alias. It is the run's own (never handed to model-driven code).
        self._gateways: set[bytes] = set()
        self._by_alias: dict[str, AgentSession] = {}
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
        for name in s.aliases:
            if self._by_alias.get(name) is s:
                del self._by_alias[name]

    def gateway_key(self) -> str:
        """A new gateway key (see __init__): it opens a session only by an alias the session registered with
        `alias(s, name, gateway)`."""
        key = KEY_PREFIX + "gw-" + secrets.token_urlsafe(32)
        self._gateways.add(_digest(key))
        return key

    def drop_gateway(self, key: str) -> None:
        self._gateways.discard(_digest(key))

    def alias(self, s: AgentSession, name: str, gateway: str | None = None) -> None:
        """Another name for `s` in an X-Session-Id header, with its own key or (given) the gateway key."""
        s.aliases.add(name)
        if gateway is not None:
            s.gateway = _digest(gateway)
            self._by_alias[name] = s

    def session_for(self, key: str, sid: str | None, header_sid: str | None) -> AgentSession:
        """The session a key opens; SessionError 401 for no or an unknown key, 404 when the path or the header
        names another session."""
        if key and _digest(key) in self._gateways:
            s = self._by_alias.get(header_sid) if header_sid else None
            if s is None or s.gateway != _digest(key) or (sid is not None and sid != s.sid):
                raise SessionError(f"unknown session {header_sid or sid}", 404)
            return s
        s = self._by_key.get(_digest(key)) if key else None
        if s is None or not secrets.compare_digest(s.key.encode(), key.encode()):
            raise SessionError("invalid API key: use the key your session was given", 401)
        if sid is not None and sid != s.sid:
            raise SessionError(f"unknown session {sid}", 404)
        if header_sid is not None and header_sid != s.sid and header_sid not in s.aliases:
            raise SessionError(f"unknown session {header_sid}", 404)
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
        # Connections are bounded by the protocol (_Connections: a cap, idle ones closed), not by uvicorn's
        # limit_concurrency, which answers a plain-text 503 only once a request arrives and holds idle ones forever.
        self.connections = _Connections(self.max_connections, self.idle_timeout_s, self._report)
        protocol = _protocol_class(self.connections, _UvicornLog(self._report))
        config = uvicorn.Config(_Guard(self._app()), http=protocol, log_level="warning", access_log=False,
                                lifespan="off", log_config=None, backlog=MAX_CONNECTIONS,
                                timeout_keep_alive=max(1, int(self.idle_timeout_s)))  # fmt: skip
        server = self._server = uvicorn.Server(config)
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        def loop_error(loop, context) -> None:  # e.g. accept() out of file handles: one line, not a traceback each
            e = context.get("exception")
            what = context.get("message") or "error"
            self._report(f"loop {one_line(what, 60)}", f"{what}" + (f": {type(e).__name__}: {e}" if e else ""))

        loop.set_exception_handler(loop_error)

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
        from starlette.responses import JSONResponse, Response, StreamingResponse
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

        async def body_of(request) -> bytes:
            """The body, read as it streams and counted: SessionError 413 past the limit (the rest never read;
            the guard closes the connection), 408 when it is not all there within BODY_TIMEOUT_S."""
            limit = self.max_body_bytes
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > limit:
                raise SessionError(f"the request is {int(size)} bytes, more than {limit}", 413)
            data = bytearray()
            try:
                async with asyncio.timeout(BODY_TIMEOUT_S):
                    async for chunk in request.stream():
                        data += chunk
                        if len(data) > limit:
                            raise SessionError(f"the request body is more than {limit} bytes", 413)
            except TimeoutError:
                raise SessionError(f"the request body was not all sent within {BODY_TIMEOUT_S:g} s", 408) from None
            return bytes(data)

        async def read(request, api: Adapter) -> tuple[AgentSession | None, dict | None, JSONResponse | None]:
            try:
                s = who(request)
            except SessionError as e:
                return None, None, err(api, str(e), e.status)
            try:
                body = loads_strict(await body_of(request))
            except SessionError as e:
                return s, None, err(api, str(e), e.status)
            except ValueError as e:  # not JSON, NaN, a lone surrogate, nested too deep: what a client cannot mean
                return s, None, err(api, f"the body is not valid JSON: {one_line(e)}", 400)
            except ClientDisconnect:  # gone before its request was read: the session is abandoned all the same
                s.aborted = s.aborted or DROPPED
                return s, None, err(api, "the client disconnected", 400)
            if not isinstance(body, dict):
                return s, None, err(api, "the body must be a JSON object", 400)
            return s, body, None

        def unsendable(s: AgentSession, e: Exception) -> str:
            """An answer that cannot be serialised: the agent never sees its turn, so the session is aborted (its
            turn is never trained)."""
            why = f"the answer to a model call could not be serialised ({type(e).__name__}: {one_line(e, 200)})"
            s.aborted = s.aborted or why
            log.warning("agent endpoint: session %s aborted: %s", s.sid, why)
            return why

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
                log.warning("agent endpoint: a %s request could not be read: %s: %s", api.name, type(e).__name__,
                            one_line(e))  # fmt: skip
                return err(api, f"the request could not be read: {type(e).__name__}: {str(e)[:300]}", 500)
            except BaseException:
                s.lock.release()
                raise
            if call.stream:
                return stream(request, api, s, call)
            try:
                turn = await s.generate(call.req)
            except SessionError as e:
                s.lock.release()
                return err(api, str(e), e.status)
            except Exception as e:  # noqa: BLE001 - the engines failed the turn
                s.lock.release()
                return err(api, failed(s, e), 502)
            try:  # serialised before the lock is let go: a turn whose answer cannot be sent is never kept
                data = encode(api.reply(call, turn))
            except Exception as e:  # noqa: BLE001 - NaN, a lone surrogate, or any fault building the answer
                return err(api, unsendable(s, e), 500)
            finally:
                s.lock.release()
            if await request.is_disconnected():  # the agent never sees this turn: the trajectory is not its
                s.aborted = s.aborted or DROPPED
            return Response(data, media_type="application/json")

        def stream(request, api: Adapter, s: AgentSession, call: Call):
            try:  # the first events, serialised before the engine is asked
                head = [e.encode() for e in api.stream_head(call, s)]
            except Exception as e:  # noqa: BLE001 - the call's messages are in the session already: it ends
                why = unsendable(s, e)
                s.lock.release()
                return err(api, why, 500)

            async def run() -> tuple[ModelTurn, list[bytes]]:
                try:
                    turn = await s.generate(call.req)
                    try:  # serialised before the lock is let go, as an unstreamed answer is
                        return turn, [e.encode() for e in api.stream_turn(call, turn)]
                    except Exception as e:  # noqa: BLE001 - NaN, a lone surrogate: the agent never sees the turn
                        raise SessionError(unsendable(s, e), 500) from None
                finally:
                    s.lock.release()

            task = asyncio.ensure_future(run())

            async def events() -> AsyncIterator[str | bytes]:
                sent = False
                try:
                    for e in head:
                        yield e
                    while True:
                        try:
                            _, tail = await asyncio.wait_for(asyncio.shield(task), KEEPALIVE_S)
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

        async def unexpected(request, exc: Exception):  # the shape; _Guard, which sees it raised next, logs it
            return err(_api_of(request.url.path), f"internal error: {type(exc).__name__}", 500)

        return Starlette(routes=routes, exception_handlers={Exception: unexpected})
