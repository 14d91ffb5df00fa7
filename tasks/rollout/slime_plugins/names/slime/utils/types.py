"""slime.utils.types: Sample, ParamInfo, RolloutBatch, MultimodalType(s), as slime's slime/utils/types.py (624b824a).

`Sample` has slime's fields in slime's order with slime's defaults (types.py:93-220), its nested `Status`, `SpecInfo`
and `PrefixCacheInfo`, and its methods: to_dict / from_dict (222-244), get_reward_value (246), effective_response_length
(249), append_response_tokens (253-314) with the private _apply_meta_info (316-416) and
_validate_response_metadata_lengths (418-443). slime has no public `update_from_meta_info` at this commit (what it
does on a response is `append_response_tokens(..., meta_info=...)`), so there is none here.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from slime.utils.misc import decode_int32_meta_array

# The meta_info keys SGLang (slime's build) uses for top-p replay: the ids kept by the nucleus of each generated
# token, ragged, and their offsets (len = generated tokens + 1).
_TOP_P_IDS_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
_TOP_P_OFFSETS_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def _int32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32).reshape(-1)


def _top_p_from_meta(meta_info: dict, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(kept ids, offsets) of the `new_tokens` just generated, checked; None when meta_info has neither."""
    ids = decode_int32_meta_array(meta_info, _TOP_P_IDS_KEYS)
    offsets = decode_int32_meta_array(meta_info, _TOP_P_OFFSETS_KEYS)
    if ids is None and offsets is None:
        return None
    if ids is None or offsets is None:
        raise ValueError("SGLang top-p token replay must include both token ids and offsets.")
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ValueError(f"SGLang top-p token offsets must start with 0, got {offsets[:1].tolist()}.")
    if int(offsets[-1]) != ids.numel():
        raise ValueError(f"SGLang top-p token ids/offsets mismatch: offsets[-1]={int(offsets[-1])}, "
                         f"len(token_ids)={ids.numel()}.")  # fmt: skip
    if offsets.numel() != new_tokens + 1:
        raise ValueError("SGLang top-p token offsets length must equal generated token count + 1: "
                         f"len(offsets)={offsets.numel()}, generated={new_tokens}.")  # fmt: skip
    return ids, offsets


def _tokens_list(tokens) -> list[int]:
    if tokens is None:
        return []
    if torch.is_tensor(tokens):
        tokens = tokens.detach().cpu().reshape(-1).tolist()
    return [int(t) for t in tokens]


def _floats_list(values) -> list[float] | None:
    if values is None:
        return None
    if torch.is_tensor(values):
        values = values.detach().cpu().reshape(-1).tolist()
    return [float(v) for v in values]


