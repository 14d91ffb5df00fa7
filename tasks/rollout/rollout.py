"""The rollout stage, without Prefect: generate a step's groups through engines and append them to the table.

- Every sample is one `/generate` request with a deterministic `rid` and `sampling_seed`; results are
  keyed by rid, so a request the router re-ran on another engine is counted once.
- A group goes to the table as soon as its samples finish: a crash loses at most the groups in flight,
  and a re-run of the step generates only the groups the table lacks.
- Over-sampling: more groups are submitted than the step needs; once enough have finished (and passed the
  group filter, if any), the rest are aborted. Aborted samples keep the tokens generated so far, with the
  weight version that made them, as `aborted` rows; with `partial_rollout` the next step continues them
  from those tokens under the new weights (APRIL), optionally masking the old-policy tokens out of the loss.
- Pools: each group goes to one pool of engines (tasks/rollout/dispatch.py): the run's own, or remote pools
  that serve a fresh enough weight version (tasks/rollout/pool_directory.py: fixed ones, and the pool registry's,
  which join and leave during the step). A remote pool's requests cannot be aborted through its router, so
  once the step has enough groups they are dropped on our side and stored as aborted; a remote pool that
  fails a request is benched and its group goes elsewhere; a slow one is hedged on the run's own engines.
  Every request names the oldest version it may be sampled at (``min_weight_version``): an engine serving an
  older one refuses it, and the group goes to a pool that is current. Rows record the pool and the versions
  that made them.

`Rollout` holds one step's rollout: its fields are what the groups share while they run (the count of finished
groups, the event that cuts the rest short), its methods one group, one pool's samples of it, one sample, and
the verdict on a generated group. It takes one `PoolDispatcher`, which holds every pool it may use; of an engine
client it needs only `RolloutClient` (tasks/rollout/pool_target.py), so tests drive it with a scripted fake
(tests/unit/rollout/). `run_rollout` is the entry point the flows call.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sluiceway.infra.call_worker import CallFailed, WorkerGone
from sluiceway.storage.trajectories import (
    ABORTED,
    COMPLETED,
    FAILED,
    RETRIED,
    TRUNCATED,
    TrajectoryRow,
    group_rows,
    is_finished,
    is_trainable,
    is_usable,
    read_trajectories,
    set_filter_reasons,
)
from sluiceway.tasks.rollout.client import EngineCallError
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.generation import Generation, GenerationDefaults
from sluiceway.tasks.rollout.multiturn import GenerateContext
from sluiceway.tasks.rollout.pool_target import PoolTarget
from sluiceway.tasks.rollout.writer import GroupWriter


@dataclass
class PromptItem:
    prompt_id: str
    text: str  # rendered prompt (chat template applied when asked)
    token_ids: list[int]
    label: str | None
    metadata: dict
    source: object = None  # the dataset's prompt before rendering (a string or messages): what agents get


def prompt_indices_for_step(n_prompts: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Epoch-wise shuffled order: step k takes the next `batch_size` prompts, reshuffling each epoch."""
    out = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n_prompts)
        order = list(range(n_prompts))
        random.Random(seed * 7919 + epoch).shuffle(order)
        take = min(batch_size - len(out), n_prompts - offset)
        out.extend(order[offset : offset + take])
        pos += take
    return out


def sample_seed(seed: int, step: int, group_id: int, sample_index: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + group_id * 101 + sample_index) % (2**31)


def request_id(run_id: str, step: int, group_id: int, sample_index: int) -> str:
    return f"{run_id}/{step}/{group_id}/{sample_index}"


def group_key(run_id: str, step: int, group_id: int) -> str:
    """The router's routing key of a group: its samples go to one engine, which prefills their prompt once."""
    return f"{run_id}/{step}/{group_id}"


