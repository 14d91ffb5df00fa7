"""A /generate pinned to weight versions (infra/weight_pin.py): how the embedded engine reads the pin (its fields,
or their custom_labels copy that survives sglang-router) and refuses a version it does not serve with a 409.
Through the real router: tests/integration/test_weight_pin.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from sluiceway.infra.weight_pin import pin_body
from sluiceway.models.engine import Engine
from sluiceway.models.engine.requests import BadRequest, parse_weight_pin, weight_pin_refusal
from sluiceway.models.engine.server import build_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.mark.parametrize(
    ("body", "pin"),
    [
        ({}, (None, None)),
        ({"min_weight_version": 3}, (3, None)),
        ({"max_weight_version": 4}, (None, 4)),
        ({"min_weight_version": 3, "max_weight_version": 3}, (3, 3)),
        ({"custom_labels": {"sluiceway_min_weight_version": "3", "other": "x"}}, (3, None)),  # as the router sends
        (pin_body(2, 5), (2, 5)),  # both carriers, agreeing
        ({"min_weight_version": None, "custom_labels": {}}, (None, None)),
    ],
)
def test_a_pin_is_read_from_its_fields_or_their_custom_labels_copy(body, pin):
    assert parse_weight_pin(body) == pin


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"min_weight_version": "3"}, "min_weight_version must be an integer"),
        ({"max_weight_version": 2.5}, "max_weight_version must be an integer"),
        ({"min_weight_version": True}, "must be an integer"),
        ({"min_weight_version": 4, "max_weight_version": 3}, "4 is above max_weight_version 3"),
        ({"custom_labels": {"sluiceway_max_weight_version": "v3"}}, "custom_labels.sluiceway_max_weight_version"),
        ({"custom_labels": {"sluiceway_max_weight_version": "1_0"}}, "must be an integer"),
        ({"custom_labels": {"sluiceway_min_weight_version": "-"}}, "must be an integer"),
        ({"custom_labels": {"sluiceway_min_weight_version": "--1"}}, "must be an integer"),  # issue 52: a 500
        ({"custom_labels": {"sluiceway_min_weight_version": "1-"}}, "must be an integer"),
        ({"custom_labels": {"sluiceway_min_weight_version": 3}}, "object of string values"),
        ({"custom_labels": ["x"]}, "object of string values"),
        ({"min_weight_version": 3, "custom_labels": {"sluiceway_min_weight_version": "4"}}, "must agree"),
    ],
)
def test_a_malformed_pin_is_a_bad_request(body, says):
    with pytest.raises(BadRequest, match=says) as e:
        parse_weight_pin(body)
    assert e.value.status == 400


def test_refusal_compares_versions_as_integers():
    assert weight_pin_refusal("3", None, None) is None
    assert weight_pin_refusal("default", None, None) is None  # no pin: any version, as before
    assert weight_pin_refusal("3", 3, 3) is None
    assert weight_pin_refusal("10", 9, None) is None  # "10" < "9" as strings, not as versions
    assert weight_pin_refusal("3", None, 5) is None
    refused = weight_pin_refusal("3", 4, None)
    assert refused["error"] | {"message": ""} == {
        "type": "weight_version_mismatch", "message": "", "serving": "3", "min": 4, "max": None,
    }  # fmt: skip
    assert "'3'" in refused["error"]["message"] and "[4, inf]" in refused["error"]["message"]
    assert weight_pin_refusal("3", None, 2)["error"]["max"] == 2
    assert weight_pin_refusal("default", 0, None)["error"]["serving"] == "default"  # not an integer: refused


def test_the_engine_refuses_a_pin_it_does_not_serve_before_generating(tiny):
    path, _ = tiny
    engine = Engine(path, max_running_requests=2, max_total_len=64, weight_version="3", seed=0)
    try:
        http = TestClient(build_app(engine))
        base = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        assert http.post("/generate", json=base).json()["meta_info"]["weight_version"] == "3"
        ok = http.post("/generate", json=base | pin_body(3, 3))
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
        labels_only = {"custom_labels": pin_body(1, 3)["custom_labels"]}  # what arrives through sglang-router
        assert http.post("/generate", json=base | labels_only).status_code == 200
        for pin, stream in (((4, None), False), ((None, 2), False), ((4, 6), True)):
            r = http.post("/generate", json=base | pin_body(*pin) | {"stream": stream})
            assert r.status_code == 409, r.text
            assert r.json()["error"] | {"message": ""} == {
                "type": "weight_version_mismatch", "message": "", "serving": "3", "min": pin[0], "max": pin[1],
            }  # fmt: skip
        batch = {"input_ids": [[1, 5], [1, 9]], "sampling_params": {"max_new_tokens": 1}}
        assert http.post("/generate", json=batch | {"min_weight_version": 4}).status_code == 409  # one pin, all
        bad = http.post("/generate", json=base | {"min_weight_version": 5, "max_weight_version": 4})
        assert bad.status_code == 400 and "above max_weight_version" in bad.json()["message"]
        assert engine.load()["num_running_reqs"] == engine.load()["num_waiting_reqs"] == 0
        assert http.post("/update_weight_version", json={"new_version": "4"}).status_code == 200
        assert http.post("/generate", json=base | pin_body(4, None)).json()["meta_info"]["weight_version"] == "4"
    finally:
        engine.shutdown()
