"""--openenv-action-parser for tests/data/openenv_guess.py: an untrained model's text becomes a guess (its length
modulo 8, plus 1), so every turn is an action and episodes run several steps."""


def parse(text: str) -> dict:
    return {"number": len(text) % 8 + 1}
