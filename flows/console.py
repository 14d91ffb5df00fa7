"""A one-line progress bar on the terminal for the stage in progress (nothing when output is not a terminal)."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressLine:
    def __init__(self, stream: TextIO | None = None, width: int = 24, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.width = width
        self.active = enabled and self.stream.isatty()  # in logs and pipes a redrawn line is noise
        self._shown = False

    def update(self, label: str, done: float, total: float) -> None:
        if not self.active:
            return
        frac = 0.0 if total <= 0 else min(max(done / total, 0.0), 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{label:<18} [{bar}] {done:g}/{total:g}\033[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the bar so the next printed line starts clean."""
        if self.active and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False