@dataclass
class Partial:
    """Tokens a sample already has from an aborted earlier attempt (empty for a fresh sample)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    from_step: int | None = None


@dataclass
class GroupWork:
    group_id: int
    prompt: PromptItem
    partials: list[Partial]  # one per sample


@dataclass
class RolloutSettings:
    n_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    seed: int
    groups_needed: int  # groups the step trains on
    groups_submitted: int  # >= groups_needed: over-sampling
    max_concurrency: int = 64
    partial_rollout: bool = False
    mask_offpolicy: bool = False
    custom_generate: Callable | None = None  # see tasks/rollout/multiturn.py
    tokenizer: object = None  # for custom generate functions
    max_prompt_len: int | None = None  # what a custom generate function may start from (--rollout-max-prompt-len)
    timeout_s: float = 1800.0  # a custom generate function's time for one sample (--rollout-timeout-s)
    max_context_len: int | None = None  # --rollout-max-context-len: a multi-turn function may fill it

    @property
    def max_response_tokens(self) -> int:
        """The most response tokens a custom generate function's sample may hold (its turns and tool outputs)."""
        return max(self.max_new_tokens, self.max_context_len or 0)

    def close(self) -> None:
        """When the run ends: what the custom generate function holds (an agent function's endpoint)."""
        close = getattr(self.custom_generate, "close", None)
        if close is not None:
            close()


@dataclass
class RolloutResult:
    step: int
    groups_completed: int  # finished groups in the table for this step (this run and earlier attempts)
    groups_aborted: int
    groups_skipped: int  # already in the table before this call
    samples_written: int
    gen_time_s: float
    groups_failed: int = 0  # groups this call stored whose every sample failed: nothing of them is trained


def carried_over(store, run_id: str, step: int, prompts_by_id: dict[str, PromptItem]) -> list[GroupWork]:
    """The previous step's aborted groups, to be continued first in this step."""
    if step == 0:
        return []
    prev = read_trajectories(store, run_id, step - 1).to_pylist()
    groups: dict[int, list[TrajectoryRow]] = {}
    for r in prev:
        if r["status"] == ABORTED and r.get("filter_reason") != RETRIED:
            groups.setdefault(r["group_id"], []).append(r)
    work = []
    for g in sorted(groups):
        rows = sorted(groups[g], key=lambda r: r["sample_index"])
        prompt = stored_prompt(rows[0], prompts_by_id)
        partials = [
            Partial(r["response_token_ids"], r["rollout_logprobs"], r["weight_versions"], step - 1) for r in rows
        ]
        work.append(GroupWork(-1, prompt, partials))
    return work


def stored_prompt(row: TrajectoryRow, prompts_by_id: dict[str, PromptItem]) -> PromptItem:
    """The prompt a stored row was generated from: the dataset's, or as the row recorded it."""
    return prompts_by_id.get(row["prompt_id"]) or PromptItem(
        row["prompt_id"], row["prompt"], row["prompt_token_ids"], row["label"], json.loads(row["metadata"] or "{}")
    )


def plan_step(
    store, run_id: str, step: int, new_prompts: list[PromptItem], s: RolloutSettings, all_prompts: list[PromptItem]
) -> list[GroupWork]:
    """Group ids 0.. go to carried-over partial groups first, then to new prompts, up to groups_submitted."""
    work = carried_over(store, run_id, step, {p.prompt_id: p for p in all_prompts}) if s.partial_rollout else []
    work = work[: s.groups_submitted]
    for p in new_prompts[: s.groups_submitted - len(work)]:
        work.append(GroupWork(-1, p, [Partial() for _ in range(s.n_samples)]))
    for g, w in enumerate(work):
        w.group_id = g
    return work


