"""Prompts to text and text to token ids, the one place where chat templates are applied.

Choice for message lists: a prompt given as messages (list of {"role", "content"} dicts) is always rendered
with the chat template, whatever `apply_chat_template` says, because a message list has no other faithful
text form; the flag only decides what happens to a plain string prompt. Rendered prompts end with the
assistant header (`add_generation_prompt=True`): they are what the model continues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sluiceway.infra.errors import UserError


def _check_messages(prompt: Sequence[Any]) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if not prompt:
        raise UserError("prompt: empty message list; expected at least one {'role': ..., 'content': ...}")
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"prompt message {i}: expected a dict with string 'role' and 'content', got {m!r}")
        messages.append(dict(m))
    return messages


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    apply_chat_template: bool,
    system_prompt: str | None = None,
) -> str:
    """Text the model is asked to continue.

    - string, `apply_chat_template=False`: returned unchanged (completion-style prompts);
      a `system_prompt` then is an error, since plain text has nowhere to put it.
    - string, `apply_chat_template=True`: becomes one user message (after `system_prompt`, if any).
    - message list: always rendered with the template (see module docstring); `system_prompt` is put
      first unless the messages already start with a system message, which wins.
    """
    if isinstance(prompt, str):
        if not apply_chat_template:
            if system_prompt is not None:
                raise UserError(
                    "system_prompt is set but apply_chat_template is false: a plain-text prompt cannot carry it"
                )
            return prompt
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence):
        messages = _check_messages(prompt)
    else:
        raise UserError(f"prompt: expected a string or a list of messages, got {type(prompt).__name__}")

    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(f"tokenizer {name}: has no chat template; use plain-text prompts without the chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _bos_prefix(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer itself puts in front of text (e.g. Llama-3's BOS; none for ChatML)."""
    without = tokenizer.encode("a", add_special_tokens=False)
    with_special = tokenizer.encode("a", add_special_tokens=True)
    n = len(without)
    for start in range(len(with_special) - n + 1):
        if with_special[start : start + n] == without:
            return list(with_special[:start])
    return []


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt, with the tokenizer's leading special tokens exactly once.

    A chat-templated prompt already spells its special tokens out as text, so encoding it with
    `add_special_tokens=True` could put a second BOS in front; a plain prompt still gets the BOS the model
    was trained with. Trailing specials (an EOS some tokenizers append) are never added: a prompt is
    continued, not ended.
    """
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    prefix = _bos_prefix(tokenizer)
    if prefix and ids[: len(prefix)] != prefix:
        ids = prefix + ids
    return ids


def make_tokenizer_config_portable(model_dir: str | Path) -> None:
    """Rewrite tokenizer_config.json so transformers 4.x (e.g. on SGLang GPU hosts) reads it as well as 5.x.

    transformers 5 writes `tokenizer_class: TokenizersBackend`, a list-valued `extra_special_tokens` and the
    template only in chat_template.jinja; 4.x knows none of these. 5.x loads the 4.x spelling just the same.
    It also records `local_files_only`/`is_local` of the machine that saved it, which should not travel.
    """
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):
        cfg.pop("extra_special_tokens")
        cfg["additional_special_tokens"] = extra
    for key in ("local_files_only", "is_local", "backend"):
        cfg.pop(key, None)
    template = Path(model_dir) / "chat_template.jinja"
    if template.exists() and "chat_template" not in cfg:
        cfg["chat_template"] = template.read_text()
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
