"""The worker process's side of verifiers episodes (tasks/rollout/agent/verifiers_worker.py runs it): the
environment, its tasks and serving resources, one episode at a time on the worker's loop, and each episode's plain
summary, which tasks/rollout/agent/verifiers.py judges in the run."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from sluiceway.tasks.environments import verifiers_env
from sluiceway.tasks.rollout.agent.server import one_line

log = logging.getLogger("sluiceway")
KEY_VAR = "SLUICEWAY_VERIFIERS_API_KEY"  # the variable verifiers' client reads the run's gateway key from
MODEL = "policy"


def _errors(episode) -> list:
    out = list(episode.errors)
    for t in episode.traces:
        out += list(t.errors)
    return out


def episode_summary(episode) -> dict:
    """What judging an episode needs, as plain data: it crosses from the worker process to the run (a verifiers
    Episode does not). Plain logic over verifiers' Episode and Trace."""
    traces = list(episode.traces)
    errors = _errors(episode)
    out: dict[str, Any] = {
        "traces": len(traces),
        "ok": bool(episode.ok),
        "timed_out": bool(episode.is_timeout or any(t.is_timeout for t in traces)),
        "error": (str(errors[0].type), str(errors[0].message)) if errors else None,
        "trace": None,
    }
    if traces:
        t = traces[0]
        rewards = {k: None if r is None else (r.score, r.weight) for k, r in t.rewards.items()}
        try:
            total = t.reward if all(r is not None for r in rewards.values()) else None
        except Exception:  # noqa: BLE001 - a sum verifiers cannot make: judged from the rewards themselves
            total = None
        out["trace"] = {"id": t.id, "rewards": rewards, "metrics": dict(t.metrics), "calls": len(t.calls),
                        "branches": t.num_branches, "stop_condition": t.stop_condition, "ok": bool(t.ok),
                        "reward": total}  # fmt: skip
    return out


class Episodes:
    """The worker process's side (tasks/rollout/agent/verifiers_worker.py): the environment, its tasks, its serving
    resources (verifiers' interception server, shared tool servers: started on the worker's loop at the first
    episode, until `close`) and the model context pointing verifiers' eval client at the run's endpoint."""

    def __init__(self, source: str, args: dict | None, size: int | None) -> None:
        self.name = verifiers_env.env_name(source)
        self.size = size
        self.env = verifiers_env.load_env(source, args)
        self._tasks: dict[int, Any] = {}
        self._serving: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._serve_error: BaseException | None = None
        self._ctx = None
        self._ctx_for: tuple[str, str] | None = None

    def task(self, idx: int) -> Any:
        return verifiers_env.task_at(self.env, self._tasks, idx, self.size)

    async def _serve(self) -> None:
        try:
            async with self.env.serving():
                self._ready.set()
                await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every episode then fails with this reason (a SystemExit too)
            self._serve_error = e
        finally:
            self._ready.set()

    async def _servers_alive(self) -> bool:
        """Whether the taskset's shared tool servers (started by `serving`) still accept connections."""
        from urllib.parse import urlsplit

        for server in (getattr(self.env, "_shared_tools", None) or {}).values():
            if getattr(server, "external", False):
                continue  # a config-url server: not the run's to restart
            u = urlsplit(server.url)
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port or 80), 5)
                writer.close()
            except (OSError, TimeoutError):
                return False
        return True

    async def _restart_if_dead(self) -> None:
        """After a failed episode: a shared tool server that died is started again (all of `serving`) for the
        next episodes; the ones in flight with the dead one fail with their reasons."""
        serving = self._serving
        if serving is None or serving.done() or self._stop.is_set() or await self._servers_alive():
            return
        log.warning("verifiers %s: a shared tool server is down; the environment's servers start again", self.name)
        self._stop.set()
        await asyncio.wait({serving}, timeout=30)
        if self._serving is serving:
            self._serving = None

    async def _ensure_serving(self) -> None:
        if self._serving is None or self._serving.done():
            self._ready, self._stop, self._serve_error = asyncio.Event(), asyncio.Event(), None
            self._serving = asyncio.get_running_loop().create_task(self._serve())
        await self._ready.wait()
        if self._serve_error is not None:
            e = self._serve_error
            raise RuntimeError(f"starting the environment's servers failed: {type(e).__name__}: {one_line(e, 200)}")

    def _context(self, base_url: str, gateway: str):
        """verifiers' eval client on the endpoint's root with the gateway key: one client config while they stay
        the same (verifiers keeps a client per distinct config until it stops)."""
        import verifiers.v1 as vf

        if self._ctx is None or self._ctx_for != (base_url, gateway):
            os.environ[KEY_VAR] = gateway  # this process's only: the run's child_env passes no *API_KEY* variable
            self._ctx = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=f"{base_url}/v1",
                                                                                api_key_var=KEY_VAR))  # fmt: skip
            self._ctx_for = (base_url, gateway)
        return self._ctx

    async def play(self, idx: int, base_url: str, gateway: str, on_trace) -> dict:
        """Task `idx`'s episode; its `episode_summary`."""
        await self._ensure_serving()
        task = self.task(idx)
        try:
            episode = await self.env.run_episode(task, self._context(base_url, gateway), on_trace=on_trace)
        except asyncio.CancelledError:
            raise
        except Exception:
            await self._restart_if_dead()
            raise
        except BaseException as e:  # a SystemExit from the environment's code: the episode's failure
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        summary = episode_summary(episode)
        if summary["error"] is not None:
            await self._restart_if_dead()
        return summary

    async def close(self) -> None:
        if self._serving is not None and self._stop is not None:
            self._stop.set()
            await asyncio.wait({self._serving}, timeout=30)
        self._serving = None
