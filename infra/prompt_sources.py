"""The kinds of prompt source a `--prompt-data` value names, by its scheme: the one place a source's kind is told
from its text (docs/environments.md says what each is).

- `env:NAME` or `env:mix(...)`: a built-in environment (tasks/environments/);
- `verifiers:NAME`: a verifiers v1 taskset, whose episodes the run plays (tasks/rollout/agent/verifiers.py);
- `openenv:URL` or `openenv:MODULE:Class`: an OpenEnv environment, whose episodes the run plays;
- anything else: a JSONL or Parquet file.
"""

from __future__ import annotations

ENV, VERIFIERS, OPENENV, FILE = "env", "verifiers", "openenv", "file"
SCHEMES = {ENV: "env:", VERIFIERS: "verifiers:", OPENENV: "openenv:"}
# Sources that are environments (no file to read: SFT cannot use them) and those that play their own episodes
# (no custom generate or agent function beside them, no evaluation sets yet).
ENVIRONMENTS = frozenset({ENV, VERIFIERS, OPENENV})
EPISODES = frozenset({VERIFIERS, OPENENV})


def source_kind(prompt_data: str | None) -> str | None:
    """ENV, VERIFIERS, OPENENV, FILE, or None when unset."""
    if prompt_data is None:
        return None
    return next((kind for kind, scheme in SCHEMES.items() if prompt_data.startswith(scheme)), FILE)


def source_body(prompt_data: str) -> str:
    """What follows the scheme (`arithmetic` of `env:arithmetic`); a file's path as given."""
    kind = source_kind(prompt_data)
    return prompt_data[len(SCHEMES[kind]) :] if kind in SCHEMES else prompt_data
