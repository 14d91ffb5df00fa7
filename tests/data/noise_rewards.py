"""Scorers for tests on an untrained model, whose answers are noise: they must still vary within a group."""


def vowel_share(response: str, label: str, sample: dict) -> tuple[float, dict]:
    """The share of vowels among the response's letters: continuous, so samples almost never tie."""
    letters = [ch for ch in response.lower() if ch.isalpha()]
    share = sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0
    return share, {"letters": len(letters)}
