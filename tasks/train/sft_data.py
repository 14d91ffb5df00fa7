"""SFT samples: dataset rows (slime's format) to token ids and a loss mask, with the model's chat template.

Two record shapes, as in slime:
- conversation: ``input_key`` holds a list of chat messages; every assistant turn is trained;
- prompt/response: ``input_key`` holds the prompt (text or messages), ``response_key`` the response text.

What is trained in an assistant turn: its content and the template's end-of-turn token (the tokenizer's EOS,
e.g. ``<|im_end|>``), so the model learns to stop. Not trained: the turn's header (``<|im_start|>assistant\\n``),
which the inference prompt already holds, and whatever the template puts after the end-of-turn token (a newline
the engine never generates: it stops at EOS). A plain-text prompt without the chat template is trained as a
completion: response tokens and the EOS.

The rendered conversation is encoded piece by piece, cut at every trained span's edges, so a prompt's tokens
are exactly what `encode_prompt` gives the engine for the same prompt (token-in, token-out), never a merge
across the header/content boundary.

Over-long samples (more than ``max_len`` tokens) are an error naming the file and line; with ``truncate`` the
sample's tail is cut instead (the last turn then loses its EOS) -- nothing is dropped silently either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluiceway.infra.errors import UserError
from sluiceway.models.chat import encode_prompt
from sluiceway.tasks.train.samples import TrainSample


@dataclass(frozen=True)
class SftSettings:
    apply_chat_template: bool = False
    system_prompt: str | None = None
    max_len: int = 2048
    truncate: bool = False


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def conversation_segments(tokenizer: Any, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces, up to the end of the last trained span."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: the tokenizer has no chat template; use prompt/response records as plain text")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise UserError(f"{where}: no assistant message; expected at least one assistant turn to train on")
    if roles[0] == "assistant":
        raise UserError(f"{where}: the conversation starts with an assistant turn; expected a user message first")
    text = _render(tokenizer, messages, False)
    eos = tokenizer.eos_token
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], True)  # everything before the content, header included
        turn = _render(tokenizer, messages[: i + 1], False)
        if not (turn.startswith(head) and text.startswith(turn)) or m["content"] not in turn[len(head) :]:
            # e.g. templates that drop earlier turns' reasoning: the turn's tokens cannot be located.
            raise UserError(
                f"{where}: the chat template does not render message {i} as a prefix of the conversation; "
                "cannot tell which tokens are the assistant's"
            )
        body = turn[len(head) :]
        after = body.index(m["content"]) + len(m["content"])
        stop = body.find(eos, after) if eos else -1
        end = stop + len(eos) if stop >= 0 else len(body.rstrip())
        segments += [(text[pos : len(head)], False), (body[:end], True)]
        pos = len(head) + end
    return [(t, trained) for t, trained in segments if t]


def encode_segments(tokenizer: Any, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask; the first (untrained) piece gets the tokenizer's leading specials once."""
    ids: list[int] = []
    mask: list[int] = []
    for i, (text, trained) in enumerate(segments):
        piece = encode_prompt(tokenizer, text) if i == 0 else list(tokenizer.encode(text, add_special_tokens=False))
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def encode_row(tokenizer: Any, row: dict, settings: SftSettings, where: str, has_response: bool) -> tuple[list, list]:
    """(ids, mask) of one dataset row (see storage/datasets.py: prompt or messages, label = the response)."""
    messages = [dict(m) for m in row["messages"]] if row.get("messages") else None
    response = row.get("label") if has_response else None
    if has_response:
        if response is None:
            raise UserError(f"{where}: no response; expected the response text under the response key")
        if messages is None and not settings.apply_chat_template:
            if settings.system_prompt is not None:
                raise UserError("system_prompt is set but apply_chat_template is false: plain text cannot carry it")
            eos = tokenizer.eos_token_id
            ids, mask = encode_segments(tokenizer, [(row["prompt"], False), (response, True)])
            return ids + ([eos] if eos is not None else []), mask + ([1] if eos is not None else [])
        messages = (messages or [{"role": "user", "content": row["prompt"]}]) + [
            {"role": "assistant", "content": response}
        ]
    elif messages is None:
        raise UserError(
            f"{where}: the input is text; expected a list of chat messages (or set --response-key for "
            "prompt/response records)"
        )
    if settings.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": settings.system_prompt}, *messages]
    return encode_segments(tokenizer, conversation_segments(tokenizer, messages, where))


def to_sample(ids: list[int], mask: list[int]) -> TrainSample:
    """A TrainSample whose 'response' starts at the first trained token (slime's response_length)."""
    first = mask.index(1)
    rest = len(ids) - first
    return TrainSample(ids[:first], ids[first:], mask[first:], 0.0, [0.0] * rest)


def sft_samples(
    rows: list[dict], tokenizer: Any, settings: SftSettings, where: Callable[[dict], str], has_response: bool
) -> list[TrainSample]:
    """Encode every row; `where(row)` names it in errors (file:line)."""
    out = []
    for row in rows:
        w = where(row)
        ids, mask = encode_row(tokenizer, row, settings, w, has_response)
        if len(ids) > settings.max_len:
            if not settings.truncate:
                raise UserError(
                    f"{w}: {len(ids)} tokens exceeds --sft-max-len {settings.max_len} "
                    "(raise it, or --sft-truncate to cut long samples)"
                )
            ids, mask = ids[: settings.max_len], mask[: settings.max_len]
        if 1 not in mask[1:]:  # the first token has nothing before it to be predicted from
            cut = f" within the first {settings.max_len} tokens (--sft-max-len)" if len(ids) == settings.max_len else ""
            raise UserError(f"{w}: no response token to train on{cut}")
        mask[0] = 0
        out.append(to_sample(ids, mask))
    return out
