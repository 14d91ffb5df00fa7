"""Issue 40, the agent endpoint's points, against the real endpoint on loopback with a scripted engine:

1. a flood of idle connections (21,000 took the run to its file-handle limit, 450,560 tracebacks, no recovery):
   the endpoint holds at most its cap, closes the connection idle longest for a new one and idle ones after its
   timeout (a silent or trickled request head too), a session completes through the flood, the file handles come
   back, one log line;
8. a chunked body past the 16 MiB limit (a 300 MB one was read whole): a 413 in the API's shape once the limit
   is passed, the rest never read, the session goes on;
9. and 11. bodies that were 500s (tracebacks) or taken as something else: 400s in the API's shape;
6. an answer that cannot be serialised (NaN, a lone surrogate): refused at the door when it comes from the
   request, never built from a model's tool call, and otherwise the session is aborted, never trained.
"""

import asyncio
import os
import socket
import threading
import time

import httpx
import pytest
from agent_helpers import ScriptedEngine, agent_module, run_agent_async

from sluiceway.tasks.rollout.agent.server import AgentProxy

SLACK_FDS = 8  # file handles the process may open meanwhile (a tokenizer's file, a log)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(cond, what: str, limit_s: float = 120.0) -> None:
    """Polls `cond` (a wait for something to happen, not a timing check: the limit only ends a hung test)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)


def peer_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def no_tracebacks(caplog, capfd) -> None:
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    for r in caplog.records:
        assert r.exc_info is None and "\n" not in r.getMessage(), r.getMessage()


GOOD_AGENT = """
import openai

def agent(base_url, api_key, prompt):
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "hello", r
    return 1.0
"""


# ------------------------------------------------------------------------------------------ 1. connections
def test_a_connection_flood_is_bounded_and_a_session_completes_through_it(tiny, tmp_path, caplog, capfd):
    _, tok = tiny
    cap, n = 32, 300
    endpoint = AgentProxy(max_connections=cap)
    endpoint.start()
    flood: list[socket.socket] = []
    try:
        before = fds()
        for i in range(n):  # idle: nothing sent, or a request head begun and never finished
            c = socket.create_connection(("127.0.0.1", endpoint.port))
            if i % 3 == 0:
                c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            flood.append(c)
        wait_until(lambda: endpoint.connections.evicted >= n - cap, "the flood's oldest connections closed")
        assert len(endpoint.connections.open) <= cap
        # The endpoint's side holds its cap, not the flood (a closed connection's handle goes at the loop's next turn).
        wait_until(lambda: fds() - before - n <= cap + SLACK_FDS, "the endpoint's handles down to its cap")
        # A session started now, with the flood still open, completes: its connection closes the one idle longest.
        engine = ScriptedEngine(tok, ["hello"])
        res = asyncio.run(run_agent_async(tok, agent_module(tmp_path, GOOD_AGENT), engine, endpoint=endpoint))
        assert res.abort_reason is None and res.reward == 1.0 and res.turns == 1 and len(engine.calls) == 1
        assert sum(peer_closed(c) for c in flood) >= n - cap  # closed by the endpoint, seen by the flooder
        for c in flood:
            c.close()
        flood = []
        wait_until(lambda: not endpoint.connections.open, "the endpoint's connections closed")
        wait_until(lambda: fds() <= before + SLACK_FDS, "the file handles back")
        # ... and the endpoint still answers.
        r = httpx.get(endpoint.url + "/v1/models", headers={"Authorization": "Bearer sk-sluiceway-nobody"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    finally:
        for c in flood:
            c.close()
        endpoint.stop()
    lines = [r.getMessage() for r in caplog.records if "agent endpoint" in r.getMessage()]
    assert 1 <= len(lines) <= 2 and all("connections are open" in m for m in lines), lines  # once a minute at most
    no_tracebacks(caplog, capfd)


def test_idle_connections_and_trickled_heads_are_closed(caplog, capfd):
    endpoint = AgentProxy(idle_timeout_s=1)
    endpoint.start()
    stop = threading.Event()
    try:
        silent = socket.create_connection(("127.0.0.1", endpoint.port))
        trickled = socket.create_connection(("127.0.0.1", endpoint.port))
        after_answer = socket.create_connection(("127.0.0.1", endpoint.port))

        def trickle():  # a byte of a request head at a time, each well within the idle timeout: still idle
            for b in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 10_000:
                if stop.wait(0.2):
                    return
                try:
                    trickled.sendall(bytes([b]))
                except OSError:
                    return

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        after_answer.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # answered (401), then idle
        wait_until(lambda: b"401" in after_answer.recv(1 << 16), "the answer")
        for c in (silent, trickled, after_answer):
            wait_until(lambda c=c: peer_closed(c), "an idle connection closed")
        wait_until(lambda: not endpoint.connections.open, "no connection held")
        for c in (silent, trickled, after_answer):
            c.close()
    finally:
        stop.set()
        endpoint.stop()
    no_tracebacks(caplog, capfd)


# ------------------------------------------------------------------------------------------ 8. bodies
CHUNKED_AGENT = r"""
import json, socket, threading, openai

