"""A scorer for tests on an untrained model: the share of digits in the response, so groups have spread."""


def digit_share(response: str, label: str, sample: dict) -> tuple[float, dict]:
    text = response.strip()
    share = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
    return share, {"chars": len(text)}
