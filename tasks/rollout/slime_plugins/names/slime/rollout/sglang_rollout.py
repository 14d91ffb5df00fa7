"""slime.rollout.sglang_rollout: GenerateState, generate, generate_and_rm, generate_and_rm_group, get_model_url
(slime's slime/rollout/sglang_rollout.py at 624b824a), and async_rm / batched_async_rm as slime re-exports them.

Requests go to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` (SGLang's API, which sluiceway's
router and engines speak) through slime.utils.http_utils.post, so `init_http_client(args)` must have run.

Flags slime always defines and sluiceway's args may lack are read with slime's defaults (ci_test, partial_rollout,
mask_offpolicy_in_partial_rollout, group_rm, use_rollout_routing_replay, custom_generate_function_path: off/None;
sglang_dp_size: 1). Not here: the rollout driver around these (generate_rollout, generate_rollout_async, abort,
eval_rollout, eval_rollout_single_dataset): sluiceway's rollout stage drives generation, and slime's tracing spans.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import uuid
from argparse import Namespace
from contextlib import contextmanager
from typing import Any

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.utils.http_utils import get_rollout_num_engines, post
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.processing_utils import (
    build_processor_kwargs,
    encode_image_for_rollout_engine,
    load_processor,
    load_tokenizer,
)
from slime.utils.types import Sample

__all__ = ["GenerateState", "async_rm", "batched_async_rm", "generate", "generate_and_rm", "generate_and_rm_group",
           "get_model_url"]  # fmt: skip

_PROCESSOR_PROMPT_KEYS = {"input_ids", "attention_mask"}  # what the processor gives that is the prompt, not inputs


def _prepare_prompt_ids(sample: Sample, tokenizer, processor: Any) -> list[int]:
    """The prompt's token ids: the processor's for a multimodal prompt (its other outputs become
    multimodal_train_inputs), else `sample.tokens` when set (a partial rollout continues prompt + response so
    far), else the tokenized prompt without special tokens. slime's sglang_rollout.py:42-61."""
    raw = sample.multimodal_inputs or {}
    multimodal = any(v is not None for v in raw.values())
    reuse = bool(sample.tokens) and (sample.multimodal_train_inputs is not None or not multimodal)
    if processor and multimodal and not reuse:
        out = processor(text=sample.prompt, **build_processor_kwargs(raw))
        if sample.multimodal_train_inputs is None:
            sample.multimodal_train_inputs = {k: v for k, v in out.items() if k not in _PROCESSOR_PROMPT_KEYS} or None
        return out["input_ids"][0]
    if reuse:
        return sample.tokens
    return tokenizer.encode(sample.prompt, add_special_tokens=False)


def get_model_url(args: Namespace, model_name: str, endpoint: str = "/generate") -> str:
    """The URL of `model_name`'s router from args.sglang_model_routers ({name: (ip, port)}), else the default
    router's. slime's sglang_rollout.py:64-80."""
    routers = getattr(args, "sglang_model_routers", None)
    if routers and model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


class GenerateState(metaclass=SingletonMeta):
    """The process-wide generation state (slime's sglang_rollout.py:83-149): a singleton, so the first
    GenerateState(args) builds it and every later call returns it whatever args it passes
    (GenerateState.clear_instances() forgets it). Holds the tokenizer and processor of args.hf_checkpoint (a local
    directory here), the request semaphore and the default sampling params."""

    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.processor = load_processor(args.hf_checkpoint, trust_remote_code=True)
        # slime: concurrency x engines; at least 1 here, so a state made without engines fails in post, not hangs.
        self.semaphore = asyncio.Semaphore(max(1, args.sglang_server_concurrency * get_rollout_num_engines(args)))
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids,
            skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        if args.rollout_top_p != 1.0:  # ask SGLang for the ids each top-p nucleus kept (top-p replay in training)
            self.sampling_params["custom_params"] = {"return_top_p_token_ids": True}
        if getattr(args, "sglang_enable_deterministic_inference", False):
            self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    @contextmanager
    def dp_rank_context(self):
        """Count a request against one of the least loaded data-parallel ranks, chosen at random."""
        least = min(self.dp_counts)
        dp_rank = random.choice([i for i, n in enumerate(self.dp_counts) if n == least])
        self.dp_counts[dp_rank] += 1
        self.dp_rank = dp_rank
        try:
            yield dp_rank
        finally:
            self.dp_counts[dp_rank] -= 1
            assert self.dp_counts[dp_rank] >= 0

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """One task per group (generate_and_rm_group with a copy of the default sampling params), in `pendings`."""
        for group in samples:
            params = self.sampling_params.copy()
            self.pendings.add(asyncio.create_task(generate_and_rm_group(self.args, group, params, evaluation=False)))
        self.remaining_batch_size += len(samples)


