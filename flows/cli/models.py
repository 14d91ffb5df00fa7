"""`sluiceway models`: list the model zoo."""

from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("models", help="list the model zoo")


def run(args) -> int:
    from sluiceway.models.zoo import ZOO

    for name, entry in ZOO.items():
        print(f"{name:24s} {entry.description}")
    return 0
