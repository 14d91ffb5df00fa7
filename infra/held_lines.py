"""Log lines that arise before a run's logging exists, held until the run starts.

Reading slime's flags, building a zoo model on first use and choosing the precision all happen while the config is
checked, before the run's log file and terminal handler are set up, and before the checks that can still fail with
a user's mistake. Their lines are held here: a run logs them once everything is checked (flows/live_run.py
`LiveRun.take_prepared`), and a command ended by a user's mistake drops them (flows/cli/main.py `main`), so that
mistake's one line is the only one on the terminal.
"""

from __future__ import annotations

import logging
import threading

# Process-global on purpose: these lines come from code that runs before any run exists in this process (the config
# reader, the model zoo) and cannot name one; one buffer, flushed or dropped as a whole.
_HELD: list[tuple[str, str]] = []  # (source, line) in the order they arose
_LOCK = threading.Lock()


def hold(line: str, source: str = "") -> None:
    """Keep `line` until the run starts."""
    with _LOCK:
        _HELD.append((source, line))


def replace(source: str, lines: list[str], first: bool = False) -> None:
    """Hold `lines` in place of what `source` held before (a config read twice reports once); `first`: ahead of
    every other held line."""
    with _LOCK:
        others, mine = [(s, x) for s, x in _HELD if s != source], [(source, x) for x in lines]
        _HELD[:] = mine + others if first else others + mine


def held(source: str | None = None) -> list[str]:
    """What is held now (of one source, or all), without taking it."""
    with _LOCK:
        return [x for s, x in _HELD if source is None or s == source]


def flush(logger: str = "sluiceway") -> None:
    """Log every held line at INFO, once."""
    with _LOCK:
        lines, _HELD[:] = [x for _, x in _HELD], []
    log = logging.getLogger(logger)
    for line in lines:
        log.info(line)


def drop() -> None:
    """Forget every held line: a user's mistake ended the command before the run started."""
    with _LOCK:
        _HELD.clear()