TOTAL = 300 << 20  # 300 MiB, sent in 1 MiB chunks until the endpoint closes the connection

def agent(base_url, api_key, prompt):
    path = prompt["prompt"]
    hostport, rest = base_url.split("//")[1].split("/", 1)
    host, port = hostport.split(":")
    s = socket.create_connection((host, int(port)))
    head = (f"POST /{rest}{path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\nx-api-key: {api_key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    s.sendall(head.encode())
    piece = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
    sent = [0]

    def send():
        try:
            while sent[0] < TOTAL:
                s.sendall(piece)
                sent[0] += 1 << 20
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the endpoint closed the connection

    t = threading.Thread(target=send, daemon=True)
    t.start()
    answer = b""
    while True:
        try:
            got = s.recv(1 << 16)
        except OSError:
            break
        if not got:
            break
        answer += got
    t.join()
    s.close()
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"connection: close" in rest.lower(), answer[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    if path == "/messages":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large", body
    else:
        assert body["error"]["code"] == 413 and "more than 16777216 bytes" in body["error"]["message"], body
    assert sent[0] < 64 << 20, f"{sent[0]} bytes were taken of a body refused past 16 MiB"
    # The session goes on.
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "hello", r
    return 1.0
"""


@pytest.mark.parametrize("path", ["/chat/completions", "/messages"])
def test_a_300_mb_chunked_body_is_refused_past_the_limit_and_the_session_goes_on(tiny, tmp_path, caplog, capfd, path):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["hello"])
    res = asyncio.run(run_agent_async(tok, agent_module(tmp_path, CHUNKED_AGENT), engine, prompt=path))
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 1 and len(engine.calls) == 1
    no_tracebacks(caplog, capfd)


# ------------------------------------------------------------------------------------------ 9, 11, 6. bad input
BAD_INPUT_AGENT = r"""
import json, httpx

def agent(base_url, api_key, prompt):
    h = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key, "Content-Type": "application/json"}
    session = base_url.removesuffix("/v1")

    def post(path, body):
        return httpx.post(session + path, content=body if isinstance(body, str) else json.dumps(body), headers=h)

    user = [{"role": "user", "content": "hi"}]
    after = lambda calls: [*user, {"role": "assistant", "content": "", "tool_calls": calls},
                           {"role": "user", "content": "x"}]
    chat, responses, completions, messages = "/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages"
    cases = {
        "JSON nested 1,100 deep": (chat, '{"messages": ' + "[" * 1100 + "]" * 1100 + "}", "nested more than 64"),
        "JSON nested 100 deep": (chat, '{"messages": ' + "[" * 100 + "]" * 100 + "}", "nested more than 64"),
        "a 400-digit reward": ("/reward", '{"reward": 1' + "0" * 400 + "}", "float32"),
        "NaN reward": ("/reward", '{"reward": NaN}', "finite"),
        "tool_calls: 5": (chat, {"messages": after(5)}, "tool_calls"),
        "tool_calls: [1, 2]": (chat, {"messages": after([1, 2])}, "tool_calls[0]"),
        "a call with no name": (chat, {"messages": after([{"type": "function", "function": {}}])}, "name"),
        "arguments not a string": (chat, {"messages": after([{"function": {"name": "f", "arguments": {}}}])},
                                   "arguments"),
        "previous_response_id a list": (responses, {"input": "hi", "previous_response_id": ["a"]}, "a string"),
        "previous_response_id an object": (responses, {"input": "hi", "previous_response_id": {"a": 1}}, "a string"),
        "previous_response_id a number": (responses, {"input": "hi", "previous_response_id": 12345}, "a string"),
        "a lone surrogate in content": (chat, '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                                        "lone surrogate"),
        "a lone surrogate as model": (responses, '{"model": "\\udfff", "input": "hi"}', "lone surrogate"),
        "a lone surrogate as a key": (chat, '{"messages": [{"role": "user", "content": "x", "\\udc00": 1}]}',
                                      "lone surrogate"),
        "metadata holding NaN": (responses, '{"input": "hi", "metadata": {"a": NaN}}', "finite"),
        "metadata holding 1e999": (responses, '{"input": "hi", "metadata": {"a": 1e999}}', "finite"),
        "metadata holding a number": (responses, {"input": "hi", "metadata": {"a": 1}}, "metadata"),
        "model an object": (chat, {"model": {"x": 1}, "messages": user}, "model must be a string"),
        "token id 10**12": (completions, {"prompt": [1, 10**12]}, "token id"),
        "token id -1": (completions, {"prompt": [-1]}, "token id"),
        "token id true": (completions, {"prompt": [True, 5]}, "token id"),
        "a tool_use named 5": (messages, {"max_tokens": 8, "messages": [*user, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": 5, "input": {}}]}, {"role": "user", "content": "x"}]},
            "tool_use"),
        "function_call arguments an object": (responses, {"input": [
            {"type": "function_call", "name": "add", "arguments": {"a": 1}, "call_id": "c"}]}, "arguments"),
    }
    for name, (path, body, want) in cases.items():
        r = post(path, body)
        j = r.json()
        msg = j["error"]["message"]
        assert r.status_code == 400 and want in msg, (name, r.status_code, r.text[:300])
        if path == messages:
            assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", (name, j)
        else:
            assert j["error"]["type"] == "invalid_request_error", (name, j)
    r = post(responses, {"input": "hi", "previous_response_id": "resp_nope"})  # a string not of this session: 404
    assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"], r.text
    # None of that touched the session: a good call, then the reward.
    r = post(chat, {"messages": user, "model": "policy \u00e9\U0001F600"})  # non-ASCII, a surrogate pair: fine
    assert r.status_code == 200 and r.json()["model"] == "policy \u00e9\U0001F600", r.text
    assert post("/reward", {"reward": 0.5}).status_code == 200
"""


def test_bad_bodies_are_400s_in_the_apis_shape_without_a_traceback(tiny, tmp_path, caplog, capfd):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["hello"])
    res = asyncio.run(run_agent_async(tok, agent_module(tmp_path, BAD_INPUT_AGENT), engine))
    assert res.abort_reason is None and res.reward == 0.5 and res.turns == 1 and len(engine.calls) == 1
    no_tracebacks(caplog, capfd)


def test_an_unexpected_failure_is_one_line_and_the_apis_500(caplog, capfd, monkeypatch):
    endpoint = AgentProxy()

    def boom(*a):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(endpoint, "session_for", boom)
    endpoint.start()
    try:
        r = httpx.post(endpoint.url + "/v1/chat/completions", json={"messages": []})
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal error: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": 500,
        }
        r = httpx.post(endpoint.url + "/v1/messages", json={"messages": []})
        assert r.status_code == 500 and r.json() == {
            "type": "error",
            "error": {"type": "api_error", "message": "internal error: RuntimeError"},
        }
        r = httpx.post(endpoint.url + "/v1/models", content=b"x" * 100)  # 405, its body unread: then closed
        assert r.status_code == 405 and r.headers["connection"] == "close"
        for _ in range(3):  # uvicorn's own complaint: one line, the repeats counted in the next one
            with socket.create_connection(("127.0.0.1", endpoint.port)) as c:
                c.sendall(b"NOT HTTP\r\n\r\n")
                assert c.recv(1 << 16).startswith(b"HTTP/1.1 400")
        for _ in range(3):  # the loop's own errors (accept() out of file handles, say): one line
            err = OSError(24, "Too many open files")
            context = {"message": "socket.accept() out of system resource", "exception": err}
            endpoint.loop.call_soon_threadsafe(endpoint.loop.call_exception_handler, context)
        wait_until(lambda: any("out of system resource" in r.getMessage() for r in caplog.records), "the loop's line")
    finally:
        endpoint.stop()
    lines = [r.getMessage() for r in caplog.records if "agent endpoint" in r.getMessage()]
    assert len(lines) == 4, lines
    assert all("RuntimeError: boom second line" in m for m in lines[:2]), lines
    assert "uvicorn: Invalid HTTP request received." in lines[2], lines
    assert "socket.accept() out of system resource: OSError: [Errno 24] Too many open files" in lines[3], lines
    no_tracebacks(caplog, capfd)


NAN_TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>'

ANTHROPIC_AGENT = """
import anthropic

def agent(base_url, api_key, prompt):
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    tools = [{"name": "add", "input_schema": {"type": "object"}}]
    m = client.messages.create(model="policy", max_tokens=64, tools=tools,
                               messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"], m
    assert "NaN" in m.content[0].text
    return 1.0
"""


def test_a_tool_call_holding_nan_stays_text_and_is_answered(tiny, tmp_path, caplog, capfd):
    """Issue 40 point 6 from the model's side: a `<tool_call>` holding NaN was an Anthropic `input` no JSON can
    carry (a 500 after the turn was kept); it is text, as any block that is not such JSON."""
    _, tok = tiny
    engine = ScriptedEngine(tok, [NAN_TOOL_CALL])
    res = asyncio.run(run_agent_async(tok, agent_module(tmp_path, ANTHROPIC_AGENT), engine))
    assert res.abort_reason is None and res.reward == 1.0 and res.turns == 1
    no_tracebacks(caplog, capfd)


UNSENDABLE_AGENT = """
import json, httpx

STREAM = {stream}

def agent(base_url, api_key, prompt):
    h = {{"Authorization": f"Bearer {{api_key}}"}}
    body = {{"model": "policy", "messages": [{{"role": "user", "content": "hi"}}], "stream": STREAM}}
    r = httpx.post(base_url + "/chat/completions", json=body, headers=h)
    if STREAM:
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {{")]
        assert "could not be serialised" in events[-1]["error"]["message"], r.text
    else:
        assert r.status_code == 500 and "could not be serialised" in r.json()["error"]["message"], r.text
    r = httpx.post(base_url + "/reward", json={{"reward": 0.9}}, headers=h)
    assert r.status_code == 409 and "aborted" in r.json()["error"]["message"], r.text
    return 0.9
"""


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_cannot_be_serialised_aborts_its_session(tiny, tmp_path, caplog, capfd, monkeypatch, stream):
    """Issue 40 point 6, the mechanism: whatever makes an answer unsendable (here an adapter that writes NaN), the
    call is a 500 in the API's shape (streamed: its error event), and the turn the agent never saw is not trained:
    the session is aborted and a reward posted after it refused."""
    from sluiceway.tasks.rollout.agent.api import sse
    from sluiceway.tasks.rollout.agent.openai import ChatCompletions

    _, tok = tiny
    monkeypatch.setattr(ChatCompletions, "reply", lambda self, call, turn: {"id": call.id, "x": float("nan")})
    monkeypatch.setattr(ChatCompletions, "stream_turn", lambda self, call, turn: [sse({"x": float("nan")})])
    engine = ScriptedEngine(tok, ["hello"])
    res = asyncio.run(run_agent_async(tok, agent_module(tmp_path, UNSENDABLE_AGENT.format(stream=stream)), engine))
    assert len(engine.calls) == 1 and res.finish_reason == "abort" and res.reward is None
    assert "could not be serialised (ValueError: Out of range float values are not JSON compliant" in res.abort_reason
    lines = [r.getMessage() for r in caplog.records if "agent endpoint" in r.getMessage()]
    assert len(lines) == 1 and "aborted" in lines[0], lines
    no_tracebacks(caplog, capfd)
