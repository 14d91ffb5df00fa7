"""A slime generate function in a process of its own (issue 52: code nobody here wrote costs at most its sample).

The run builds each Sample and its sampling params as slime does (generate.py `SlimeGenerate`); the function,
the Sample's own `generate_function_path` and slime's batched rm of a returned list run here, in a spawned worker
(infra/call_worker.py), and post to the run's router themselves, as in slime. A function that calls `os._exit`,
is killed or blocks the worker's event loop (for a third of --rollout-timeout-s, at most 5 minutes) ends the
worker: each call it held runs again alone in a worker of its own, so only the call that ends that one too fails
(its sample stored failed, with the reason). A function that hangs with its loop alive is cut at
--rollout-timeout-s, its call cancelled in the worker.

slime's plugins share one `args` (tasks/rollout/slime_plugins/args.py): attributes the run set since the last call
go with each call, and attributes the function set (assigned, not mutated in place) come back onto the run's
args, where the reward and filter hooks read them.
"""

from __future__ import annotations

import inspect
import pickle
from argparse import Namespace
from typing import Any

from sluiceway.infra.call_worker import IsolatingWorker
from sluiceway.infra.errors import UserError

BLOCKED_AT_MOST_S = 300.0


def plugin_worker(path: str, args: Namespace, timeout_s: float) -> IsolatingWorker:
    blocked = min(BLOCKED_AT_MOST_S, max(10.0, timeout_s / 3))
    # a worker starting (the first, or one after a worker ended) gets the run's args as they are then
    return IsolatingWorker(f"{__name__}:SlimeHandler", lambda: (path, crossable(vars(args))),
                           f"the worker process of {path}", blocked)  # fmt: skip


class SlimeHandler:
    """The worker's side: the function loaded by its path, the worker's copy of the run's args."""

    def __init__(self, path: str, args: dict) -> None:
        from sluiceway.tasks.rollout.slime_plugins import provide_slime_names
        from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin

        provide_slime_names()
        self.args = Namespace(**args)
        self.calls = SlimeCalls(load_plugin(path, "--custom-generate-function-path"), path)

    async def handle(self, payload: tuple, ask) -> tuple[Any, dict]:
        changes, own, sample, sampling_params = payload
        if not own:  # a remote pool's copy of the args: used for this call, its changes kept in it
            return await self.calls.generate(Namespace(**changes), sample, sampling_params), {}
        self.args.__dict__.update(changes)
        before = dict(vars(self.args))
        out = await self.calls.generate(self.args, sample, sampling_params)
        missing = object()
        return out, crossable({k: v for k, v in vars(self.args).items() if before.get(k, missing) is not v})


def crossable(attrs: dict) -> dict:
    """The attributes whose values can cross between the processes (pickle): a client, a lock or an open file a
    plugin keeps on `args` stays in the process that set it, rather than failing the call that would carry it."""
    out = {}
    for k, v in attrs.items():
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001 - whatever pickle refuses stays where it is
            continue
        out[k] = v
    return out


def status_value(status: Any) -> str:
    """A Sample's status as its string: slime's Status enum, or the plain string some plugins set (tau-bench)."""
    return str(getattr(status, "value", status))


class SlimeCalls:
    """The plugin's side of a slime generate, in whichever process runs it: the function (or the one a Sample's
    `generate_function_path` names, as slime's generate_and_rm does) and slime's batched rm of a returned list."""

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self._loaded: dict[str, Any] = {}

    def _function(self, sample):
        path = getattr(sample, "generate_function_path", None)
        if not path:
            return self.fn, self.name
        if path not in self._loaded:
            from sluiceway.tasks.rollout.slime_plugins.convention import load_plugin

            self._loaded[path] = load_plugin(path, "sample.generate_function_path")
        return self._loaded[path], path

    async def generate(self, args: Namespace, sample, sampling_params: dict):
        """What the function returns for `sample`: a Sample, or a checked list of them with slime's rm applied."""
        from slime.utils.http_utils import init_http_client
        from slime.utils.types import Sample

        init_http_client(args)
        fn, name = self._function(sample)
        if "evaluation" in inspect.signature(fn).parameters:
            out = await fn(args, sample, sampling_params, evaluation=False)
        else:
            out = await fn(args, sample, sampling_params)
        if isinstance(out, list):
            check_fan_out(out, name, Sample)
            await self._rewards(args, out)
        elif not isinstance(out, Sample):
            raise UserError(f"{name} returned {type(out).__name__}, not a slime Sample")
        return out

    async def _rewards(self, args: Namespace, samples: list) -> None:
        """slime's generate_and_rm for a list: a slime-convention --custom-rm-path gets the Samples left without a
        reward, as one list (batched_async_rm); not with --group-rm, nor when a Sample was aborted."""
        status = [status_value(s.status) for s in samples]
        need = [s for s in samples if s.reward is None]
        if not need or getattr(args, "group_rm", False) or "aborted" in status:
            return
        rm, rm_name = self._rm(args)
        if rm is None:
            return
        rewards = await awaited(rm(args, need))
        if not isinstance(rewards, list | tuple) or len(rewards) != len(need):
            raise UserError(f"{rm_name} returned {rewards!r} for a list of {len(need)} Samples: "
                            "a list of as many rewards is needed (slime's batched_async_rm)")  # fmt: skip
        for s, r in zip(need, rewards):
            s.reward = r

    def _rm(self, args: Namespace):
        """(the run's --custom-rm-path when it speaks slime's convention, else None; its name)."""
        if not hasattr(self, "_rm_fn"):
            self._rm_fn, self._rm_name = None, getattr(args, "custom_rm_path", None)
            if self._rm_name:
                from sluiceway.tasks.rollout.slime_plugins.convention import RM, SLIME, convention_of, load_plugin

                fn = load_plugin(self._rm_name, "--custom-rm-path")
                conv = getattr(args, "plugin_convention", None) or "auto"
                if convention_of(fn, RM, conv, self._rm_name) == SLIME:
                    self._rm_fn = fn
        return self._rm_fn, self._rm_name


async def awaited(out):
    return await out if inspect.isawaitable(out) else out


def check_fan_out(samples: list, name: str, sample_class) -> None:
    """slime's own checks on a returned list: Samples, at least one, siblings sharing one non-None rollout_id."""
    if not samples:
        raise UserError(f"{name} returned an empty list: a fan-out needs at least one Sample")
    bad = next((s for s in samples if not isinstance(s, sample_class)), None)
    if bad is not None:
        raise UserError(f"{name} returned a list holding {type(bad).__name__}, not only slime Samples")
    ids = {getattr(s, "rollout_id", None) for s in samples}
    if len(samples) > 1 and (None in ids or len(ids) > 1):
        raise UserError(f"{name} returned {len(samples)} Samples whose rollout_id are {sorted(map(str, ids))}: "
                        "a fan-out's Samples must share one rollout_id, as slime asserts (set "
                        "s.rollout_id = sample.index, as examples/multi_agent does)")  # fmt: skip
