"""A verifiers (v1) environment's episodes as rollouts: `--prompt-data verifiers:NAME`.

For each sample the run opens an agent session (server.py) and runs the environment's `run_episode(task, ctx)`;
verifiers' eval client (`EvalClientConfig`) relays each model call of its harness to the endpoint's chat
completions (or Responses, or Messages) route, so the session records the engine's tokens and log-probs turn by
turn exactly as for an agent function (docs/agents.md), never verifiers' own re-tokenising. verifiers names the
rollout in an `X-Session-ID` header (its trace's id): when verifiers mints the trace, before its first model call,
the id is registered as the session's alias, and that header is what routes each call to its session. The client
config is the run's one (the endpoint's root URL and a gateway key that opens only sessions registered for it,
each by its alias): verifiers keeps a client per distinct config until it stops, one per session would pile up.
The key reaches verifiers' client through SLUICEWAY_VERIFIERS_API_KEY in the run's environment, which neither the
run's child processes nor verifiers' subprocess runtime pass on (no variable whose name holds API_KEY is).

The row: the session's tokens (mask 1 the model's, 0 the rest), reward the trace's (its rubric's weighted sum,
`Trace.reward`), `reward_details` `{"source": "verifiers", "rewards": {name: {"score", "weight"}}, "metrics"}`
and the same under the row's `metadata.verifiers`. A failed episode (the environment raised or timed out, a
reward that is not a finite number, a harness that exited with an error) is the sample's failure: stored as
aborted with the reason in `metadata.abort_reason`, the run goes on.

The environment's serving resources (verifiers' interception server, shared tool servers) live on the endpoint's
event loop from the first sample until `close`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
from typing import Any

from sluiceway.storage.trajectories import reward_problem
from sluiceway.tasks.environments import verifiers_env
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate
from sluiceway.tasks.rollout.agent.server import AgentProxy, one_line
from sluiceway.tasks.rollout.agent.session import DROPPED, AgentSession
from sluiceway.tasks.rollout.multiturn import GenerateContext, TokenBuffer

log = logging.getLogger("sluiceway")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Timeout|Interrupt)\w*(:|$)")
KEY_VAR = "SLUICEWAY_VERIFIERS_API_KEY"  # the variable verifiers' client reads the run's gateway key from
MODEL = "policy"


@dataclasses.dataclass
class EpisodeBuffer(TokenBuffer):
    """A session's sample with what the episode adds to its row."""

    reward_details: dict | None = None
    row_metadata: dict | None = None


def _errors(episode) -> list:
    out = list(episode.errors)
    for t in episode.traces:
        out += list(t.errors)
    return out


