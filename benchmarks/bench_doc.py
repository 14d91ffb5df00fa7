"""The one place benchmark scripts write their results: a section of docs/benchmarks.md, replaced in place."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
_HEADER = "# Benchmarks\n\nMeasured numbers; each section is refreshed by its script.\n"


def write_section(text: str, section: str, doc_path: Path = DOC) -> None:
    """Replace the section headed `section` (up to the next `## `) with `text`, or append it if absent."""
    doc = doc_path.read_text() if doc_path.exists() else _HEADER
    pattern = re.compile(rf"{re.escape(section)}\n.*?(?=\n## |\Z)", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: text.rstrip("\n") + "\n", doc)
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    doc_path.write_text(doc)
