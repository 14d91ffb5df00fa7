"""A verifiers (v1) environment's episodes as rollouts: `--prompt-data verifiers:NAME`.

For each sample the run opens an agent session (server.py) and runs the environment's `run_episode(task, ctx)`;
verifiers' eval client (`EvalClientConfig`) relays each model call of its harness to the endpoint's chat
completions (or Responses, or Messages) route, so the session records the engine's tokens and log-probs turn by
turn exactly as for an agent function (docs/agents.md), never verifiers' own re-tokenising. verifiers names the
rollout in an `X-Session-ID` header (its trace's id): when verifiers mints the trace, before its first model call,
the id is registered as the session's alias, and that header is what routes each call to its session. The client
config is the run's one (the endpoint's root URL and a gateway key that opens only sessions registered for it,
each by its alias): verifiers keeps a client per distinct config until it stops, one per session would pile up.
The key reaches verifiers' client through SLUICEWAY_VERIFIERS_API_KEY in the worker's environment (never the run's),
which verifiers' subprocess runtime does not pass on (no variable whose name holds API_KEY is).

The row: the session's tokens (mask 1 the model's, 0 the rest), reward the trace's (its rubric's weighted sum,
`Trace.reward`), `reward_details` `{"source": "verifiers", "rewards": {name: {"score", "weight"}}, "metrics"}`
and the same under the row's `metadata.verifiers`. A failed episode (the environment raised or timed out, a
reward that is not a finite number, a harness that exited with an error) is the sample's failure: stored as
aborted with the reason in `metadata.abort_reason`, the run goes on.

The environment's code runs in a worker process of its own, one per source (verifiers_worker.py; its side of an
episode is verifiers_episodes.py): its serving resources (verifiers' interception server, shared tool servers)
live on the worker's loop from the first sample until `close`, and the episode's model calls reach the run's
endpoint over HTTP. A reward that exits the process or blocks its loop costs the samples in the worker at that
moment, never the run (issue 52).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from typing import Any

from sluiceway.storage.trajectories import reward_problem
from sluiceway.tasks.environments import verifiers_env
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate
from sluiceway.tasks.rollout.agent.server import AgentProxy, one_line
from sluiceway.tasks.rollout.agent.session import DROPPED
from sluiceway.tasks.rollout.agent.verifiers_worker import CallFailed, EpisodeWorker, WorkerGone
from sluiceway.tasks.rollout.multiturn import GenerateContext, TokenBuffer

log = logging.getLogger("sluiceway")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Timeout|Interrupt)\w*(:|$)")


@dataclasses.dataclass
class EpisodeBuffer(TokenBuffer):
    """A session's sample with what the episode adds to its row."""

    reward_details: dict | None = None
    row_metadata: dict | None = None


