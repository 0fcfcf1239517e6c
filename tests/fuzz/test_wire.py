"""Fuzzing what crosses the wire: tensors, the env service's answers as its client decodes them, session requests as
the env service parses them, and the local fast path's frames. Every decoder, fed arbitrary bytes and mutations of
valid encodings, returns a value or raises its documented error, never another exception (an IndexError, a
RecursionError, a huge allocation); each target is bounded to a few seconds on a slow machine."""

from __future__ import annotations

import math
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz import arrays, bytes_like, dimensions, frames, fuzz, mutated
from tinker_atropos.config import parse_config
from tinker_atropos.environment.check import check_env
from tinker_atropos.environment.client import EnvDescription
from tinker_atropos.environment.local_server import SessionAborted
from tinker_atropos.environment.service import EnvironmentServicer
from tinker_atropos.protocol import local_stream, tensors
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import tensor_pb2

# -- tensors (protocol/tensors.py): every array on the wire -----------------------------------------------------


@st.composite
def tensor_messages(draw: st.DrawFn) -> tensor_pb2.Tensor:
    """Any dtype code, any shape (negative, huge, more dimensions than numpy has) and data that often has the
    byte count the shape asks for, so that the checks after that one are reached."""
    shape = draw(st.lists(dimensions, max_size=8) | st.lists(st.just(1), min_size=60, max_size=70))
    code = draw(st.integers(-2, 12))
    data = draw(st.binary(max_size=64))
    try:
        itemsize = tensors.numpy_dtype(code).itemsize
    except tensors.TensorError:
        itemsize = 0
    if draw(st.booleans()) and itemsize and all(d >= 0 for d in shape):
        size = math.prod(shape) * itemsize
        data = bytes(size) if size <= 4096 else data
    return tensor_pb2.Tensor(dtype=code, shape=shape, data=data)


@fuzz(400)
@given(message=tensor_messages())
def test_a_tensor_message_decodes_to_its_shape_or_is_a_tensor_error(message: tensor_pb2.Tensor) -> None:
    """Shapes and dtypes come from peers: the decoder's one error type is what every caller catches."""
    try:
        array = tensors.decode(message)
    except tensors.TensorError:
        return
    assert array.shape == tuple(message.shape)
    assert array.dtype == tensors.numpy_dtype(message.dtype)


def test_shapes_numpy_cannot_make_are_tensor_errors() -> None:
    """Found by the fuzzer: numpy's own ValueError for these escaped as another type (an env step or a chunk
    with such a tensor raised past the handlers)."""
    for shape in ([1] * 65, [0, 2**62, 2**62], [0, 2**63 - 1]):
        data = b"\0" * 4 if 0 not in shape else b""
        with pytest.raises(tensors.TensorError, match="tensor of shape"):
            tensors.decode(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=shape, data=data))


@fuzz(300)
@given(array=arrays, data=st.data())
def test_tensor_bytes_round_trip_and_their_mutations_are_tensor_or_decode_errors(array, data) -> None:
    """A Tensor as it arrives inside a message: the encoding round-trips, a mutation of it is refused cleanly."""
    encoded = tensors.encode(array).SerializeToString()
    np.testing.assert_array_equal(tensors.decode(tensor_pb2.Tensor.FromString(encoded)), array)
    try:
        decoded = tensors.decode(tensor_pb2.Tensor.FromString(data.draw(mutated(encoded))))
    except (DecodeError, tensors.TensorError):
        return
    assert isinstance(decoded, np.ndarray)


# -- what the env service sends back: Describe and step results, decoded by the env client ----------------------
@pytest.fixture(scope="module")
def servicers() -> dict[str, EnvironmentServicer]:
    """In-process env servicers (no gRPC server): the code that turns a session's raw bytes into requests."""
    made = {}
    for env_id in ("Pendulum-v1", "CartPole-v1"):
        section = parse_config({"env": {"id": env_id, "instances": 3}}).env
        made[env_id] = EnvironmentServicer(section, check_env(section), takeover_after_s=3.0)
    return made


