import numpy as np
import pytest

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import tensor_pb2

DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4)])
def test_round_trip_keeps_values_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal(shape) * 100).astype(dtype)
    decoded = tensors.decode(tensor_pb2.Tensor.FromString(tensors.encode(array).SerializeToString()))
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)


def test_non_contiguous_and_big_endian_arrays_are_encoded_by_value() -> None:
    base = np.arange(24, dtype=">f8").reshape(4, 6)
    view = base[:, ::2]
    decoded = tensors.decode(tensors.encode(view))
    np.testing.assert_array_equal(decoded, view)
    assert decoded.dtype == np.dtype("<f8")


def test_byte_count_mismatch_is_an_error() -> None:
    message = tensors.encode(np.zeros((2, 3), np.float32))
    message.shape[:] = [2, 4]
    with pytest.raises(tensors.TensorError, match="needs 32 bytes, got 24"):
        tensors.decode(message)


def test_unknown_dtype_code_and_unsupported_dtype_are_errors() -> None:
    with pytest.raises(tensors.TensorError, match="unknown tensor dtype"):
        tensors.decode(tensor_pb2.Tensor(dtype=99, shape=[1], data=b"\0"))
    with pytest.raises(tensors.TensorError, match="cannot travel"):
        tensors.encode(np.zeros(2, dtype=np.complex64))
