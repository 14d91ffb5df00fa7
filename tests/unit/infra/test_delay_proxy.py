"""sluiceway.infra.netns.DelayProxy on loopback (no namespace needed): bytes pass both ways unchanged and are
counted, a connection chosen for a reset gets an RST, and a refusing proxy refuses until it accepts again."""

from __future__ import annotations

import socket
import threading

import pytest

from sluiceway.infra.netns import DelayProxy, WanLink, rate_bits


@pytest.fixture
def echo_server():
    """Echoes what it gets."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(c,), daemon=True).start()

    def echo(c):
        with c:
            try:
                while data := c.recv(65536):
                    c.sendall(data)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_bytes_pass_unchanged_and_are_counted(echo_server):
    payload = bytes(range(256)) * 4000  # ~1 MB: several chunks each way
    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo_server), delay_s=0.01) as proxy:
        for _ in range(2):
            assert exchange(proxy.port, payload) == payload
        assert proxy.stats["connections"] == 2 and proxy.stats["resets"] == 0
        assert proxy.stats["up"] == 2 * len(payload) and proxy.stats["down"] == 2 * len(payload)
        assert proxy.stats["exchanges"] >= 2


def test_a_connection_chosen_for_reset_gets_an_rst(echo_server):
    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo_server), reset_fraction=1.0, seed=0) as proxy:
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(50):  # the cut comes after a random number of bytes (or at the first end)
                exchange(proxy.port, b"x" * 65536)
        assert proxy.stats["resets"] >= 1


def test_a_request_on_a_kept_alive_connection_can_be_reset(echo_server):
    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo_server), reset_per_request=1.0, seed=0) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as s:
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                for _ in range(50):
                    s.sendall(b"y" * 65536)
                    s.recv(65536)
        assert proxy.stats["connections"] == 1 and proxy.stats["resets"] == 1


def test_refuse_then_accept_on_the_same_port(echo_server):
    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo_server)) as proxy:
        port = proxy.port
        assert exchange(port, b"hi") == b"hi"
        proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            exchange(port, b"hi")
        proxy.accept()
        assert proxy.port == port and exchange(port, b"hi") == b"hi"


def test_rates_and_names_are_checked():
    assert rate_bits("1gbit") == 10**9 and rate_bits("100mbit") == 10**8 and rate_bits("2.5kbit") == 2500
    with pytest.raises(ValueError, match="rate"):
        rate_bits("1GB/s")
    with pytest.raises(ValueError, match="namespace name"):
        WanLink("a-name-far-too-long")
