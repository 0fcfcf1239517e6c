"""The Tinker wire format, read and written with the SDK's own generated Protobuf module, so that the two sides
cannot drift: ``forward_backward`` bodies in, ``ForwardBackwardOutput`` and ``SampleResponse`` out."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from tinker_atropos.sampling.params import Topk
from tinker_atropos.training.data import ClientError, Datum

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ClientError):
    """A request the SDK would not have sent: a user error, answered as such."""


@dataclass(frozen=True)
class Span:
    """One run of a datum's provenance: ``length`` positions that are positions ``offset...`` of the named
    sequence's sampled tokens (``sampled``) or of the prompt it was sampled from."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]
    provenance: list[list[Span] | None]  # per datum, the runs tiling its targets; None where it has none


class Budget:
    """The bytes a request's arrays may take once densified, counted down before each is allocated: a sparse
    tensor of a huge shape is refused while it is still a few bytes, and so is a shape whose product overflows."""

    def __init__(self, limit: int, setting: str) -> None:
        self.limit, self.left, self.setting = limit, limit, setting

    def take(self, what: str, nbytes: int) -> None:
        if nbytes > self.left:
            wanted = _mib(self.limit - self.left + nbytes)
            raise WireError(
                f"{what}: densified, the request's arrays would take {wanted}; a request's may take at most "
                f"{_mib(self.limit)} ({self.setting})"
            )
        self.left -= nbytes


