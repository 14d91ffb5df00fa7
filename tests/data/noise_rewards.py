"""Scorers for tests on an untrained model, whose answers are noise: they must still vary within a group."""


def vowel_share(response: str, label: str, sample: dict) -> tuple[float, dict]:
    """The share of vowels among the response's letters: continuous, so samples almost never tie."""
    letters = [ch for ch in response.lower() if ch.isalpha()]
    share = sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0
    return share, {"letters": len(letters)}


def vowel_share_unless_broken(response: str, label: str, sample: dict) -> tuple[float, dict]:
    """vowel_share, but failing like an unusable reward source (a 401) while $RM_BROKEN_MARKER exists."""
    import os

    marker = os.environ.get("RM_BROKEN_MARKER")
    if marker and os.path.exists(marker):
        raise PermissionError("HTTP 401: invalid API key")
    return vowel_share(response, label, sample)
