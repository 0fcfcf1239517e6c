"""The Tinker wire format, read and written with the SDK's own generated Protobuf module, so that the two sides
cannot drift: ``forward_backward`` bodies in, ``ForwardBackwardOutput`` and ``SampleResponse`` out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request the SDK would not have sent: a user error, answered as such."""


@dataclass
class Datum:
    """One ``types.Datum``: its tokens and its ``loss_fn_inputs`` as dense arrays."""

    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(name: str, msg: pb.Tensor) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise WireError(f"loss_fn_inputs[{name!r}]: inconsistent sparse CSR indices")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    array = np.frombuffer(msg.dense, dtype=dtype)
    if shape:
        if int(np.prod(shape)) != array.size:
            raise WireError(f"loss_fn_inputs[{name!r}]: {array.size} values for shape {shape}")
        array = array.reshape(shape)
    return array.astype(np.int64 if dtype != np.float32 else np.float32, copy=True)


def _tokens(datum: pb.Datum, index: int) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(
                f"datum {index}: only token chunks are served here, not {chunk.WhichOneof('chunk')}"
            )
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def parse_forward_backward(body: bytes) -> ForwardBackward:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError, or worse for garbage
        raise WireError(f"the body is not a ForwardBackwardRequest: {error}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = [
        Datum(_tokens(d, i), {name: _tensor(name, t) for name, t in d.loss_fn_inputs.items()})
        for i, d in enumerate(msg.data)
    ]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def forward_backward_output(outputs: Sequence[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum output tensors as one ArrayRecord of batched fields (leading dims may differ per datum)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(out[name]) for out in outputs]
        dtype = np.float32 if arrays[0].dtype.kind == "f" else np.int64
        arrays = [a.astype(dtype, copy=False) for a in arrays]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.tobytes(),
                dtype=pb.DTYPE_FLOAT32 if dtype is np.float32 else pb.DTYPE_INT64,
                trailing_shape=list(arrays[0].shape[1:]),
            )
        )
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


class Sampled(Protocol):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def sample_response(sequences: Sequence[Sampled], prompt_logprobs: list[float | None] | None) -> bytes:
    out = pb.SampleResponse()
    for seq in sequences:
        out.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
