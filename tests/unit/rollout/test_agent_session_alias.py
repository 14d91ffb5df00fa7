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
