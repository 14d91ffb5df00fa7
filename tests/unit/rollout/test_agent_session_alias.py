"""An `X-Session-Id` header may name a session by an alias it registered (verifiers sends its trace's id there,
tasks/rollout/agent/verifiers.py); any other id there is still a 404, and the key still decides the session."""

import pytest

from sluiceway.tasks.rollout.agent.render import SessionError
from sluiceway.tasks.rollout.agent.server import AgentProxy, _digest
from sluiceway.tasks.rollout.agent.session import AgentSession


def test_a_registered_alias_names_the_session_and_nothing_else_does():
    proxy = AgentProxy()
    a = AgentSession("a" * 32, ctx=None, params={}, renderer=None, key="sk-a")
    b = AgentSession("b" * 32, ctx=None, params={}, renderer=None, key="sk-b")
    for s in (a, b):
        proxy.sessions[s.sid] = s
        proxy._by_key[_digest(s.key)] = s
    a.aliases.add("trace-1")
    assert proxy.session_for("sk-a", None, "trace-1") is a
    assert proxy.session_for("sk-a", a.sid, a.sid) is a
    for key, sid, header in (("sk-a", None, "trace-2"), ("sk-b", None, "trace-1"), ("sk-a", b.sid, "trace-1")):
        with pytest.raises(SessionError) as e:
            proxy.session_for(key, sid, header)
        assert e.value.status == 404


def test_a_gateway_key_opens_only_the_sessions_registered_for_it_by_their_alias():
    proxy = AgentProxy()
    a = AgentSession("a" * 32, ctx=None, params={}, renderer=None, key="sk-a")
    b = AgentSession("b" * 32, ctx=None, params={}, renderer=None, key="sk-b")
    for s in (a, b):
        proxy.sessions[s.sid] = s
        proxy._by_key[_digest(s.key)] = s
    gw, other = proxy.gateway_key(), proxy.gateway_key()
    proxy.alias(a, "trace-a", gw)
    proxy.alias(b, "trace-b")  # b's own key only
    assert proxy.session_for(gw, None, "trace-a") is a
    for key, sid, header in ((gw, None, "trace-b"), (gw, None, None), (gw, b.sid, "trace-a"), (other, None, "trace-a")):
        with pytest.raises(SessionError) as e:
            proxy.session_for(key, sid, header)
        assert e.value.status == 404
    proxy.close(a)  # closed: its alias opens nothing
    with pytest.raises(SessionError):
        proxy.session_for(gw, None, "trace-a")
    proxy.drop_gateway(gw)
    with pytest.raises(SessionError) as e:
        proxy.session_for(gw, None, "trace-a")
    assert e.value.status == 401
