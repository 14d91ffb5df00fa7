"""Lines held until a run starts (infra/held_lines.py): logged once, in order, the precision line first; a
source's report replaced when read again; dropped by a user's mistake."""

import logging

import pytest

from sluiceway.infra import held_lines


@pytest.fixture(autouse=True)
def empty():
    held_lines.drop()
    yield
    held_lines.drop()


def logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sluiceway"]


def test_flushed_once_in_order_with_the_first_source_ahead(caplog):
    held_lines.replace("slime", ["slime flags not applicable on this device: --a"])
    held_lines.hold("built tiny-llama (first use): 1.0 s", "zoo")
    held_lines.replace("precision", ["precision: fp32 (asked for)"], first=True)
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        held_lines.flush()
        held_lines.flush()  # nothing left: each line once
    assert logged(caplog) == [
        "precision: fp32 (asked for)",
        "slime flags not applicable on this device: --a",
        "built tiny-llama (first use): 1.0 s",
    ]


def test_a_source_read_again_replaces_its_lines():
    held_lines.replace("slime", ["one", "two"])
    held_lines.hold("built", "zoo")
    held_lines.replace("slime", ["three"])
    assert held_lines.held("slime") == ["three"]
    assert held_lines.held() == ["built", "three"]


def test_a_user_mistake_drops_them(caplog):
    held_lines.hold("built tiny-llama (first use): 1.0 s", "zoo")
    held_lines.drop()
    with caplog.at_level(logging.INFO, logger="sluiceway"):
        held_lines.flush()
    assert logged(caplog) == []