def _message(text: str) -> str:
    """An error's message on one line: a harness's (its stderr's tail, a traceback) as its first line and its
    last (the exception)."""
    lines = [line.strip(" |+-") for line in str(text).splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 2:
        raised = [line for line in lines if _RAISED.match(line)]  # an exception's line (an ExceptionGroup's too)
        return f"{one_line(lines[0], 150)} ... {one_line((raised or lines)[-1], 200)}"
    return one_line(" ".join(lines), 300)


def judge_summary(summary: dict, session_turns: int) -> tuple[float | None, str | None, dict]:
    """(reward, why the sample failed, what the row records) of a finished episode's `episode_summary`."""
    info: dict[str, Any] = {}
    t = summary["trace"]
    if t is not None:
        info = {
            "trace_id": t["id"],
            "rewards": {k: None if r is None else {"score": r[0], "weight": r[1]} for k, r in t["rewards"].items()},
            "metrics": dict(t["metrics"]),
            "turns": t["calls"],
            "branches": t["branches"],
        }
        if t["stop_condition"]:
            info["stop_condition"] = t["stop_condition"]
    if summary["error"] is not None:
        kind, message = summary["error"]
        what = "timed out" if summary["timed_out"] else "failed"
        return None, f"the verifiers episode {what}: {kind}: {_message(message)}", info
    if summary["traces"] != 1:
        return None, (f"the verifiers episode has {summary['traces']} traces; one agent's trace per episode is "
                      "supported (multi-agent environments are not)"), info  # fmt: skip
    if t["branches"] > 1:
        return None, (f"the trace has {t['branches']} branches (a harness that rewrote its history); a session "
                      "holds one"), info  # fmt: skip
    if not summary["ok"] or not t["ok"]:
        return None, "the verifiers episode did not finish (not ok) and gave no error", info
    for name, r in t["rewards"].items():
        if r is None:
            return None, f"the verifiers reward {name!r} was not scored", info
        problem = reward_problem(r[0]) or reward_problem(r[1])
        if problem is not None:
            return None, f"the verifiers reward {name!r} is a {problem}", info
    if t["reward"] is None:
        return None, "the verifiers trace's reward could not be summed from its rewards", info
    problem = reward_problem(t["reward"])
    if problem is not None:
        return None, f"the verifiers trace's reward is a {problem}", info
    if session_turns != t["calls"]:
        return None, (f"the trace holds {t['calls']} model calls but the session answered {session_turns}: "
                      "some calls did not reach the run's endpoint"), info  # fmt: skip
    return float(t["reward"]), None, info


class VerifiersGenerate(AgentGenerate):
    """A custom generate function (tasks/rollout/multiturn.py) running one episode of a verifiers environment per
    sample, in the source's worker process (verifiers_worker.py), on an agent session of the run's endpoint."""

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
        timeout = verifiers_env.env_config(self.name, args)["timeout"]
        episode_s = timeout.get("episode") if isinstance(timeout, dict) else None
        self.worker = EpisodeWorker(source, args, size, float(episode_s or verifiers_env.DEFAULT_EPISODE_TIMEOUT_S))
        self._gateway: str | None = None

    # -------------------------------------------------------------------------------- the environment
    def task_for(self, prompt) -> Any:
        meta = (prompt.metadata or {}).get("verifiers") or {}
        idx = meta.get("idx")
        if not isinstance(idx, int):
            raise ValueError(f"prompt {prompt.prompt_id} names no verifiers task (metadata.verifiers.idx)")
        task = verifiers_env.task_at(self.env, self._tasks, idx, self.size)
        if meta.get("key") not in (None, task.key):
            raise ValueError(f"task {idx} of the taskset is not the one the dataset recorded (its key differs)")
        return task

    def _gateway_key(self) -> str:
        """The run's one gateway key for this source's episodes (it opens only sessions registered by alias)."""
        if self._gateway is None:
            self._gateway = self.endpoint.gateway_key()
        return self._gateway

    def close(self) -> None:
        self.worker.close()
        if self._gateway is not None:
            self.endpoint.drop_gateway(self._gateway)
            self._gateway = None
        super().close()

    # -------------------------------------------------------------------------------- one sample
    async def __call__(self, ctx: GenerateContext, prompt, params: dict) -> TokenBuffer:
        p = self.endpoint
        p.start()
        s = p.open(ctx, params, ctx.tokenizer, self.renderer(ctx.tokenizer), list(prompt.token_ids))
        details: dict = {**((prompt.metadata or {}).get("verifiers") or {}), "env": self.name}
        try:
            task = self.task_for(prompt)
            gateway = self._gateway_key()
            summary = await self.worker.run(task.data.idx, p.url, gateway, lambda trace_id: p.alias(s, trace_id,
                                                                                                  gateway))  # fmt: skip
            turns = s.buf.turns if s.buf is not None else 0
            reward, reason, info = judge_summary(summary, turns)
            details.update(info)
            if s._lock is not None and s._lock.locked():
                reason = reason or DROPPED
            if reason is not None:
                s.aborted = s.aborted or reason
            elif not s.aborted:
                s.reward = reward
        except asyncio.CancelledError:
            raise
        except WorkerGone as e:  # the environment's code ended or blocked its process: this sample's failure
            s.aborted = s.aborted or one_line(e, 300)
        except Exception as e:  # noqa: BLE001 - the environment's failure is the sample's, stored as aborted
            said = str(e) if isinstance(e, CallFailed) else f"{type(e).__name__}: {e}"  # the worker's own words
            s.aborted = s.aborted or f"the verifiers episode raised {one_line(said, 200)}"
        finally:
            p.close(s)
        if s.refused is not None:
            raise s.refused
        buf = s.result()
        fields = {f.name: getattr(buf, f.name) for f in dataclasses.fields(TokenBuffer)}
        reward_details = {"source": "verifiers", **details}
        return EpisodeBuffer(**fields, reward_details=reward_details, row_metadata={"verifiers": details})
