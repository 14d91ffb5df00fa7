"""The SDK's binary bodies: a forward_backward request arrives as protobuf (zstd-compressed when the client
config asks for it), and ForwardBackwardOutput and SampleResponse results go back as protobuf (the SDK 0.38
refuses them as JSON). The messages are the pinned `tinker` package's own (tinker.proto.tinker_public_pb2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

from sluiceway.flows.tinker.futures import TinkerUserError, not_implemented


@dataclass
class DatumIn:
    """One datum of a forward/backward: its tokens and its loss inputs as dense numpy arrays."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdIn:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn]


def _tensor(t, i: int, name: str) -> np.ndarray:
    """A loss input's TensorData as numpy; bytes that disagree with its dtype or shape are the caller's error."""
    try:
        return _tensor_data_from_proto(t).to_numpy()
    except Exception as e:  # noqa: BLE001 - numpy's ValueError, the SDK's own checks: whatever the bytes provoke
        raise TinkerUserError(f"datum {i}: loss_fn_inputs[{name!r}] is not a valid tensor ({e})") from None


def parse_forward_backward(body: bytes) -> FwdBwdIn:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 (protobuf's DecodeError and friends)
        raise TinkerUserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf: {e}") from e
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 carries strings too and wins
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise not_implemented(f"{kind} chunks in a model input (datum {i}; only token chunks)")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise TinkerUserError(f"datum {i}: its tokens are {len(raw)} bytes, not a whole number of int32")
            tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, i, name) for name, t in d.loss_fn_inputs.items()}
        data.append(DatumIn(tokens, inputs))
    return FwdBwdIn(msg.model_id, msg.seq_id or None, msg.loss_fn, config, msg.forward_only, data)


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput protobuf: one ArrayRecord whose fields hold every datum's 1-D float32 array,
    concatenated, with byte offsets between them (what tinker.proto.response_conv reads back)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    if per_datum:
        record = out.loss_fn_outputs.add(num_datums=len(per_datum))
        for name in per_datum[0]:
            arrays = [np.ascontiguousarray(d[name], dtype=np.float32).reshape(-1) for d in per_datum]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


@dataclass
class SequenceOut:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


def sample_response(sequences: list[SequenceOut], prompt_logprobs: list[float | None] | None) -> bytes:
    """A SampleResponse protobuf (int32 tokens, float32 log-probs; a prompt's first log-prob, which has no
    context, travels as NaN and the SDK turns it back into None)."""
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [float("nan") if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