def step_result(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    done = rng.random(n) < 0.5
    batch = StepBatch(
        rng.standard_normal((n, 3)).astype(np.float32),
        rng.standard_normal(n).astype(np.float32),
        done,
        np.zeros(n, bool),
        np.zeros((int(done.sum()), 3), np.float32),
        np.flatnonzero(done).astype(np.int32),
    )
    return batch.encode([pb.EpisodeEnd(length=3, episode_return=1.0)] * int(done.sum())).SerializeToString()


STEP_RESULTS = [step_result(n, seed) for n, seed in ((1, 0), (2, 1), (3, 2))]


@fuzz(300)
@given(data=bytes_like(*STEP_RESULTS))
def test_a_step_result_decodes_or_is_a_tensor_error(data: bytes) -> None:
    """EnvSession.step decodes whatever an env service answers; only TensorError may come out of it."""
    try:
        result = pb.StepResult.FromString(data)
    except DecodeError:
        return
    try:
        batch = StepBatch.decode(result)
    except tensors.TensorError:
        return
    assert all(isinstance(getattr(batch, name), np.ndarray) for name in ("observations", "rewards"))


@fuzz(300)
@given(data=st.data())
def test_a_describe_answer_gives_spaces_or_a_value_error(servicers, data) -> None:
    """The trainer and the rollouts build their spaces from an env service's Describe answer."""
    valid = [s.Describe(pb.DescribeRequest(), None).SerializeToString() for s in servicers.values()]
    raw = data.draw(bytes_like(*valid))
    try:
        info = pb.EnvironmentInfo.FromString(raw)
    except DecodeError:
        return
    try:
        description = EnvDescription.from_proto(info)
    except ValueError:  # space_from_proto's documented error (TensorError included)
        return
    assert description.observation_space is not None and description.action_space is not None


# -- session requests: the env service's parsing of raw bytes (service.py) -----------------------------------
class FuzzControl:
    """A StreamControl that ends the stream the way the local socket does: SessionAborted with the status."""

    peer = "fuzz"

    def abort(self, code: grpc.StatusCode, message: str):
        raise SessionAborted(code, message)

    def cancel(self) -> None:
        pass


def actions_for(servicer: EnvironmentServicer, n: int) -> np.ndarray:
    if servicer.env.id == "CartPole-v1":
        return np.zeros(n, np.int64)
    return np.zeros((n, 1), np.float32)


@st.composite
def open_frames(draw: st.DrawFn) -> bytes:
    request = pb.SessionRequest(
        open=pb.OpenSession(
            num_instances=draw(st.sampled_from([0, 1, 2, 3, 2**32 - 1])), seed=draw(st.integers(0, 2**64 - 1))
        )
    )
    valid = request.SerializeToString()
    kind = draw(st.sampled_from(["valid", "valid", "valid", "mutated", "bytes"]))
    return valid if kind == "valid" else draw(mutated(valid) if kind == "mutated" else st.binary(max_size=32))


@st.composite
def step_frames(draw: st.DrawFn, servicer: EnvironmentServicer, session: dict) -> bytes:
    """A step of the session (its real id, so the action checks are reached) with good, odd or garbage actions;
    or a step of another session, a second open, or bytes."""
    session_id = draw(st.sampled_from([session["id"]] * 4 + ["", "not-a-session"]))
    good = actions_for(servicer, session["n"])
    actions = draw(
        st.sampled_from(["good", "good", "unit dims", "unit dims", "array", "message", "nan", "out of range"])
    )
    if actions == "good":
        message = tensors.encode(good)
    elif actions == "unit dims":  # the right bytes in a shape of too many dimensions
        message = tensors.encode(good)
        message.shape.extend([1] * draw(st.sampled_from([1, 63, 70])))
    elif actions == "array":
        message = tensors.encode(draw(arrays))
    elif actions == "message":
        message = draw(tensor_messages())
    elif actions == "nan":
        message = tensors.encode(np.full_like(good, np.nan) if good.dtype.kind == "f" else good - 1)
    else:
        message = tensors.encode(good + 10**6)
    valid = pb.SessionRequest(step=pb.StepRequest(session_id=session_id, actions=message)).SerializeToString()
    kind = draw(st.sampled_from(["valid"] * 6 + ["mutated", "open", "bytes"]))
    if kind == "valid":
        return valid
    return draw({"mutated": mutated(valid), "open": open_frames(), "bytes": st.binary(max_size=16)}[kind])


@fuzz(400)
@given(env_id=st.sampled_from(["Pendulum-v1", "CartPole-v1"]), data=st.data())
def test_a_session_of_any_bytes_is_served_or_ended_with_a_status(servicers, env_id: str, data) -> None:
    """Whatever bytes a client sends on a session stream, the servicer steps or ends that stream with
    INVALID_ARGUMENT (or RESOURCE_EXHAUSTED), never another exception; and its instances are freed."""
    servicer = servicers[env_id]
    session = {"id": "", "n": 0}

    def raw() -> Iterator[bytes]:
        yield data.draw(open_frames())
        for _ in range(data.draw(st.integers(1, 5))):
            yield data.draw(step_frames(servicer, session))

    try:
        for response in servicer.serve_stream(raw(), FuzzControl()):
            if response.WhichOneof("kind") == "opened":
                session.update(id=response.opened.session_id, n=response.opened.num_instances)
            else:
                assert response.WhichOneof("kind") == "step" and session["id"]
    except SessionAborted as ended:
        assert ended.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), ended
    status = servicer.status()
    assert (status.free_instances, status.streams, status.sessions) == (3, 0, 0)