def _message(text: str) -> str:
    """An error's message on one line: a harness's (its stderr's tail, a traceback) as its first line and its
    last (the exception)."""
    lines = [line.strip(" |+-") for line in str(text).splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 2:
        raised = [line for line in lines if _RAISED.match(line)]  # an exception's line (an ExceptionGroup's too)
        return f"{one_line(lines[0], 150)} ... {one_line((raised or lines)[-1], 200)}"
    return one_line(" ".join(lines), 300)


def judge_episode(episode, session_turns: int) -> tuple[float | None, str | None, dict]:
    """(reward, why the sample failed, what the row records) of a finished episode. Plain logic over verifiers'
    Episode and Trace."""
    info: dict[str, Any] = {}
    traces = list(episode.traces)
    if traces:
        t = traces[0]
        info = {
            "trace_id": t.id,
            "rewards": {k: None if r is None else {"score": r.score, "weight": r.weight} for k, r in t.rewards.items()},
            "metrics": dict(t.metrics),
            "turns": len(t.calls),
            "branches": t.num_branches,
        }
        if t.stop_condition:
            info["stop_condition"] = t.stop_condition
    errors = _errors(episode)
    if errors:
        e = errors[0]
        timed_out = episode.is_timeout or any(t.is_timeout for t in traces)
        what = "timed out" if timed_out else "failed"
        return None, f"the verifiers episode {what}: {e.type}: {_message(e.message)}", info
    if len(traces) != 1:
        return None, (f"the verifiers episode has {len(traces)} traces; one agent's trace per episode is supported "
                      "(multi-agent environments are not)"), info  # fmt: skip
    t = traces[0]
    if t.num_branches > 1:
        return None, (f"the trace has {t.num_branches} branches (a harness that rewrote its history); a session "
                      "holds one"), info  # fmt: skip
    if not episode.ok or not t.ok:
        return None, "the verifiers episode did not finish (not ok) and gave no error", info
    for name, r in t.rewards.items():
        if r is None:
            return None, f"the verifiers reward {name!r} was not scored", info
        problem = reward_problem(r.score) or reward_problem(r.weight)
        if problem is not None:
            return None, f"the verifiers reward {name!r} is a {problem}", info
    total = t.reward
    problem = reward_problem(total)
    if problem is not None:
        return None, f"the verifiers trace's reward is a {problem}", info
    if session_turns != len(t.calls):
        return None, (f"the trace holds {len(t.calls)} model calls but the session answered {session_turns}: "
                      "some calls did not reach the run's endpoint"), info  # fmt: skip
    return float(total), None, info


class VerifiersGenerate(AgentGenerate):
    """A custom generate function (tasks/rollout/multiturn.py) running one episode of a verifiers environment per
    sample on an agent session of the run's endpoint (see module doc)."""

    def __init__(self, source: str, args: dict | None, size: int | None = None, tokenizer=None,
                 endpoint: AgentProxy | None = None):  # fmt: skip
        """`size`: how many of the taskset's tasks the dataset holds (data.env_size): read in one pass."""
        super().__init__(fn=None, tokenizer=tokenizer, endpoint=endpoint)
        self.source = source
        self.size = size
        self.name = verifiers_env.env_name(source)
        self.args = args
        self.env = verifiers_env.load_env(source, args)  # a mistake is a UserError here, before engines start
        self._tasks: dict[int, Any] = {}
        self._serving: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._serve_error: BaseException | None = None
        self._ctx = None  # the run's model context, for the endpoint's current port (_context)
        self._ctx_port: int | None = None
        self._gateway: str | None = None

    # -------------------------------------------------------------------------------- the environment
    def task_for(self, prompt) -> Any:
        meta = (prompt.metadata or {}).get("verifiers") or {}
        idx = meta.get("idx")
        if not isinstance(idx, int):
            raise ValueError(f"prompt {prompt.prompt_id} names no verifiers task (metadata.verifiers.idx)")
        if idx not in self._tasks:  # the taskset's load() once for the dataset's tasks (it may read a dataset)
            for task in verifiers_env.tasks(self.env, max(idx + 1, self.size or 0)):
                self._tasks.setdefault(task.data.idx, task)
        task = self._tasks.get(idx)
        if task is None:
            raise ValueError(f"the taskset has no task {idx}")
        if meta.get("key") not in (None, task.key):
            raise ValueError(f"task {idx} of the taskset is not the one the dataset recorded (its key differs)")
        return task

    async def _serve(self) -> None:
        try:
            async with self.env.serving():
                self._ready.set()
                await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every sample then fails with this reason (a SystemExit too:
            self._serve_error = e  # it must not end the endpoint's loop)
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
        next samples; the samples in flight with the dead one fail with their reasons."""
        serving = self._serving
        if serving is None or serving.done() or self._stop.is_set() or await self._servers_alive():
            return
        log.warning("verifiers %s: a shared tool server is down; the environment's servers start again", self.name)
        self._stop.set()
        await asyncio.wait({serving}, timeout=30)
        if self._serving is serving:
            self._serving = None

    async def _ensure_serving(self) -> None:
        """verifiers' serving resources, started once on the endpoint's loop (this coroutine runs there)."""
        if self._serving is None or self._serving.done():
            self._ready, self._stop, self._serve_error = asyncio.Event(), asyncio.Event(), None
            self._serving = asyncio.get_running_loop().create_task(self._serve())
        await self._ready.wait()
        if self._serve_error is not None:
            e = self._serve_error
            raise RuntimeError(f"starting the environment's servers failed: {type(e).__name__}: {one_line(e, 200)}")

    def _context(self):
        """The run's one model context: verifiers' eval client on the endpoint's root with the gateway key, so
        verifiers keeps one HTTP client for the run (it keeps one per distinct client config until it stops)."""
        import verifiers.v1 as vf

        p = self.endpoint
        if self._ctx is None or self._ctx_port != p.port:
            if self._gateway is not None:
                p.drop_gateway(self._gateway)
            self._gateway = p.gateway_key()
            os.environ[KEY_VAR] = self._gateway  # child_env and verifiers' runtimes pass no *API_KEY* variable on
            self._ctx = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=f"{p.url}/v1",
                                                                                api_key_var=KEY_VAR))  # fmt: skip
            self._ctx_port = p.port
        return self._ctx

    async def _episode(self, s: AgentSession, task) -> Any:
        await self._ensure_serving()
        ctx, gateway = self._context(), self._gateway

        def minted(trace) -> None:  # before the trace's first model call: its id names the session
            self.endpoint.alias(s, trace.id, gateway)

        try:
            episode = await self.env.run_episode(task, ctx, on_trace=minted)
        except asyncio.CancelledError:
            raise
        except Exception:
            await self._restart_if_dead()
            raise
        except BaseException as e:  # a SystemExit from the environment's code must not end the endpoint's loop
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        if _errors(episode):
            await self._restart_if_dead()
        return episode

    def close(self) -> None:
        loop, stop = self.endpoint.loop, self._stop
        if self._serving is not None and loop is not None and stop is not None and loop.is_running():

            async def shut() -> None:
                stop.set()
                await asyncio.wait({self._serving}, timeout=30)

            try:
                asyncio.run_coroutine_threadsafe(shut(), loop).result(timeout=35)
            except Exception:  # noqa: BLE001 - closing: the loop stops next
                pass
        self._serving = None
        if self._gateway is not None:
            self.endpoint.drop_gateway(self._gateway)
            self._gateway = self._ctx = None
            os.environ.pop(KEY_VAR, None)
        super().close()

    # -------------------------------------------------------------------------------- one sample
    async def __call__(self, ctx: GenerateContext, prompt, params: dict) -> TokenBuffer:
        p = self.endpoint
        p.start()
        s = p.open(ctx, params, ctx.tokenizer, self.renderer(ctx.tokenizer), list(prompt.token_ids))
        details: dict = {**((prompt.metadata or {}).get("verifiers") or {}), "env": self.name}
        fut = None
        try:
            task = self.task_for(prompt)
            fut = asyncio.run_coroutine_threadsafe(self._episode(s, task), p.loop)
            episode = await asyncio.wrap_future(fut)
            turns = s.buf.turns if s.buf is not None else 0
            reward, reason, info = judge_episode(episode, turns)
            details.update(info)
            if s._lock is not None and s._lock.locked():
                reason = reason or DROPPED
            if reason is not None:
                s.aborted = s.aborted or reason
            elif not s.aborted:
                s.reward = reward
        except asyncio.CancelledError:
            if fut is not None:
                fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the environment's failure is the sample's, stored as aborted
            s.aborted = s.aborted or f"the verifiers episode raised {type(e).__name__}: {one_line(e, 200)}"
        finally:
            p.close(s)
        if s.refused is not None:
            raise s.refused
        buf = s.result()
        fields = {f.name: getattr(buf, f.name) for f in dataclasses.fields(TokenBuffer)}
        reward_details = {"source": "verifiers", **details}
        return EpisodeBuffer(**fields, reward_details=reward_details, row_metadata={"verifiers": details})
