"""\\boxed{...} / \\fbox{...} contents, braces balanced, in one linear pass."""

from __future__ import annotations

import re

# A box opener, an escaped character (so "\{" never counts as a brace), or a brace.
_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\.|[{}]", re.DOTALL)


def boxed_all(text: str) -> list[str]:
    """Contents of every closed box, ordered by where the box starts; unclosed boxes are skipped.

    One stack-based pass: a response full of unclosed "\\boxed{" stays linear.
    """
    found: list[tuple[int, str]] = []
    stack: list[tuple[int, int] | None] = []  # (box start, content start) for boxes, None for plain "{"
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok == "{":
            stack.append(None)
        elif tok == "}":
            if stack:
                frame = stack.pop()
                if frame is not None:
                    found.append((frame[0], text[frame[1] : m.start()]))
        elif tok.endswith("{") and not tok.startswith("\\{"):
            stack.append((m.start(), m.end()))
    found.sort()
    return [content.strip() for _, content in found]


def last_boxed(text: str) -> str | None:
    """The answer is the LAST box: earlier boxes are drafts the model went on to revise."""
    boxes = boxed_all(text)
    return boxes[-1] if boxes else None