# -- the local fast path's frames (protocol/local_stream.py) -------------------------------------------------


VALID_FRAMES = [
    frames(pb.SessionRequest(open=pb.OpenSession(num_instances=2, seed=3))),
    frames(
        pb.SessionRequest(open=pb.OpenSession()),
        pb.SessionRequest(
            step=pb.StepRequest(session_id="s", actions=tensors.encode(np.zeros((2, 1), np.float32)))
        ),
    ),
    frames(pb.SessionRequest()),
]


@fuzz(300)
@given(stream=bytes_like(*VALID_FRAMES))
def test_a_byte_stream_reads_as_frames_then_the_end_or_a_frame_error(stream: bytes) -> None:
    """The frame reader of both ends of the local socket: parsed frames, then None at a clean end, or FrameError
    for a cut, oversized or unparsable one; nothing else, and it never waits for bytes that will not come."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sender.sendall(stream)
        sender.shutdown(socket.SHUT_WR)
        receiver.settimeout(5)  # a reader waiting past the end would fail here with a timeout
        for _ in range(len(stream) // local_stream.HEADER.size + 2):  # a frame takes at least its header
            try:
                message = local_stream.receive(receiver, pb.SessionRequest)
            except local_stream.FrameError:
                return
            if message is None:
                return
            assert isinstance(message, pb.SessionRequest)
        pytest.fail("the reader read more frames than the bytes hold")


def test_a_frame_header_alone_commits_no_memory_for_the_size_it_claims() -> None:
    """Found by the fuzzer: a 4-byte header made the reader allocate (and zero) the whole claimed size, up to
    256 MiB per connection, before any of it arrived."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sender.sendall(local_stream.HEADER.pack(local_stream.MAX_FRAME_BYTES) + b"partial")
        sender.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(local_stream.FrameError, match="closed the stream within a frame"):
                local_stream.receive_payload(receiver)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2 * local_stream.FIRST_BUFFER_BYTES, peak


def test_a_frame_larger_than_the_first_buffer_arrives_whole() -> None:
    """The buffer grows as the bytes arrive: a big frame still comes out byte for byte."""
    payload = bytes(range(256)) * (local_stream.FIRST_BUFFER_BYTES // 256 * 2 + 1234)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        writer = threading.Thread(
            target=sender.sendall, args=(local_stream.HEADER.pack(len(payload)) + payload,)
        )
        writer.start()
        received = local_stream.receive_payload(receiver)
        writer.join()
    assert received == payload
