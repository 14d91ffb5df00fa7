"""The Tinker server's pure logic: futures (pending, result, user and server errors in the SDK's shape), a model's
jobs in seq_id order, and the SDK's own request encoding read back (protobuf, zstd) and results it decodes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from sluiceway.flows.tinker.futures import FutureStore, Result, SequencedRunner, TinkerUserError  # noqa: E402
from sluiceway.flows.tinker.limits import BodyTooLarge, inflate  # noqa: E402
from sluiceway.flows.tinker.sampler import engine_sampling, prompt_tokens  # noqa: E402
from sluiceway.flows.tinker.wire import (  # noqa: E402
    SequenceOut,
    forward_backward_output,
    parse_forward_backward,
    sample_response,
)


def test_future_pending_then_result_and_errors():
    store = FutureStore()
    rid = store.new()
    assert store.wait(rid, 0.01) is None  # pending: the route answers try_again
    threading.Timer(0.05, store.finish, (rid, Result(json={"ok": 1}))).start()
    assert store.wait(rid, 5).body() == {"ok": 1}  # the long poll returns as soon as it is done
    user, server = store.new(), store.new()
    store.run(user, lambda: (_ for _ in ()).throw(TinkerUserError("bad input")))
    store.run(server, lambda: 1 / 0)
    assert store.wait(user, 0).body() == {"error": "bad input", "category": "user"}
    assert store.wait(server, 0).body()["category"] == "server"
    assert "ZeroDivisionError" in store.wait(server, 0).body()["error"]
    assert not store.known("req-nope")
    # the SDK's own reading of the error body
    failed = types.RequestFailedResponse.model_validate(store.wait(user, 0).body())
    assert failed.category == types.RequestErrorCategory.User


def test_runner_orders_by_seq_id_and_skips_a_lasting_gap():
    runner = SequencedRunner("t", gap_wait=0.3)
    ran, done = [], threading.Event()
    for seq in (3, 1, 2):  # arrive out of order
        runner.submit(seq, lambda s=seq: ran.append(s))
    runner.submit(None, lambda: (ran.append("free"), done.set()))  # after every numbered job queued
    runner.submit(5, lambda: ran.append(5))  # 4 never comes: 5 runs after gap_wait
    t0 = time.monotonic()
    assert done.wait(5)
    assert ran == [1, 2, 3, 5, "free"]
    assert time.monotonic() - t0 >= 0.25
    runner.stop()


def test_forward_backward_request_round_trip_with_zstd():
    import zstandard

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]},
        ),  # fmt: skip
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6]),
            loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 0.5]},
        ),  # fmt: skip
    ]
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="s:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(req)
    body = zstandard.ZstdCompressor().compress(msg.SerializeToString())
    got = parse_forward_backward(inflate(body, "zstd"))
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "cross_entropy", False)
    assert [d.tokens for d in got.data] == [[1, 2, 3], [5, 6]]
    assert got.data[0].inputs["target_tokens"].tolist() == [2, 3, 4]
    assert got.data[1].inputs["weights"].tolist() == [1.0, 0.5]
    with pytest.raises(TinkerUserError, match="not a ForwardBackwardRequest"):
        parse_forward_backward(b"\xff\xff\xff")
    with pytest.raises(TinkerUserError, match="gzip"):
        inflate(b"", "gzip")


def test_hostile_forward_backward_bodies_are_the_callers_error():
    """Issue 52 point 9-10: a small zstd body inflating to gigabytes, a corrupt frame, token bytes not a whole number
    of int32, tensor bytes that disagree with their dtype and shape: each a TinkerUserError (a 400/413), never
    a 500 or the memory they would take."""
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (3 << 20))  # 3 MiB of zeros: a few hundred bytes
    with pytest.raises(BodyTooLarge, match="inflates past 1048576 bytes"):
        inflate(bomb, "zstd", limit=1 << 20)
    assert len(inflate(bomb, "zstd", limit=4 << 20)) == 3 << 20
    with pytest.raises(TinkerUserError, match="cannot be decompressed"):
        inflate(b"\x28\xb5\x2f\xfd" + b"\x00garbage" * 10, "zstd")

    from tinker.proto import tinker_public_pb2 as pb

    def request(tokens: bytes, tensor=None) -> bytes:
        msg = pb.ForwardBackwardRequest(model_id="s:train:0", loss_fn="cross_entropy")
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = tokens
        if tensor is not None:
            d.loss_fn_inputs["weights"].CopyFrom(tensor)
        return msg.SerializeToString()

    with pytest.raises(TinkerUserError, match="datum 0: its tokens are 5 bytes"):
        parse_forward_backward(request(b"\x01\x00\x00\x00\x02"))
    for bad in (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3], dense=b"\x00" * 5),  # not whole float32s
                pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3], dense=b"\x00" * 8),  # 2 values for a shape of 3
                pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], dense=b"\x00" * 4)):  # fmt: skip
        with pytest.raises(TinkerUserError, match=r"datum 0: loss_fn_inputs\['weights'\] is not a valid tensor"):
            parse_forward_backward(request(b"\x01\x00\x00\x00", bad))


def test_results_decode_with_the_sdk():
    out = deserialize_forward_backward_output(
        forward_backward_output(
            [{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-0.5])}], {"loss:sum": 3.5}
        )
    )
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    res = deserialize_sample_response(
        sample_response([SequenceOut([7, 8], [-0.25, -0.5], "length")], [None, -1.5, -2.5])
    )
    assert res.sequences[0].tokens == [7, 8] and res.sequences[0].logprobs == [-0.25, -0.5]
    assert res.sequences[0].stop_reason == "length"
    assert res.prompt_logprobs == [None, -1.5, -2.5]


def test_sampling_params_map_onto_the_engine():
    sp = engine_sampling({"max_tokens": 5, "temperature": 0.5, "seed": 10, "stop": "\n"}, 2)
    assert (sp.max_new_tokens, sp.temperature, sp.sampling_seed, sp.stop) == (5, 0.5, 12, ["\n"])
    assert engine_sampling({"stop": [3, 4]}, 0).stop_token_ids == [3, 4]
    assert engine_sampling({"stop": []}, 0).ignore_eos  # [] disables every stop, EOS included
    assert engine_sampling({}, 0).sampling_seed is None
    assert prompt_tokens({"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, {"tokens": [3]}]}) == [1, 2, 3]
    with pytest.raises(TinkerUserError, match="image"):
        prompt_tokens({"chunks": [{"type": "image", "data": ""}]})
