"""Prompts generated step by step at the levels an AdaptiveDifficulty curriculum has reached.

The curriculum's state is saved to a JSON file after each step's rewards are observed, together with the
last step observed. A step's prompts depend only on that saved state and the step's seed, so a step that
is re-run after a crash generates the same prompts, and observing the same step twice changes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sluiceway.storage.trajectories import is_finished
from sluiceway.tasks.environments import parse_spec
from sluiceway.tasks.environments.curriculum import AdaptiveDifficulty, generate_batch


class AdaptivePromptSource:
    def __init__(self, spec: str, state_path: Path, seed: int, **curriculum_kwargs):
        self.state_path = Path(state_path)
        self.seed = seed
        if self.state_path.exists():
            saved = json.loads(self.state_path.read_text())
            self.curriculum = AdaptiveDifficulty.from_state(saved["curriculum"])
            self.last_observed_step = saved["last_observed_step"]
        else:
            parts = parse_spec(spec)
            self.curriculum = AdaptiveDifficulty(
                [name for name, _, _ in parts],
                start_level={name: level for name, level, _ in parts},
                weights={name: weight for name, _, weight in parts},
                **curriculum_kwargs,
            )
            self.last_observed_step = -1

    def records_for_step(self, step: int, n: int) -> list[dict]:
        return generate_batch(n, self.seed * 1_000_003 + step, self.curriculum)

    def observe_step(self, step: int, rows: list[dict]) -> dict[str, float]:
        """Feed a step's scored samples to the curriculum once; returns the levels as metrics."""
        if step > self.last_observed_step:
            for r in rows:
                if r["reward"] is not None and is_finished(r):
                    self.curriculum.observe(r["metadata"], r["reward"])
            self.last_observed_step = step
            self._save()
        return {f"difficulty/{env}": float(level) for env, level in self.curriculum.levels().items()}

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        state = {"curriculum": self.curriculum.state(), "last_observed_step": self.last_observed_step}
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)  # atomic: a crash leaves the old state or the new, never half
