"""numpy <-> ``Tensor`` messages: dtype + shape + raw bytes, decoded without copying."""

from __future__ import annotations

import math

import numpy as np

from tinker_atropos.protocol.v1 import tensor_pb2

_TO_NUMPY: dict[int, np.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    tensor_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    tensor_pb2.DTYPE_INT8: np.dtype("i1"),
    tensor_pb2.DTYPE_INT16: np.dtype("<i2"),
    tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
    tensor_pb2.DTYPE_UINT8: np.dtype("u1"),
    tensor_pb2.DTYPE_BOOL: np.dtype("?"),
}
_FROM_NUMPY: dict[np.dtype, int] = {dt.newbyteorder("="): code for code, dt in _TO_NUMPY.items()}


class TensorError(ValueError):
    """A tensor message that cannot be decoded: unknown dtype, or bytes that do not match the shape."""


def dtype_code(dtype: np.dtype | type) -> int:
    """Protobuf enum value for a numpy dtype."""
    if (code := _FROM_NUMPY.get(dtype)) is not None:  # an array's own dtype: no new dtype object per call
        return code
    try:
        return _FROM_NUMPY[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        allowed = ", ".join(sorted(str(d) for d in _FROM_NUMPY))
        raise TensorError(f"dtype {np.dtype(dtype)} cannot travel as a Tensor; allowed: {allowed}") from None


def numpy_dtype(code: int) -> np.dtype:
    try:
        return _TO_NUMPY[code]
    except KeyError:
        raise TensorError(f"unknown tensor dtype code {code}") from None


def encode(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encode a numpy array (any memory layout) as a Tensor message."""
    array = np.asarray(array)
    code = dtype_code(array.dtype)
    if array.dtype != _TO_NUMPY[code]:  # only a big-endian array (or a big-endian host)
        array = array.astype(_TO_NUMPY[code])
    # tobytes() writes C order whatever the layout: the one copy the message needs
    return tensor_pb2.Tensor(dtype=code, shape=array.shape, data=array.tobytes())


def _shown(shape: tuple[int, ...]) -> str:
    """A shape for an error message: a hostile one may have millions of dimensions."""
    return str(shape) if len(shape) <= 8 else f"{str(shape[:8])[:-1]}, … ({len(shape)} dimensions))"


def decode(tensor: tensor_pb2.Tensor) -> np.ndarray:
    """Decode a Tensor message into a read-only numpy view of its bytes (no copy); TensorError for one that
    does not make an array."""
    dtype = numpy_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"negative dimension in shape {_shown(shape)}")
    expected = math.prod(shape) * dtype.itemsize
    if len(tensor.data) != expected:
        raise TensorError(
            f"tensor of shape {_shown(shape)} and dtype {dtype} needs {expected} bytes, got "
            f"{len(tensor.data)}"
        )
    try:
        return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)
    except ValueError as error:  # more dimensions than numpy has, or an empty shape too big to index
        raise TensorError(f"tensor of shape {_shown(shape)}: {error}") from None