def _row(
    run_id, step, w: GroupWork, i: int, res: Generation, decode, s: RolloutSettings, engine: str, pool: str
) -> TrajectoryRow:
    part = w.partials[i] if i < len(w.partials) else Partial()  # a fan-out's extra rows continue nothing
    tokens = part.token_ids + res.token_ids
    # A multi-turn TokenBuffer brings its own mask (environment tokens 0) and versions.
    new_mask = res.loss_mask or [1] * len(res.token_ids)
    new_versions = res.weight_versions or ([res.weight_version] if res.token_ids else [])
    versions = list(dict.fromkeys(part.weight_versions + new_versions)) or [res.weight_version]
    # Tokens from an older policy can be kept out of the loss (--mask-offpolicy-in-partial-rollout).
    old_mask = [0 if s.mask_offpolicy else 1] * len(part.token_ids)
    status = {"stop": COMPLETED, "length": TRUNCATED, "abort": ABORTED}.get(res.finish_reason, FAILED)
    meta = dict(w.prompt.metadata)
    if part.from_step is not None:
        meta["continued_from_step"] = part.from_step
        meta["offpolicy_tokens"] = len(part.token_ids)
    if res.abort_reason:
        meta["abort_reason"] = res.abort_reason
    extra = getattr(res, "row_metadata", None)  # a slime Sample's fields (tasks/rollout/slime_plugins/generate.py)
    if extra:
        meta.update(extra)
    details = getattr(res, "reward_details", None) or {"source": "agent"}
    # An agent session (tasks/rollout/agent/proxy.py) renders its own prompt and may bring the agent's reward.
    return TrajectoryRow(
        run_id=run_id,
        step=step,
        group_id=w.group_id,
        sample_index=i,
        prompt_id=w.prompt.prompt_id,
        prompt=res.prompt_text or w.prompt.text,
        label=w.prompt.label,
        prompt_token_ids=res.prompt_ids or w.prompt.token_ids,
        response_token_ids=tokens,
        response_text=decode(tokens),
        rollout_logprobs=part.logprobs + res.logprobs,
        loss_mask=old_mask + new_mask,
        reward=res.reward,
        reward_details=json.dumps(details, default=str) if res.reward is not None else None,
        status=status,
        finish_reason=res.finish_reason,
        weight_version=versions[-1],
        weight_versions=versions,
        engine=engine,
        pool=pool,
        gen_time_s=res.latency_s,
        created_at=datetime.now(UTC),
        metadata=json.dumps(meta, default=str),
        filter_reason=None,  # Rollout.judge sets it
        teacher_logprobs=getattr(res, "teacher_logprobs", None),  # else on-policy distillation's stage fills it
    )


@dataclass
class _Aborted(GenerationDefaults):
    """Stands in for a request that was never sent because the step already had enough groups."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "abort"
    weight_version: int = 0
    latency_s: float = 0.0


@dataclass
class _Failed(_Aborted):
    """A sample whose custom generate function raised, hung or returned what no row can hold: stored failed with
    the reason (never trained); the group's other samples go on."""

    finish_reason: str = "failed"
    reason: str = ""

    @property
    def row_metadata(self) -> dict:
        return {"failure_reason": self.reason}


async def guarded_generate(s: RolloutSettings, ctx: GenerateContext, prompt: PromptItem, params: dict) -> Generation:
    """The custom generate function's generation of one sample, where code we did not write costs at most that
    sample: an exception, `timeout_s` passing or a result no row can hold (None, tokens beyond the response limit)
    is a failed sample saying why. The engines' own errors still reach the dispatcher, which moves or stops the
    group (a pool gone is not the function's fault)."""
    fn = s.custom_generate
    name = getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or "the custom generate function"
    t0, bound = time.perf_counter(), asyncio.timeout(s.timeout_s)
    try:
        async with bound:
            res = await fn(ctx, prompt, params)
    except EngineCallError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the plugin raises is its sample's failure
        if bound.expired():
            why = f"did not return within {s.timeout_s:g} s (--rollout-timeout-s)"
        elif isinstance(e, CallFailed):  # raised in its worker process: the worker's `Type: message`
            why = f"raised {str(e)[:500]}"
        elif isinstance(e, WorkerGone):
            why = f"failed: {str(e)[:1000]}"
        else:
            why = f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:500]}"
        return _Failed(reason=f"{name} {why}", latency_s=time.perf_counter() - t0)
    problem = generation_problem(res, s.max_response_tokens)
    if problem is not None:
        return _Failed(reason=f"{name} {problem}", latency_s=time.perf_counter() - t0)
    return res


def generation_problem(res, max_tokens: int) -> str | None:
    """Why a custom generate function's result cannot be a row, or None."""
    tokens = getattr(res, "token_ids", None)
    if not isinstance(tokens, list):
        return f"returned {type(res).__name__}, not a generation with a list of token_ids"
    if len(tokens) > max_tokens:
        return f"returned {len(tokens)} response tokens, more than the {max_tokens} a sample may have"
    if not all(type(t) is int and t >= 0 for t in tokens):
        return "returned token_ids that are not all non-negative integers"
    logprobs = getattr(res, "logprobs", None) or []
    if len(logprobs) not in (0, len(tokens)):
        return f"returned {len(logprobs)} log-probs for {len(tokens)} tokens"
    mask = getattr(res, "loss_mask", None)
    if mask is not None and len(mask) != len(tokens):
        return f"returned a loss_mask of {len(mask)} for {len(tokens)} tokens"
    return None


