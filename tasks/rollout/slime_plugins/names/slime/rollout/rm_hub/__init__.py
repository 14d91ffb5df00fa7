"""slime.rollout.rm_hub: async_rm, batched_async_rm, remote_rm and the rule-based graders slime exports
(slime's slime/rollout/rm_hub/__init__.py).

Dispatch is slime's (rm_hub/__init__.py:55-110): the sample's own `custom_rm_path`, else `args.custom_rm_path`, called
as slime calls it (`await f(args, sample, **kwargs)`; batched: `await f(args, samples, **kwargs)`), else the rm type
(`sample.metadata["rm_type"]`, else `args.rm_type`; a `boxed_` prefix grades the last \\boxed{} of the response).

The rule-based types grade with sluiceway's verifiers (tasks/reward/verifiers) under slime's rules, so a grade can
differ from slime's on an edge case of answer equivalence, never on what is graded:
    math        1 if the response's last \\boxed{} equals the label (a \\boxed{} label is unboxed), else 0; no box: 0
    deepscaler  the same on the text after the last </think> (or after the first ###Response); neither: 0
    f1          SQuAD token F1 of the whole response and the label (yes/no/noanswer must match exactly)
    remote_rm   slime's protocol: POST args.rm_url {"prompt", "response", "label"}; the JSON answer is the reward
    random      0 or 1
    dapo        DAPO's grader, slime's dict {"score": 1.0/-1.0, "acc", "pred"} (rm_hub/math_dapo_utils.py, which
                slime's retool example imports itself)
sluiceway's other built-in types (exact, regex, choice, format, math+format, code) are accepted too: their float
reward. slime's gpqa and ifbench graders are not provided: a sample of those types raises NotImplementedError
naming it (score them with a --custom-rm-path function). Of the grader modules only rm_hub.math_dapo_utils is
(not rm_hub.math_utils, deepscaler, f1, gpqa, ifbench: their functions are this module's).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter

import httpx
from slime.utils.misc import load_function
from slime.utils.types import Sample

from sluiceway.tasks.reward.math_answer import last_boxed
from sluiceway.tasks.reward.verifiers import equivalent, normalize
from sluiceway.tasks.reward.verifiers.f1 import squad_tokens

logger = logging.getLogger(__name__)

NOT_PROVIDED = ("gpqa", "ifbench")  # slime's rule-based types sluiceway has no grader for
SLUICEWAY_TYPES = ("exact", "regex", "choice", "format", "math+format", "code")  # sluiceway's, beyond slime's


# ---------------------------------------------------------------------------------------------- slime's graders
def extract_boxed_answer(passage: str) -> str | None:
    """The content of the last \\boxed{} of `passage`, or None without one (slime's math_utils.extract_answer)."""
    return last_boxed(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str, ground_truth) -> bool:
    """Whether the last \\boxed{} answer of `solution_str` equals `ground_truth` (itself unboxed when boxed);
    False for an empty label or no box (slime's math_utils.grade_answer_verl)."""
    return bool(ground_truth) and _boxed_answer_is(solution_str, ground_truth)


def _boxed_answer_is(solution: str, label) -> bool:
    gold = str(label)
    if "\\boxed" in gold:
        gold = extract_boxed_answer(gold)
    answer = extract_boxed_answer(solution)
    if answer is None or gold is None:
        return False
    return equivalent(normalize(answer), normalize(gold))[0]


def get_deepscaler_rule_based_reward(response, label) -> int:
    """1 if the answer after </think> (or ###Response) grades right, else 0 (slime's rm_hub/deepscaler.py)."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    if label == "":
        return 0
    return 1 if _boxed_answer_is(solution, label) else 0  # a falsy label (0) is graded, unlike in grade_answer_verl


def f1_score(prediction, ground_truth) -> tuple[float, float, float]:
    """(f1, precision, recall) of SQuAD-normalised tokens; (0, 0, 0) without overlap or when either side is
    yes/no/noanswer and they differ (slime's rm_hub/f1.py)."""
    if prediction is None:
        return 0, 0, 0
    pred, gold = squad_tokens(prediction), squad_tokens(ground_truth)
    if {" ".join(pred), " ".join(gold)} & {"yes", "no", "noanswer"} and pred != gold:
        return 0, 0, 0
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0, 0, 0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall), precision, recall


# -------------------------------------------------------------------------------------------------- remote RM
# slime's remote-RM client, module state as in slime (its rm functions take no client argument); one per process.
_rm_client: httpx.AsyncClient | None = None
_rm_loop: asyncio.AbstractEventLoop | None = None


def _remote_client() -> httpx.AsyncClient:
    """One client per event loop (64 connections, 120 s a request), as slime's shared aiohttp session."""
    global _rm_client, _rm_loop
    loop = asyncio.get_running_loop()
    if _rm_client is None or _rm_loop is not loop:
        _rm_client, _rm_loop = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120.0), loop
    return _rm_client


async def remote_rm(args, sample: Sample, max_retries: int = 10):
    """POST {"prompt", "response", "label"} to args.rm_url; the JSON answer. Any failure is retried after
    min(2**attempt, 30) s plus up to 1 s, and raised after `max_retries` tries (slime's rm_hub/__init__.py:34-52)."""
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    for attempt in range(max_retries):
        try:
            response = await _remote_client().post(args.rm_url, json=payload)
            response.raise_for_status()
            return response.json()
        except Exception as e:
            if attempt + 1 >= max_retries:
                logger.warning(f"remote_rm failed after {attempt + 1} attempts: {e}")
                raise
            backoff = min(2**attempt, 30) + random.random()
            logger.info(f"remote_rm: {type(e).__name__}, retrying in {backoff:.1f}s ({attempt + 1}/{max_retries})")
            await asyncio.sleep(backoff)


# ----------------------------------------------------------------------------------------------------- dispatch
async def async_rm(args, sample: Sample, **kwargs):
    """The reward of one sample: its custom_rm_path, args.custom_rm_path, else its rm type (module docstring)."""
    if sample.custom_rm_path:
        return await load_function(sample.custom_rm_path)(args, sample, **kwargs)
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, sample, **kwargs)

    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    response, label = sample.response, sample.label
    if rm_type.startswith("boxed_"):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type[len("boxed_") :]

    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "math":
        return 1 if grade_answer_verl(response, label) else 0
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "random":
        return random.randint(0, 1)
    if rm_type == "dapo":
        from slime.rollout.rm_hub.math_dapo_utils import compute_score

        return compute_score(response, label)
    if rm_type in SLUICEWAY_TYPES:
        from sluiceway.tasks.reward.scorer_registry import BUILTIN

        return BUILTIN[rm_type](response, label)[0]
    if rm_type in NOT_PROVIDED:
        raise NotImplementedError(f"Rule-based RM {rm_type!r} (slime's rm_hub) is not provided by sluiceway's slime "
                                  "names: score it with a --custom-rm-path function")  # fmt: skip
    if rm_type:
        raise NotImplementedError(f"Rule-based RM for {rm_type} is not implemented.")
    raise NotImplementedError("Rule-based RM type is not specified.")


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[int | float]:
    """The rewards of `samples`, in order: args.custom_rm_path called once with the whole list (per-sample paths
    and rm types are not read then), else async_rm on each, concurrently (slime's rm_hub/__init__.py:99-110)."""
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return await asyncio.gather(*[async_rm(args, s, **kwargs) for s in samples])
