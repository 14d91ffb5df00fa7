"""What a request to the embedded engine may hold: the JSON body and SGLang's sampling fields, parsed and checked
before anything reaches the engine (models/engine/server.py answers a `BadRequest` with a 400 and its message).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from sluiceway.infra.weight_pin import PIN_LABELS, WEIGHT_VERSION_MISMATCH
from sluiceway.models.engine.calls import SamplingParams

# SGLang sampling fields implemented here (types checked below).
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "no_stop_trim": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "sampling_seed": (int,),
}
# SGLang sampling fields accepted (type-checked) and ignored. custom_params only reaches a custom logit processor,
# and this engine runs none (a request naming one is refused, server.py): so SGLang too ignores it without one.
# slime sends {"return_top_p_token_ids": true} when its top_p != 1, which only slime's patched SGLang answers
# (meta_info.top_p_token_ids); neither this engine nor upstream SGLang returns those.
_SAMPLING_IGNORED: dict[str, tuple[type, ...]] = {"custom_params": (dict,)}
# SGLang sampling fields accepted only at their default (the value that means "off").
_SAMPLING_DEFAULT_ONLY: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "stream_interval": None,
}
# Top-level /generate fields: handled, or accepted when they ask for nothing this engine lacks.
GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "stream", "logprob_start_len", "lora_path",
    "min_weight_version", "max_weight_version", "custom_labels",
}  # fmt: skip
GENERATE_DEFAULT_ONLY: dict[str, Any] = {
    # sglang-router 0.3.2 re-serialises /generate and adds these at their defaults (see infra/router.py).
    "model": None,
    "return_bytes": False,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "session_params": None,
    "custom_logit_processor": None,
    "image_data": None,
    "audio_data": None,
    "video_data": None,
    "input_embeds": None,
    "modalities": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": None,
    "routed_dp_rank": None,
    "priority": None,
    "return_entropy": False,
    "return_routed_experts": False,  # slime's MoE routing replay; this engine serves dense models only
    "background": False,
    "no_logs": False,
    "extra_key": None,
}


# No field needs more nesting than a batched chat request; anything deeper is rejected before later code
# recurses into it (json.loads itself stops at Python's recursion limit, with RecursionError).
_MAX_JSON_DEPTH = 32


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_json_body(raw: bytes, content_type: str | None, required: bool = True) -> dict[str, Any]:
    """A request body as a JSON object, or BadRequest saying what is wrong with it.

    Beyond json.loads: the body must be UTF-8 (json.loads would also take UTF-16, and UTF-8-encoded
    surrogates), strings must be valid Unicode (no lone surrogate: the tokenizer and the UTF-8 response
    encoder both fail on one), and nesting is bounded. A Content-Type, if given, must be JSON (as SGLang's
    FastAPI handlers, which refuse form posts).
    """
    if not raw.strip():
        if required:
            raise BadRequest("empty request body: expected a JSON object")
        return {}
    mime = (content_type or "").split(";")[0].strip().lower()
    if mime and mime != "application/json" and not mime.endswith("+json"):
        raise BadRequest(f"content-type {mime!r}: send a JSON object as application/json", status=415)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8: {e}") from None
    except RecursionError:
        raise BadRequest(f"malformed JSON: nested deeper than {_MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer literal of over 4300 digits
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    stack: list[tuple[Any, int]] = [(body, 1)]  # iterative: the walk itself must not recurse
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"string {ascii(v[:40])} holds a lone UTF-16 surrogate: not valid text") from None
        elif isinstance(v, (dict, list)):
            if depth > _MAX_JSON_DEPTH:
                raise BadRequest(f"malformed JSON: nested deeper than {_MAX_JSON_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (itertools.chain(v, v.values()) if isinstance(v, dict) else v))
    return body


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_sampling_params(d: Any, where: str = "sampling_params") -> SamplingParams:
    if d is None:
        return SamplingParams()
    if not isinstance(d, dict):
        raise BadRequest(f"{where} must be an object, got {type(d).__name__}")
    kwargs: dict[str, Any] = {}
    for k, v in d.items():
        if k in _SAMPLING_DEFAULT_ONLY:
            default = _SAMPLING_DEFAULT_ONLY[k]
            if v is not None and v != default and not (k in ("stop_regex",) and v in ([], "")):
                raise BadRequest(f"{where}.{k}={v!r} is not supported by the embedded engine (only {default!r})")
            continue
        if k not in _SAMPLING_FIELDS and k not in _SAMPLING_IGNORED:
            known = ", ".join(sorted(_SAMPLING_FIELDS | _SAMPLING_IGNORED))
            raise BadRequest(f"{where}: unknown field {k!r} (supported: {known})")
        if v is None:
            continue  # SGLang treats null as "use the default"
        types = _SAMPLING_FIELDS.get(k) or _SAMPLING_IGNORED[k]
        if bool not in types and isinstance(v, bool) or not isinstance(v, types):
            raise BadRequest(f"{where}.{k} must be {' or '.join(t.__name__ for t in types)}, got {v!r}")
        if k in _SAMPLING_FIELDS:
            kwargs[k] = v
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    for k in ("stop", "stop_token_ids"):
        if k in kwargs:
            kwargs[k] = list(kwargs[k])
    if any(not isinstance(t, int) or isinstance(t, bool) for t in kwargs.get("stop_token_ids", [])):
        raise BadRequest(f"{where}.stop_token_ids must be a list of integers")
    for k in ("temperature", "top_p", "min_p"):
        if k in kwargs:
            try:
                kwargs[k] = float(kwargs[k])
            except OverflowError:  # an integer beyond any float; ranges are checked by SamplingParams.validate
                raise BadRequest(f"{where}.{k} must be a finite number, got an integer too large for one") from None
    return SamplingParams(**kwargs)


def per_item(value: Any, n: int, name: str, batched: bool) -> list[Any]:
    """A per-request field given once (shared) or as a list of one value per request."""
    if batched and isinstance(value, list) and name != "stop":
        if len(value) != n:
            raise BadRequest(f"{name}: a list must have one entry per request ({n}), got {len(value)}")
        return value
    return [value] * n


# ------------------------------------------------------------------------------------------ weight-version pin
# The fields, their custom_labels copy (what survives sglang-router) and the 409: infra/weight_pin.py.


def _pin_int(v: Any, name: str, label: bool) -> int:
    if label and isinstance(v, str):
        # One optional minus and ASCII digits: int() alone also takes "1_0", " 3" and "٣", and a test of the
        # digits after lstrip("-") let "--1" through to int() (a 500).
        if re.fullmatch(r"-?[0-9]{1,18}", v):
            return int(v)
    elif isinstance(v, int) and not isinstance(v, bool):
        return v
    raise BadRequest(f"{name} must be an integer weight version, got {v!r}")


def parse_weight_pin(body: dict[str, Any]) -> tuple[int | None, int | None]:
    """(min, max) weight version a /generate body pins, from its fields or its custom_labels; (None, None) when it
    pins nothing. A malformed pin (not an integer, min > max, the two carriers disagreeing) is a BadRequest."""
    labels = body.get("custom_labels")
    if labels is not None and (not isinstance(labels, dict) or any(not isinstance(v, str) for v in labels.values())):
        raise BadRequest("custom_labels must be an object of string values")
    pin: list[int | None] = []
    for field_name, label in PIN_LABELS.items():
        v = body.get(field_name)
        direct = None if v is None else _pin_int(v, field_name, label=False)
        lv = (labels or {}).get(label)
        carried = None if lv is None else _pin_int(lv, f"custom_labels.{label}", label=True)
        if direct is not None and carried is not None and direct != carried:
            raise BadRequest(f"{field_name}={direct} but custom_labels.{label}={carried}: they must agree")
        pin.append(direct if direct is not None else carried)
    lo, hi = pin
    if lo is not None and hi is not None and lo > hi:
        raise BadRequest(f"min_weight_version {lo} is above max_weight_version {hi}")
    return lo, hi


def weight_pin_refusal(serving: str, lo: int | None, hi: int | None) -> dict[str, Any] | None:
    """The 409 body refusing a request pinned to (lo, hi) on an engine serving `serving`, or None if it may run.
    Versions compare as integers; an engine whose version is not one (SGLang's "default") refuses any pin."""
    if lo is None and hi is None:
        return None
    try:
        v: int | None = int(serving)
    except (TypeError, ValueError):
        v = None
    if v is not None and (lo is None or v >= lo) and (hi is None or v <= hi):
        return None
    want = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    message = f"this engine serves weight version {serving!r}, the request is pinned to {want}"
    return {"error": {"type": WEIGHT_VERSION_MISMATCH, "message": message, "serving": serving, "min": lo, "max": hi}}