@dataclass
class Sample:
    """One generated sample, as slime's (slime/utils/types.py:93). A plain dataclass: plugins add attributes."""

    group_index: int | None = None
    index: int | None = None
    # The rollout this sample came from; samples split from one rollout share it (None: the sample's own).
    rollout_id: int | None = None
    # prompt
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None  # raw (images, videos)
    multimodal_train_inputs: dict[str, Any] | None = None  # processed (pixel_values)
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    # response
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    # Top-p replay: the ids response token i kept are rollout_top_p_token_ids[offsets[i]:offsets[i + 1]].
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: list[list[int]] | torch.Tensor | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None  # on-policy distillation

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"  # a recoverable failure (a tool, an API); the output may still be partly valid

    status: Status = Status.PENDING

    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None  # this sample's own custom generate function
    custom_rm_path: str | None = None  # this sample's own reward function
    train_metadata: dict | None = None
    session_id: str | None = None  # the routing key under the router's consistent_hashing policy
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative-decoding counts summed over a sample's requests (slime's types.py:153-189)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict):
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self):
            return {name: getattr(self, name) for name in Sample.SpecInfo.__dataclass_fields__}

        @staticmethod
        def from_dict(data: dict):
            return Sample.SpecInfo(**{name: data.get(name, 0) for name in Sample.SpecInfo.__dataclass_fields__})

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens served from the prefix cache, summed over a sample's requests (slime's types.py:193-218)."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict):
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self):
            return {"cached_tokens": self.cached_tokens, "total_prompt_tokens": self.total_prompt_tokens}

        @staticmethod
        def from_dict(data: dict):
            return Sample.PrefixCacheInfo(data.get("cached_tokens", 0), data.get("total_prompt_tokens", 0))

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    # ------------------------------------------------------------------------------------------ dict round trip
    def to_dict(self):
        """A shallow copy of every attribute (added ones too); status as its string value, the two infos as dicts."""
        out = dict(self.__dict__)
        out["status"] = self.status.value
        out["spec_info"] = self.spec_info.to_dict()
        out["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return out

    @staticmethod
    def from_dict(data: dict):
        """The inverse of to_dict: "status" is required; keys that are not fields become attributes."""
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        fields = Sample.__dataclass_fields__
        sample = Sample(**{k: v for k, v in data.items() if k in fields})
        for k, v in data.items():
            if k not in fields:
                setattr(sample, k, v)
        return sample

    # ------------------------------------------------------------------------------------------------- rewards
    def get_reward_value(self, args) -> float:
        """The reward, or reward[args.reward_key] when --reward-key is set (dict rewards). Only reward_key is read."""
        return self.reward[args.reward_key] if args.reward_key else self.reward

    @property
    def effective_response_length(self):
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    # ----------------------------------------------------------------------------------------- response tokens
    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ):
        """Add response tokens and keep loss_mask, rollout_log_probs and top-p replay aligned with them.

        Generated tokens: trainable=True with their log-probs and SGLang's meta_info. Tool or environment tokens:
        trainable=False and no log-probs (they get loss-mask 0, log-prob 0.0 and empty top-p spans). tokens,
        loss_mask and rollout_log_probs are extended in place (callers may hold the lists). `text` is appended to
        `response` only when given. meta_info with a finish_reason sets the status (length -> TRUNCATED, abort ->
        ABORTED, stop -> COMPLETED), adds the weight version and cache counts. Raises ValueError on any length
        mismatch. slime's slime/utils/types.py:253-314.
        """
        tokens = _tokens_list(tokens)
        log_probs = _floats_list(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)

        if text is not None:
            self.response += text

        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)

        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")  # fmt: skip
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs

        pad_top_p = bool(tokens) and not trainable
        if meta_info is not None or pad_top_p:
            self._apply_meta_info(args, meta_info or {}, new_token_count=len(tokens), pad_missing_top_p=pad_top_p,
                                  update_terminal_info=update_terminal_info)  # fmt: skip
        self._validate_response_metadata_lengths()

    def _apply_meta_info(
        self,
        args,
        meta_info: dict,
        *,
        new_token_count: int = 0,
        pad_missing_top_p: bool = False,
        update_terminal_info: bool = True,
    ) -> None:
        """Top-p replay, routed experts, then (with a finish_reason) the terminal info. slime's types.py:316-416."""
        top_p = _top_p_from_meta(meta_info, new_token_count) if new_token_count else None
        if top_p is not None:
            self._extend_top_p(*top_p)
        elif pad_missing_top_p and new_token_count and self.rollout_top_p_token_offsets is not None:
            # Tool tokens after replayed ones: an empty span each, so the offsets keep covering the response.
            if self.rollout_top_p_token_ids is None:
                raise ValueError("Cannot append empty top-p spans without existing token ids and offsets.")
            if _int32(self.rollout_top_p_token_offsets).numel() == 0:
                raise ValueError("Cannot append empty top-p spans to empty offsets.")
            self._extend_top_p(torch.zeros(0, dtype=torch.int32), torch.zeros(new_token_count + 1, dtype=torch.int32))

        experts = decode_int32_meta_array(meta_info, "routed_experts")
        if experts is not None:
            self._set_routed_experts(args, experts, meta_info)

        if not update_terminal_info or "finish_reason" not in meta_info:
            return
        if getattr(args, "sglang_speculative_algorithm", False):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finished = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED, "stop": Sample.Status.COMPLETED}
        self.status = finished.get(meta_info["finish_reason"]["type"], self.status)

    def _extend_top_p(self, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        """Append one response chunk's spans: `offsets` starts at 0 and is shifted by what is already held."""
        held_ids, held_offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if held_ids is None and held_offsets is None:
            self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = ids, offsets
            return
        held_ids = _int32([] if held_ids is None else held_ids)  # one half missing: validated after the append
        held_offsets = _int32([0] if held_offsets is None else held_offsets)
        self.rollout_top_p_token_ids = torch.cat([held_ids, ids])
        self.rollout_top_p_token_offsets = torch.cat([held_offsets, offsets[1:] + int(held_offsets[-1])])

    def _set_routed_experts(self, args, experts: torch.Tensor, meta_info: dict) -> None:
        """Routing replay: rows of (num_layers, moe_router_topk) expert ids from `routed_experts_start_len` on."""
        if args is None:
            raise ValueError("args is required to decode routed experts metadata.")
        start = int(meta_info.get("routed_experts_start_len", 0) or 0)
        if start < 0:
            raise ValueError(f"SGLang routed_experts_start_len must be non-negative, got {start}.")
        rows = max(0, len(self.tokens) - 1 - start)
        expected = rows * args.num_layers * args.moe_router_topk
        if experts.numel() != expected:
            raise ValueError("SGLang routed_experts element count does not match sample tokens: "
                             f"got={experts.numel()}, expected={expected} (tokens={len(self.tokens)}, "
                             f"routed_experts_start_len={start}, num_layers={args.num_layers}, "
                             f"moe_router_topk={args.moe_router_topk}).")  # fmt: skip
        experts = experts.reshape(rows, args.num_layers, args.moe_router_topk)
        if start == 0:
            self.rollout_routed_experts = experts
            return
        held = self.rollout_routed_experts
        if held is None:
            raise ValueError("Cannot append partial routed experts without existing routed experts "
                             f"(routed_experts_start_len={start}).")  # fmt: skip
        held = held if torch.is_tensor(held) else torch.as_tensor(held, dtype=experts.dtype)
        if held.shape[0] < start:
            raise ValueError(f"Existing routed experts shorter than routed_experts_start_len: "
                             f"existing_rows={held.shape[0]}, routed_experts_start_len={start}.")  # fmt: skip
        self.rollout_routed_experts = torch.cat([held[:start], experts], dim=0)

    def _validate_response_metadata_lengths(self):
        """ValueError unless loss_mask and rollout_log_probs have response_length entries and the top-p spans
        cover the response (offsets: response_length + 1 entries, the last equal to the number of ids)."""
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")  # fmt: skip
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if ids is None and offsets is None:
            return
        if ids is None or offsets is None:
            raise ValueError("rollout top-p replay must include both token ids and offsets.")
        offsets = _int32(offsets)
        if offsets.numel() != self.response_length + 1:
            raise ValueError("rollout_top_p_token_offsets length must equal response_length + 1: "
                             f"len(offsets)={offsets.numel()}, response_length={self.response_length}.")  # fmt: skip
        if int(offsets[-1]) != _int32(ids).numel():
            raise ValueError(f"rollout top-p token ids/offsets mismatch: offsets[-1]={int(offsets[-1])}, "
                             f"len(token_ids)={_int32(ids).numel()}.")  # fmt: skip


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a weight update (slime's types.py:446-453)."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    attrs: dict
    size: int
    src_rank: int


# The rollout -> training batch of slime (types.py:459): name -> one entry per sample.
RolloutBatch = dict[str, list[torch.Tensor] | list[int] | list[float] | list[str]]


@dataclass
class MultimodalType:
    name: str  # as in message content, e.g. "image"
    placeholder: str  # the placeholder in conversation messages, e.g. "<image>"


class MultimodalTypes:
    """The known multimodal types (slime's types.py:467-479)."""

    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((m for m in cls.all() if m.name == name), None)
