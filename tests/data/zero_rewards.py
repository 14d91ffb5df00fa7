"""A task reward that is always 0: with --use-opd, training is pure on-policy distillation."""


def zero(response: str, label: str, sample: dict) -> float:
    return 0.0
