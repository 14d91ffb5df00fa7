"""Adaptive difficulty: per-environment levels that follow the policy's recent accuracy.

Each environment keeps the rewards of its most recent samples *at its current level* (a sliding window of
`window` samples). Once at least `min_samples` have arrived since the level last changed, the level goes
up one when their mean reward is above `raise_above` and down one when it is below `lower_below`, clamped
to [1, max_level]; a change empties the window. Samples generated at another level (stale prompts that
were in flight when the level moved) are counted but do not vote.

Levels are written into every record's metadata by the generator (`generate_batch`), so the rewards can
be fed back with `record(env, metadata["level"], reward)` or `observe(metadata, reward)`. `state()` is
plain JSON; `AdaptiveDifficulty.from_state(state)` resumes with the same levels and windows.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from sluiceway.tasks.environments import ENVIRONMENTS, generate_records
from sluiceway.tasks.environments.base import parse_metadata

STATE_VERSION = 1


class AdaptiveDifficulty:
    def __init__(
        self,
        env_names: list[str] | tuple[str, ...],
        start_level: int | dict[str, int] = 1,
        window: int = 64,
        raise_above: float = 0.8,
        lower_below: float = 0.2,
        min_samples: int = 32,
        max_levels: dict[str, int] | None = None,
        weights: dict[str, float] | None = None,
    ):
        if not env_names:
            raise ValueError("AdaptiveDifficulty needs at least one environment")
        unknown = [e for e in env_names if e not in ENVIRONMENTS]
        if unknown:
            raise ValueError(f"unknown environments {unknown} (known: {', '.join(ENVIRONMENTS)})")
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got min_samples={min_samples}, window={window}")
        if not 0.0 <= lower_below < raise_above <= 1.0:
            raise ValueError(f"need 0 <= lower_below < raise_above <= 1, got {lower_below}, {raise_above}")
        self.env_names = list(dict.fromkeys(env_names))
        self.window, self.min_samples = window, min_samples
        self.raise_above, self.lower_below = raise_above, lower_below
        self.max_levels = {e: ENVIRONMENTS[e].max_level for e in self.env_names}
        for e, m in (max_levels or {}).items():
            if e in self.max_levels:
                self.max_levels[e] = max(1, min(int(m), ENVIRONMENTS[e].max_level))
        self.weights = {e: float((weights or {}).get(e, 1.0)) for e in self.env_names}
        starts = start_level if isinstance(start_level, dict) else dict.fromkeys(self.env_names, start_level)
        self._level = {e: self._clamp(e, int(starts.get(e, 1))) for e in self.env_names}
        self._recent: dict[str, deque[float]] = {e: deque(maxlen=window) for e in self.env_names}
        self._stale = dict.fromkeys(self.env_names, 0)
        self._seen = dict.fromkeys(self.env_names, 0)
        self.history: list[dict] = []  # level changes: {"env", "from", "to", "accuracy", "sample"}

    def _clamp(self, env: str, level: int) -> int:
        return max(1, min(level, self.max_levels[env]))

    def level(self, env: str) -> int:
        return self._level[env]

    def levels(self) -> dict[str, int]:
        return dict(self._level)

    def accuracy(self, env: str) -> float | None:
        recent = self._recent[env]
        return sum(recent) / len(recent) if recent else None

    def record(self, env: str, level: int, reward: float) -> int:
        """Add one sample's reward (at the level it was generated at); returns env's level afterwards."""
        if env not in self._level:
            return 0  # an environment this curriculum does not steer
        self._seen[env] += 1
        if int(level) != self._level[env]:
            self._stale[env] += 1
            return self._level[env]
        recent = self._recent[env]
        recent.append(min(1.0, max(0.0, float(reward))))
        if len(recent) < self.min_samples:
            return self._level[env]
        acc = sum(recent) / len(recent)
        old = self._level[env]
        if acc > self.raise_above:
            new = self._clamp(env, old + 1)
        elif acc < self.lower_below:
            new = self._clamp(env, old - 1)
        else:
            new = old
        if new != old:
            self._level[env] = new
            recent.clear()
            self.history.append({"env": env, "from": old, "to": new, "accuracy": acc, "sample": self._seen[env]})
        return new

    def observe(self, metadata: Any, reward: float) -> int:
        """record() from a record's or trajectory row's metadata (dict or JSON string)."""
        meta = parse_metadata(metadata)
        env, level = meta.get("env"), meta.get("level")
        if not isinstance(env, str) or not isinstance(level, int):
            return 0
        return self.record(env, level, reward)

    def state(self) -> dict:
        return {
            "version": STATE_VERSION,
            "params": {
                "window": self.window,
                "raise_above": self.raise_above,
                "lower_below": self.lower_below,
                "min_samples": self.min_samples,
                "max_levels": dict(self.max_levels),
                "weights": dict(self.weights),
            },
            "envs": {
                e: {
                    "level": self._level[e],
                    "recent": list(self._recent[e]),
                    "seen": self._seen[e],
                    "stale": self._stale[e],
                }
                for e in self.env_names
            },
            "history": list(self.history),
        }

    @classmethod
    def from_state(cls, state: dict) -> AdaptiveDifficulty:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}, expected {STATE_VERSION}")
        envs = state["envs"]
        cur = cls(
            list(envs),
            start_level={e: s["level"] for e, s in envs.items()},
            **state["params"],
        )
        for e, s in envs.items():
            cur._recent[e].extend(float(x) for x in s.get("recent", []))
            cur._seen[e], cur._stale[e] = int(s.get("seen", 0)), int(s.get("stale", 0))
        cur.history = list(state.get("history", []))
        return cur


def generate_batch(n: int, seed: int, curriculum: AdaptiveDifficulty) -> list[dict]:
    """n records over the curriculum's environments (in proportion to its weights) at their current levels."""
    names = [e for e in curriculum.env_names if curriculum.weights[e] > 0]
    components = [(e, curriculum.level(e)) for e in names]
    return generate_records(components, n, seed, [curriculum.weights[e] for e in names])