class Rollout:
    """One step's rollout: the planned groups the table does not hold yet, until `groups_needed` have finished.

    `dispatcher` holds the pools: the run's own engines (if it has any) and the remote pools, which take groups
    while they serve its `min_version` or newer (tasks/rollout/dispatch.py picks the pool, benches a failing one
    and hedges a slow one). Every request is pinned to `min_version`.
    `on_progress(finished, needed)` is called as groups finish (a console progress bar, say).
    """

    def __init__(
        self,
        *,
        dispatcher: PoolDispatcher,
        store,
        run_id: str,
        step: int,
        work: list[GroupWork],
        settings: RolloutSettings,
        decode: Callable[[list[int]], str],
        group_filter: Callable[[list[TrajectoryRow]], str | None] | None = None,
        engine: str = "router",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.dispatcher, self.store, self.run_id, self.step = dispatcher, store, run_id, step
        self.work, self.s, self.decode = work, settings, decode
        self.group_filter, self.engine, self.on_progress = group_filter, engine, on_progress
        self.min_version = dispatcher.min_version
        self.writer = GroupWriter(store)
        # What the groups share while they run:
        self.enough = asyncio.Event()  # the step has `groups_needed` finished groups: the rest are cut short
        self.finished = 0  # finished groups in the table (this run and earlier attempts)
        self.written = 0  # samples this run stored
        self.aborted_groups = 0
        self.failed_groups = 0  # groups whose every sample failed (tasks/rollout/slime_plugins/generate.py, say)
        self.versions_seen: list[int] = []  # weight versions of the answers so far

    async def run(self) -> RolloutResult:
        t0 = time.perf_counter()
        existing = read_trajectories(self.store, self.run_id, self.step).to_pylist()
        stored = {r["group_id"] for r in existing}
        finished = {r["group_id"] for r in existing if is_trainable(r)}
        self.finished = len(finished)
        todo = [w for w in self.work if w.group_id not in stored]
        if self.finished < self.s.groups_needed:
            todo += self.retries(existing, next_id=max(stored | {w.group_id for w in self.work}, default=-1) + 1)
        if self.finished >= self.s.groups_needed:
            self.enough.set()
        await asyncio.gather(*(self.group(w) for w in todo))
        return RolloutResult(
            step=self.step,
            groups_completed=self.finished,
            groups_aborted=self.aborted_groups,
            groups_skipped=len(self.work) - len(todo),
            samples_written=self.written,
            gen_time_s=time.perf_counter() - t0,
            groups_failed=self.failed_groups,
        )

    def retries(self, existing: list[TrajectoryRow], next_id: int) -> list[GroupWork]:
        """The planned groups an earlier attempt of this step stored with nothing to train (every sample aborted
        or failed: engines gone, an agent or plugin broken, a prompt over the limit), generated again now that the
        step still lacks groups: the attempt stopped the run, and its cause may be fixed. They get new group ids;
        the old rows stay, marked `retried` (not trained, not continued by the next step)."""
        by_group = group_rows([r for r in existing if r.get("filter_reason") is None])
        dead = sorted(g for g, rows in by_group.items() if not any(is_usable(r) for r in rows))
        planned = {w.group_id: w for w in self.work}
        prompts = {w.prompt.prompt_id: w.prompt for w in self.work}
        todo = [
            GroupWork(next_id + k, stored_prompt(by_group[g][0], prompts), planned[g].partials if g in planned
                      else [Partial() for _ in range(self.s.n_samples)])
            for k, g in enumerate(dead)
        ]  # fmt: skip
        if dead:
            keys = [(r["group_id"], r["sample_index"], RETRIED) for g in dead for r in by_group[g]]
            set_filter_reasons(self.store, self.run_id, self.step, keys)
        return todo

    async def group(self, w: GroupWork) -> None:
        """One group: generated on some pool, judged, stored."""
        results, target = await self.dispatcher.run(
            self.s.n_samples, lambda target: self.generate(w, target), self.enough, name=f"group {w.group_id}"
        )
        where = self.engine if target.local else "router"  # a remote pool's router; its name is in `pool`
        results = with_siblings(results)
        rows = [_row(self.run_id, self.step, w, i, r, self.decode, self.s, where, target.name)
                for i, r in enumerate(results)]  # fmt: skip
        await self.judge(rows, results)
        if await self.writer.write(rows, app_id=f"rollout/{self.run_id}/{self.step}/{w.group_id}"):
            self.written += len(rows)

    async def generate(self, w: GroupWork, target: PoolTarget) -> list[Generation]:
        """The group's samples on one pool; if one fails, the others are cancelled and the error raised."""
        return await _all_or_none([self.sample(w, i, target) for i in range(self.s.n_samples)])

    async def sample(self, w: GroupWork, i: int, target: PoolTarget) -> Generation:
        """One sample: a /generate request (or a custom generate function), continuing its partial if any."""
        s = self.s
        if self.enough.is_set():
            return _Aborted(weight_version=self.versions_seen[-1] if self.versions_seen else 0)
        part = w.partials[i]
        params = {
            "max_new_tokens": s.max_new_tokens - len(part.token_ids),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": s.stop_token_ids,
            "sampling_seed": sample_seed(s.seed, self.step, w.group_id, i),
        }
        if params["max_new_tokens"] <= 0:  # nothing left to generate: the partial is already full length
            return _Aborted(finish_reason="length", weight_version=part.weight_versions[-1])
        rid, key = request_id(self.run_id, self.step, w.group_id, i), group_key(self.run_id, self.step, w.group_id)
        pin = {} if self.min_version is None else {"min_weight_version": self.min_version}
        if s.custom_generate is not None:
            ctx = GenerateContext(target.client, s.tokenizer, rid, s.max_new_tokens, routing_key=key,
                                  max_prompt_len=s.max_prompt_len, **pin)  # fmt: skip
            call = guarded_generate(s, ctx, w.prompt, params)
        else:
            ids = w.prompt.token_ids + part.token_ids
            call = target.client.generate(ids, params, rid=rid, routing_key=key, **pin)
        res = await call if target.local else await _unless(self.enough, call)
        if res is None:  # the step had enough groups first; the remote request is dropped, not waited for
            return _Aborted(weight_version=target.version or 0)
        self.versions_seen.append(res.weight_version)
        return res

    async def judge(self, rows: list[TrajectoryRow], results: list[Generation]) -> None:
        """Status and filter reason of a generated group's rows; the step's count of finished groups."""
        if not all(is_finished(r) for r in rows):
            # A group is trained on whole or not at all: finished samples of a cut group are kept as
            # partials too (they carry no further tokens), so the next step sees the group intact.
            for r in rows:
                r["status"] = ABORTED
            self.aborted_groups += 1
            return
        usable = [r for r in rows if is_usable(r)]
        if not usable:  # every sample failed: the group is stored with its reasons and fills no place of the step
            self.failed_groups += 1
            return
        reason = self.group_filter(usable) if self.group_filter else None
        made_by = [r.weight_version for r in results if r.token_ids]
        if reason is None and self.min_version is not None and made_by and min(made_by) < self.min_version:
            reason = "stale"  # the pool reported a fresher version than it served
        if reason is None and self.finished >= self.s.groups_needed:
            reason = "surplus"  # finished after the step already had enough groups
        for r in rows:
            r["filter_reason"] = reason
        if reason is not None:
            return
        self.finished += 1
        if self.on_progress is not None:
            self.on_progress(self.finished, self.s.groups_needed)
        if self.finished >= self.s.groups_needed and not self.enough.is_set():
            self.enough.set()
            if (own := self.dispatcher.local) is not None:
                await own.client.abort_all()  # the engines return what they have for the rest


def with_siblings(results: list[Generation]) -> list[Generation]:
    """The planned samples' generations, then the siblings a fan-out brought (a slime generate function returning
    several Samples for one, tasks/rollout/slime_plugins/generate.py): those become rows of the same group with
    sample_index n_samples, n_samples + 1, ... in the order of the planned samples. A group is then larger than
    n_samples; every consumer keys rows by (group_id, sample_index) and groups them by group_id."""
    extra = [sib for r in results for sib in (getattr(r, "siblings", None) or [])]
    return list(results) + extra if extra else results


async def run_rollout(**kwargs) -> RolloutResult:
    """Generate the planned groups the table does not hold yet; stop when `groups_needed` have finished.

    Takes :class:`Rollout`'s keyword arguments.
    """
    return await Rollout(**kwargs).run()


async def _unless(event: asyncio.Event, call):
    """``await call``, unless ``event`` is set first: then the call is cancelled and None returned."""
    task = asyncio.ensure_future(call)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (the group was hedged elsewhere): so is the request
        task.cancel()
        raise
    finally:
        stop.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _all_or_none(calls: list) -> list:
    """Every call's result in order; if one raises, the others are cancelled and the error re-raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
