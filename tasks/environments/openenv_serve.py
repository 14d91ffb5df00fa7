"""Serves an OpenEnv environment class on loopback with openenv's own `create_app`: run by the interpreter that has
openenv (the Makefile's .venv-openenv), never imported by the run (it imports no sluiceway module).

    python openenv_serve.py serve TARGET MAX_SESSIONS    # prints "PORT <port> CAPACITY <n>", then serves
    python openenv_serve.py check TARGET                 # prints "SCHEMA <json>" and exits

TARGET is `package.module:Class` or `path/to/file.py:Class`, an `openenv.core.env_server.Environment` subclass.
Its action and observation models are read from its declaration, `class Game(Environment[GuessAction,
GuessObservation, GameState])`, or else from `step`'s annotations (`def step(self, action: GuessAction) ->
GuessObservation`; of a Union, the member that is not an MCP model). TARGET may also name an app made with
create_app (`server.app:app`): it is served as it is. An environment that does not declare
SUPPORTS_CONCURRENT_SESSIONS = True is served with one session (openenv refuses more); the run starts another
server for each session it runs at once.
A mistake is one line, "ERROR <why>", on stdout, and exit status 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import socket
import sys
import threading
import time
import typing


def fail(msg: str) -> typing.NoReturn:
    print(f"ERROR {msg}", flush=True)
    sys.exit(2)


def load_target(target: str):
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        fail(f"{target}: expected 'package.module:Class' or 'file.py:Class'")
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                fail(f"{target}: {module_name} not found")
            sys.path[:0] = [os.path.dirname(path), os.getcwd()]  # its siblings, and the package root it is run from
            spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's module: its failure is one line
        fail(f"{target}: importing {module_name} raised {type(e).__name__}: {str(e)[:300]}")
    cls = getattr(module, attr, None)
    if cls is None:
        fail(f"{target}: {module_name} has no '{attr}'")
    return cls


def _is(x, base) -> bool:
    return inspect.isclass(x) and issubclass(x, base)


def _pick(hint, base):
    """`hint` if it is a `base` subclass; of a Union (`EchoAction | CallToolAction`), its first member that is one
    and is not one of openenv's MCP models (an environment taking both serves its own model as the action)."""
    from openenv.core.env_server import mcp_types

    if _is(hint, base):
        return hint
    mcp = (mcp_types.ListToolsAction, mcp_types.CallToolAction, mcp_types.ListToolsObservation,
           mcp_types.CallToolObservation)  # fmt: skip
    members = [a for a in typing.get_args(hint) if _is(a, base)]
    return next((a for a in members if a not in mcp), members[0] if members else None)


def models_of(cls):
    """(action, observation, state) classes of an Environment subclass; state may be None."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        fail(f"{cls!r} is not an openenv Environment subclass")
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            args = typing.get_args(base)
            if inspect.isclass(origin) and issubclass(origin, Environment) and len(args) >= 2:
                act, obs = args[0], args[1]
                state = args[2] if len(args) > 2 else None
                if (
                    inspect.isclass(act)
                    and inspect.isclass(obs)
                    and issubclass(act, Action)
                    and issubclass(obs, Observation)
                ):
                    return act, obs, state if _is(state, State) else None
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001
        hints = {}
    params = list(inspect.signature(cls.step).parameters)
    act = _pick(hints.get(params[1]), Action) if len(params) > 1 else None
    obs = _pick(hints.get("return"), Observation)
    if _is(act, Action) and _is(obs, Observation):
        return act, obs, None
    fail(
        f"{cls.__name__}: cannot tell its action and observation models: declare it as "
        f"Environment[MyAction, MyObservation, MyState] or annotate step(self, action: MyAction) -> MyObservation"
    )


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("serve", "check"):
        fail("usage: openenv_serve.py serve TARGET MAX_SESSIONS | check TARGET")
    cls = load_target(argv[1])
    if not inspect.isclass(cls) and hasattr(cls, "router") and callable(cls):
        return serve_app(argv, cls)
    act, obs, state = models_of(cls)
    concurrent = bool(getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
    if argv[0] == "check":
        schema = {"action": act.model_json_schema(), "observation": obs.model_json_schema(), "concurrent": concurrent}
        print("SCHEMA " + json.dumps(schema), flush=True)
        return
    from openenv.core.env_server.http_server import create_app

    os.environ["ENABLE_WEB_INTERFACE"] = "false"  # the plain API: no gradio UI
    capacity = max(1, int(argv[2])) if concurrent else 1
    kwargs = {"state_cls": state} if state is not None else {}
    try:
        app = create_app(cls, act, obs, env_name=cls.__name__, max_concurrent_envs=capacity, **kwargs)
    except Exception as e:  # noqa: BLE001
        fail(f"{argv[1]}: openenv's create_app raised {type(e).__name__}: {str(e)[:300]}")
    _run(app, capacity)


def serve_app(argv: list[str], app) -> None:
    """TARGET names an app its author built with create_app (`server.app:app`): served as it is, with the models
    and the session limit it was made with (CAPACITY 0: unknown to the run, which waits when it is reached)."""
    if argv[0] == "check":
        from fastapi.testclient import TestClient

        r = TestClient(app).get("/schema")
        if r.status_code != 200 or not isinstance(r.json().get("action"), dict):
            fail(f"{argv[1]}: an app without OpenEnv's /schema (answered {r.status_code}): is it made by create_app?")
        print("SCHEMA " + json.dumps({**r.json(), "concurrent": None, "app": True}), flush=True)
        return
    _run(app, 0)


def _run(app, capacity: int) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_ping_interval=None, lifespan="on"))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    print(f"PORT {sock.getsockname()[1]} CAPACITY {capacity}", flush=True)
    server.run(sockets=[sock])


def _exit_with_parent(parent: int) -> None:
    """The run started this server in a session of its own: should the run die without stopping it (SIGKILL, OOM),
    the server goes too rather than outlive it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