async def generate(args: Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate the rest of `sample`'s response with one /generate request (slime's sglang_rollout.py:152-221).

    The prompt is `sample.tokens` when set (else the tokenized prompt, which becomes `sample.tokens`);
    `sampling_params["max_new_tokens"]` is reduced in place by the response so far (0 left: TRUNCATED, no request).
    The answer's tokens, log-probs, text, status, weight version and cache counts go into the sample through
    append_response_tokens. Only a PENDING or ABORTED sample is generated."""
    if getattr(args, "ci_test", False):
        assert isinstance(sample.prompt, str)
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    assert sample.status in (Sample.Status.PENDING, Sample.Status.ABORTED), f"Sample status is {sample.status}"

    prompt_ids = _prepare_prompt_ids(sample, state.tokenizer, state.processor)
    sampling_params["max_new_tokens"] -= sample.response_length
    assert sampling_params["max_new_tokens"] >= 0, (
        f"max_new_tokens: {sampling_params['max_new_tokens']} should not be less than 0"
    )
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample

    payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True
    images = sample.multimodal_inputs.get("images") if sample.multimodal_inputs else None
    if images:  # SGLang expands the image placeholders of the text itself
        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in images]
        payload["text"] = sample.prompt
    else:
        payload["input_ids"] = prompt_ids
    if not sample.tokens:
        sample.tokens = prompt_ids

    headers = None
    if sample.session_id and getattr(args, "router_policy", None) == "consistent_hashing":
        headers = {"X-SMG-Routing-Key": sample.session_id}
    output = await post(url, payload, headers=headers)

    generated = output["meta_info"].get("output_token_logprobs", [])  # [[logprob, token id, ...], ...]
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in generated],
        log_probs=[item[0] for item in generated],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


async def generate_and_rm(
    args: Namespace,
    sample: Sample | list[Sample],
    sampling_params: dict[str, Any],
    evaluation: bool = False,
) -> Sample | list[Sample]:
    """Generate one sample (the sample's generate_function_path, else args.custom_generate_function_path, else
    `generate`), run the sample hooks, then its reward unless the generate function gave one or --group-rm defers it
    to the group. A finished (COMPLETED/TRUNCATED) sample comes back as it is. slime's sglang_rollout.py:224-289."""
    if getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout", False):
        if sample.response_length > 0:  # the earlier part was sampled by an older policy: not trained on
            sample.loss_mask = [0] * sample.response_length
    group_rm = getattr(args, "group_rm", False)
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        assert sample.response is not None
        if not group_rm:
            assert sample.reward is not None
        return sample

    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        with state.dp_rank_context():
            # the sample's own generate function (an eval dataset's) wins over --custom-generate-function-path
            path = getattr(sample, "generate_function_path", None)
            path = path or getattr(args, "custom_generate_function_path", None)
            if path is None:
                sample = await generate(args, sample, sampling_params)
            else:
                fn = load_function(path)
                if "evaluation" in inspect.signature(fn).parameters:  # passed only to a parameter of that name
                    sample = await fn(args, sample, sampling_params, evaluation=evaluation)
                else:
                    sample = await fn(args, sample, sampling_params)

    sample = await apply_rollout_sample_hooks(args, sample, evaluation=evaluation)
    if group_rm:
        return sample
    if isinstance(sample, list):  # a generate function that made several samples
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        unscored = [s for s in sample if s.reward is None]
        for s, reward in zip(unscored, await batched_async_rm(args, unscored)):
            s.reward = reward
        return sample
    if sample.status != Sample.Status.ABORTED and sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(
    args: Namespace, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample] | list[list[Sample]]:
    """generate_and_rm on every sample of a group concurrently (each with its own copy of `sampling_params`, and
    its group seed under deterministic inference; a session id each), then with --group-rm the rewards of the whole
    group at once. An entry is a list where the generate function returned one. slime's sglang_rollout.py:292-336."""
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    tasks = []
    for i, sample in enumerate(group):
        params = sampling_params.copy()
        if getattr(args, "sglang_enable_deterministic_inference", False):
            params["sampling_seed"] = state.group_sampling_seeds[i]
        tasks.append(asyncio.create_task(generate_and_rm(args, sample, params, evaluation=evaluation)))
    group = await asyncio.gather(*tasks)
    if not state.aborted and getattr(args, "group_rm", False):
        for sample, reward in zip(group, await batched_async_rm(args, group)):
            sample.reward = reward
    return group
