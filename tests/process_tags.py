"""Finding a test's own processes by a tag in their environment, never by command line.

A command-line pattern ("sluiceway.flows.cli engine") also matches the engines of another checkout or test
running on the same machine. A test instead starts its command with SLUICEWAY_TEST_TAG=<a fresh uuid>; every
process that command starts (engines, router, Prefect server, trainer group) inherits the variable.
"""

from __future__ import annotations

import os
import uuid

from sluiceway.infra.proc import processes_with_env

TAG_VARIABLE = "SLUICEWAY_TEST_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, base: dict | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the tag set."""
    return dict(os.environ if base is None else base) | {TAG_VARIABLE: tag}


def processes_tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment holds SLUICEWAY_TEST_TAG=tag."""
    return processes_with_env(TAG_VARIABLE, tag)
