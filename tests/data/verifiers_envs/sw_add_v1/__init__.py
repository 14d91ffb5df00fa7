"""A small verifiers v1 environment written for sluiceway's tests against verifiers 0.4.0's own API (read from
its source, not copied): a taskset of additions, a task whose rubric has two weighted rewards and a metric, and
one tool (`add`, served over MCP by a `vf.Toolset`). Played by verifiers' `null` harness (its chat loop: the
model may call the tool, the result comes back as a tool message, the model answers): multi-turn whenever the
model calls the tool.

Importable as `sw_add_v1` with tests/data/verifiers_envs on the path; `--prompt-data verifiers:sw_add_v1`.
"""

from sw_add_v1.taskset import AddTaskset

__all__ = ["AddTaskset"]
