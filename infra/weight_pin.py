"""The wire format of a /generate request pinned to weight versions, shared by the rollout client
(tasks/rollout/client.py) and the embedded engine (models/engine/requests.py, server.py).

A request names the versions it may be sampled at with top-level ``min_weight_version`` / ``max_weight_version``
(ints, each optional); an engine serving another version answers 409 with
``{"error": {"type": "weight_version_mismatch", "message", "serving", "min", "max"}}``.

Measured on sglang-router 0.3.2 (tests/integration/test_weight_pin.py): the router re-serialises /generate into
its typed request and drops both fields (unknown sampling fields too), and it forwards no header but its routing
key. It keeps SGLang's ``custom_labels`` (an object of strings) unchanged, so the client sends the pin there as
well (a real SGLang engine uses those only as metric labels). The 409 and its JSON body come back to the client
unchanged and are not retried on another worker (4xx passes through). The router does count each 409 as a worker
failure: with its circuit breaker on (off in infra/router.py's SGLangRouter) ten refusals would bench an engine.
"""

from __future__ import annotations

WEIGHT_VERSION_MISMATCH = "weight_version_mismatch"  # the error type of the 409
PIN_FIELDS = ("min_weight_version", "max_weight_version")
PIN_LABELS = {f: f"sluiceway_{f}" for f in PIN_FIELDS}  # the same, as custom_labels keys (values are strings)


def pin_body(min_version: int | None, max_version: int | None) -> dict:
    """What a /generate body gains for a pin: the fields, and their copy in custom_labels; {} for no pin."""
    pin = {k: v for k, v in zip(PIN_FIELDS, (min_version, max_version), strict=True) if v is not None}
    if not pin:
        return {}
    return pin | {"custom_labels": {PIN_LABELS[k]: str(v) for k, v in pin.items()}}