def request_budget(max_request_bytes: int) -> Budget:
    """What a request's arrays may take once densified: as much as its body may (``trainer.tinker.max_request_mb``;
    a sparse tensor is only a compression of what a dense one would have sent)."""
    return Budget(max_request_bytes, "trainer.tinker.max_request_mb")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _frombuffer(what: str, data: bytes, dtype: type) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise WireError(f"{what}: {len(data)} bytes is no whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=dtype)


def _tensor(name: str, msg: pb.Tensor, budget: Budget, densify: bool) -> np.ndarray | None:
    """A loss_fn_inputs tensor checked, its densified size taken from ``budget`` before anything of that size is
    allocated; as a dense int64 or float32 array when ``densify`` (else None: checked only)."""
    what = f"loss_fn_inputs[{name!r}]"
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        named = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype
        raise WireError(f"{what}: unsupported dtype {named} (float32, int64 or int32)")
    shape = list(msg.shape)
    if any(n < 0 for n in shape):
        raise WireError(f"{what}: negative dimension in shape {shape}")
    out_dtype = np.float32 if dtype is np.float32 else np.int64
    budget.take(what, math.prod(shape) * np.dtype(out_dtype).itemsize)  # Python ints: no overflow
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise WireError(f"{what}: a sparse tensor needs a 2-D shape, got {shape}")
        values = _frombuffer(f"{what} values", csr.values, dtype)
        crow = _frombuffer(f"{what} crow_indices", csr.crow_indices, np.int64)
        col = _frombuffer(f"{what} col_indices", csr.col_indices, np.int64)
        if (
            len(crow) != shape[0] + 1
            or len(col) != len(values)
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
            or (len(col) and (col.min() < 0 or col.max() >= shape[1]))
        ):
            raise WireError(f"{what}: inconsistent sparse CSR indices")
        if not densify:
            return None
        dense = np.zeros(shape, dtype=out_dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
        return dense
    array = _frombuffer(what, msg.dense, dtype)
    if shape:
        if math.prod(shape) != array.size:
            raise WireError(f"{what}: {array.size} values for shape {shape}")
        array = array.reshape(shape)
    return array.astype(out_dtype, copy=True) if densify else None


def _tokens(datum: pb.Datum, index: int, budget: Budget) -> tuple[list[np.ndarray], int]:
    """The datum's model_input chunks (int32 views of the body) and their length, its size as int64 taken from
    ``budget``."""
    parts = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(
                f"datum {index}: only token chunks are served here, not {chunk.WhichOneof('chunk')}"
            )
        parts.append(_frombuffer(f"datum {index}: model_input", chunk.encoded_text.tokens, np.int32))
    length = sum(len(p) for p in parts)
    budget.take(f"datum {index}: model_input", 8 * length)
    return parts, length


def _provenance(datum: pb.Datum, index: int, length: int) -> list[Span] | None:
    """The runs tiling the datum's targets, checked to tile its model_input and targets as the SDK's
    ``Datum.with_provenance`` does; None for a datum without provenance."""
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None
    runs: dict[str, list[Span]] = {}
    for field in ("model_input_spans", "loss_fn_input_spans"):
        runs[field] = []
        for span in getattr(datum, field):
            kind = span.WhichOneof("span")
            if kind is None:
                raise WireError(f"datum {index}: {field} holds an empty span")
            run = getattr(span, kind)
            if not run.sequence_id or run.offset < 0 or run.length < 0:
                raise WireError(
                    f"datum {index}: {field}: a span needs a sequence_id, offset >= 0 and length >= 0"
                )
            runs[field].append(Span(kind == "sampled_tokens", run.sequence_id, run.offset, run.length))
        covered = sum(run.length for run in runs[field])
        if covered != length:
            raise WireError(
                f"datum {index}: {field} cover {covered} positions, the datum has {length}; the runs "
                "must tile it (Datum.with_provenance)"
            )
    return runs["loss_fn_input_spans"]


# the repeated messages walked into by ``count_fields``, by where they are: the request's data, a datum's
# loss_fn_inputs entries, such an entry's tensor (the other repeated fields are counted where they lie)
_WALKED = {(): 3, (3,): 2, (3, 2): 2}
FIELD_BYTES = 8  # body bytes per field a request may hold (beyond ``FREE_FIELDS``): an empty datum is 2 bytes
FREE_FIELDS = 16_384


def count_fields(body: bytes) -> None:
    """WireError when the body holds more Protobuf fields than ``len(body) / FIELD_BYTES + FREE_FIELDS``, counted
    without parsing it: parsing builds an object of ~70 bytes per field, and a 2-byte empty datum is one field
    (a 2 MiB body of them took 70 MB and 8 s). An SDK's datum spends tens of bytes per field."""
    left = len(body) // FIELD_BYTES + FREE_FIELDS

    def walk(at: int, end: int, path: tuple[int, ...]) -> None:
        nonlocal left
        while at < end:
            left -= 1
            if left < 0:
                raise WireError(
                    f"the body holds more than {len(body) // FIELD_BYTES + FREE_FIELDS} Protobuf fields, "
                    f"for {len(body)} bytes: not a request the SDK builds"
                )
            key, at = _varint(body, at)
            kind = key & 7
            if kind == 0:
                at = _varint(body, at)[1]
            elif kind == 2:
                length, at = _varint(body, at)
                if _WALKED.get(path) == key >> 3:
                    walk(at, min(at + length, end), (*path, key >> 3))
                at += length
            elif kind in (1, 5):
                at += 8 if kind == 1 else 4
            else:
                return  # not Protobuf: the parser says so

    with contextlib.suppress(IndexError):  # a body cut short: the parser says so
        walk(0, len(body), ())


def read_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The Protobuf message of a ``forward_backward`` body (its fields counted first); nothing is densified."""
    count_fields(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError, or worse for garbage
        raise WireError(f"the body is not a ForwardBackwardRequest: {error}") from None
    return msg


def _read(body: bytes, budget: Budget, densify: bool) -> tuple[ForwardBackward, int]:
    """The request checked whole, its arrays densified within ``budget`` when ``densify`` (else ``data`` is left
    empty), and the tokens it holds; WireError for anything the SDK would not send."""
    msg = read_forward_backward(body)
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"loss_fn_config[{key!r}] is {value}: a number must be finite")
    data, lengths = [], []
    for i, datum in enumerate(msg.data):
        parts, length = _tokens(datum, i, budget)
        inputs = {name: _tensor(name, t, budget, densify) for name, t in datum.loss_fn_inputs.items()}
        lengths.append(length)
        if densify:
            tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
            data.append(Datum(tokens, inputs))
    provenance = [_provenance(msg.data[i], i, length) for i, length in enumerate(lengths)]
    request = ForwardBackward(
        msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data, provenance
    )
    return request, sum(lengths)


def check_forward_backward(body: bytes, budget: Budget) -> tuple[str, int, int]:
    """The model, number and token count of a request checked whole as ``parse_forward_backward`` checks it, with
    nothing densified: what the API needs to queue it (the worker parses it)."""
    request, tokens = _read(body, budget, densify=False)
    return request.model_id, request.seq_id, tokens


def parse_forward_backward(body: bytes, budget: Budget) -> ForwardBackward:
    """The request with its arrays densified within ``budget``; WireError for anything the SDK would not send."""
    return _read(body, budget, densify=True)[0]


def prompt_tokens(request: dict) -> list[int]:
    """The tokens of a sample request's prompt (its JSON body, read)."""
    return [t for chunk in request["prompt"]["chunks"] for t in chunk.get("tokens", [])]


def read_sample_response(body: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sampled sequence's tokens (int32) and log-probs (float32) from a ``SampleResponse`` body."""
    out = pb.SampleResponse()
    out.ParseFromString(body)
    return [
        (np.frombuffer(s.tokens, dtype=np.int32), np.frombuffer(s.logprobs, dtype=np.float32))
        for s in out.sequences
    ]


def leading_fields(prefix: bytes) -> tuple[str | None, int | None]:
    """``model_id`` and ``seq_id`` of a ``forward_backward`` body from its first bytes only (the SDK writes fields
    1 and 2 first): what a request refused before it was read, for its size or its key, still tells."""
    model_id, seq_id, at = None, None, 0
    try:
        while at < len(prefix) and (model_id is None or seq_id is None):
            key, at = _varint(prefix, at)
            number, kind = key >> 3, key & 7
            if kind == 0:
                value, at = _varint(prefix, at)
                if number == 2:
                    seq_id = value if value < 2**31 else None
            elif kind == 2:
                length, at = _varint(prefix, at)
                if at + length > len(prefix):
                    break
                if number == 1:
                    model_id = prefix[at : at + length].decode()
                at += length
            else:
                break
    except (IndexError, UnicodeDecodeError):
        pass
    return model_id, seq_id


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80 or shift > 63:
            return value, at


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
    topk: Topk | None  # per token, when topk_sample_logprobs asked for them


def sample_response(
    sequences: Sequence[Sampled], prompt_logprobs: list[float | None] | None, topk_prompt: Topk | None = None
) -> bytes:
    out = pb.SampleResponse()
    for seq in sequences:
        sampled = pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if seq.topk is not None:
            sampled.topk_sampled_logprobs.CopyFrom(_topk(seq.topk))
        out.sequences.append(sampled)
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt))
    return out.SerializeToString()


def _topk(topk: Topk) -> pb.TopkLogprobs:
    """``Topk`` as the SDK's ``TopkLogprobs``: [positions, k] int32 ids and float32 log-probs, row-major, a
    position scored nowhere filled with the SDK's sentinel (id 0, ``MASK_LOGPROB``), which it reads as None."""
    ids = np.zeros((len(topk.rows), topk.k), dtype=np.int32)
    logprobs = np.full((len(topk.rows), topk.k), MASK_LOGPROB, dtype=np.float32)
    for position, row in enumerate(topk.rows):
        if row is not None:
            ids[position], logprobs[position] = row
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=topk.k, length=len(topk.rows)
    )
