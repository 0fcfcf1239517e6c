"""Fuzzing: every decoder of bytes that come from the network or Redis, fed arbitrary bytes and mutations of valid
encodings, returns a value or raises its documented error, never another exception (an IndexError, a
RecursionError, a huge allocation); and running services fed garbage on every port survive and go on serving
well-behaved clients.

The property tests are derandomized and write no example database, so every run tries the same inputs; each
target is bounded to a few seconds on a slow machine.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import os
import random
import socket
import string
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import grpc
import numpy as np
import pytest
import redis
import torch
import yaml
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.extra import numpy as hnp

from tests.conftest import REPO, Processes, wait_for
from tests.support.records import serialized_chunk
from tests.support.running import config_file
from tests.test_env_hostile import RUN, RawStream, start_env
from tinker_atropos.algorithms import core
from tinker_atropos.config import Config, ConfigError, load_config, parse_config
from tinker_atropos.environment.client import EnvClient, EnvDescription
from tinker_atropos.environment.envs import check_env
from tinker_atropos.environment.local_server import SessionAborted
from tinker_atropos.environment.service import EnvironmentServicer
from tinker_atropos.models.weights import weights_from_bytes, weights_to_bytes
from tinker_atropos.protocol import local_stream, tensors
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.trajectory import (
    CRITIC,
    REQUIRED,
    RecordError,
    Trajectory,
    TrajectorySpec,
    decode_trajectory,
    encode_trajectory,
)
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import experience_pb2, services_pb2, services_pb2_grpc, tensor_pb2
from tinker_atropos.runtime import check_health
from tinker_atropos.security import derive_key, signature
from tinker_atropos.state import experience, keys, registry
from tinker_atropos.state.weights import (
    PublishedWeights,
    WeightsRecordError,
    fetch_weights,
    publish_weights,
    published_version,
    verified_version,
)

# Hypothesis caches the constants of the source it reads under ./.hypothesis even without an example database,
# from the moment tests are collected: keep it out of the repository.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "tinker-atropos-hypothesis")


def fuzz(examples: int) -> settings:
    """Bounded and reproducible: the same inputs every run, and no .hypothesis folder in the repository."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


# -- mutations of valid encodings: pure random bytes rarely get past the first check ---------------------------
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with one to four edits: a bit flipped, a byte set, bytes inserted, deleted or repeated, a huge
    varint spliced in (a length or a shape field gone wild), or the tail cut off."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "repeat", "varint", "truncate"]))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
        elif op == "varint":  # a length, count or shape entry of up to 2**64 - 1
            data[at : at + draw(st.integers(0, 2))] = draw(st.sampled_from([b"\xff" * 9 + b"\x01", b"\x80" * 10,
                                                                           b"\xff\xff\xff\xff\x0f"]))  # fmt: skip
        else:
            del data[at:]
    return bytes(data)


def bytes_like(*valid: bytes) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, the valid encodings themselves, and mutations of them."""
    return st.binary(max_size=256) | st.sampled_from(valid) | st.sampled_from(valid).flatmap(mutated)


# -- tensors (protocol/tensors.py): every array on the wire -----------------------------------------------------
DTYPES = ["<f4", "<f8", "<f2", "i1", "<i2", "<i4", "<i8", "u1", "?"]
arrays = hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
dimensions = st.integers(0, 4) | st.sampled_from([-1, 2**31, 2**62, 2**63 - 1, -(2**63)])


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
        made[env_id] = EnvironmentServicer(section, check_env(section))
    return made


def step_result(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    done = rng.random(n) < 0.5
    batch = StepBatch(rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal(n).astype(np.float32),
                      done, np.zeros(n, bool), np.zeros((int(done.sum()), 3), np.float32),
                      np.flatnonzero(done).astype(np.int32))  # fmt: skip
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
    request = pb.SessionRequest(open=pb.OpenSession(num_instances=draw(st.sampled_from([0, 1, 2, 3, 2**32 - 1])),
                                                    seed=draw(st.integers(0, 2**64 - 1))))  # fmt: skip
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
def frames(*messages) -> bytes:
    out = b""
    for message in messages:
        data = message.SerializeToString()
        out += local_stream.HEADER.pack(len(data)) + data
    return out


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


# -- experience records (protocol/trajectory.py) and their stream entries (state/experience.py) ------------
PENDULUM = TrajectorySpec(obs_shape=(3,), action_shape=(1,), discrete=None)
CARTPOLE = TrajectorySpec(obs_shape=(4,), action_shape=(), discrete=(0, 1))


def cartpole_record(steps: int, instances: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t_n = (steps, instances)
    trajectory = Trajectory(
        policy_version=1,
        observations=rng.standard_normal((*t_n, 4)).astype(np.float32),
        actions=rng.integers(0, 2, t_n),
        log_probs=np.full(t_n, -0.7, np.float32),
        rewards=np.ones(t_n, np.float32),
        terminated=rng.random(t_n) < 0.2,
        truncated=np.zeros(t_n, bool),
        bootstrap_observations=rng.standard_normal((instances, 4)).astype(np.float32),
        truncated_observations=np.zeros((0, 4), np.float32),
        values=np.zeros(t_n, np.float32),
        truncation_values=np.zeros(t_n, np.float32),
        bootstrap_values=np.zeros(instances, np.float32),
    )
    return encode_trajectory(trajectory)


RECORDS = [(PENDULUM, serialized_chunk(2, seed, length=2)) for seed in range(2)]
RECORDS += [(CARTPOLE, cartpole_record(2, 2, 0)), (CARTPOLE, cartpole_record(1, 3, 1))]


def check_record(data: bytes, spec: TrajectorySpec) -> None:
    """The property: a Trajectory that fits the spec, or a RecordError with one of the counted reasons."""
    try:
        trajectory = decode_trajectory(data, spec)
    except RecordError as error:
        assert error.reason in RecordError.REASONS
        return
    t_n = trajectory.rewards.shape
    assert len(t_n) == 2 and 0 not in t_n
    assert trajectory.observations.shape == (*t_n, *spec.obs_shape)
    assert trajectory.actions.shape == (*t_n, *spec.action_shape)
    assert trajectory.bootstrap_observations.shape == (t_n[1], *spec.obs_shape)
    for name in (*REQUIRED, *CRITIC):
        array = getattr(trajectory, name)
        assert array is None or array.dtype.kind != "f" or np.isfinite(array).all(), name


@fuzz(300)
@given(record=st.sampled_from(RECORDS).flatmap(lambda r: st.tuples(st.just(r[0]), bytes_like(r[1]))))
def test_a_stream_entry_of_any_bytes_decodes_to_a_fitting_trajectory_or_a_record_error(record) -> None:
    """Anything in the experience stream is untrusted: what the trainer cannot learn from is a RecordError."""
    spec, data = record
    check_record(data, spec)


@st.composite
def reshaped_records(draw: st.DrawFn) -> tuple[TrajectorySpec, bytes]:
    """A valid record with its fields edited: tensor shapes, dtypes and bytes, missing tensors, versions."""
    spec, valid = draw(st.sampled_from(RECORDS))
    record = experience_pb2.ExperienceRecord.FromString(valid)
    chunk = record.trajectory_chunk
    for _ in range(draw(st.integers(1, 3))):
        tensor = getattr(chunk, name := draw(st.sampled_from((*REQUIRED, *CRITIC))))
        op = draw(st.sampled_from(["shape", "unit dims", "dtype", "data", "array", "clear", "nan", "schema",
                                   "version"]))  # fmt: skip
        if op == "shape":
            tensor.shape[:] = draw(st.lists(dimensions, max_size=5))
        elif op == "unit dims":  # the byte count still matches: only the shape checks can refuse it
            tensor.shape.extend([1] * draw(st.sampled_from([1, 2, 62, 63, 64, 70])))
        elif op == "dtype":
            tensor.dtype = draw(st.integers(-1, 12))
        elif op == "data":
            tensor.data = draw(st.binary(max_size=64))
        elif op == "array":
            tensor.CopyFrom(tensors.encode(draw(arrays)))
        elif op == "clear":
            chunk.ClearField(name)
        elif op == "nan" and tensor.dtype == tensor_pb2.DTYPE_FLOAT32 and tensor.data:
            tensor.data = np.float32(np.nan).tobytes() + tensor.data[4:]
        elif op == "schema":
            record.schema_version = draw(st.integers(0, 2**32 - 1))
        elif op == "version":
            chunk.policy_version = draw(st.integers(0, 2**64 - 1))
    return spec, record.SerializeToString()


@fuzz(400)
@given(record=reshaped_records())
def test_a_record_with_edited_fields_decodes_to_a_fitting_trajectory_or_a_record_error(record) -> None:
    """Edits that parse as Protobuf, so that every check after parsing (schema, fields, tensors, shapes,
    dtypes, action range, finiteness) is reached."""
    check_record(record[1], record[0])


ENTRY_KEY = derive_key("fuzz-token", "experience")


@fuzz(200)
@given(data=st.data(), signed=st.booleans())
def test_a_stream_entry_is_its_record_or_a_record_error(data, signed: bool) -> None:
    """The fields of a stream entry, as XREAD returns them: the record, or the RecordError to count it under."""
    record = RECORDS[0][1]
    fields = {experience.RECORD_FIELD: record, experience.SIGNATURE_FIELD: signature(ENTRY_KEY, record)}
    for _ in range(data.draw(st.integers(0, 3))):
        name = data.draw(
            st.sampled_from([experience.RECORD_FIELD, experience.SIGNATURE_FIELD, b"chunk", b"x"])
        )
        if data.draw(st.booleans()):
            fields.pop(name, None)
        else:
            fields[name] = data.draw(bytes_like(fields.get(name, b"")))
    result = experience._record(fields, ENTRY_KEY if signed else None)
    if isinstance(result, RecordError):
        assert result.reason in RecordError.REASONS
    else:
        assert result == fields[experience.RECORD_FIELD]


# -- weights blobs (models/weights.py) and the weights hash (state/weights.py) -------------------------------
def blob_of(state: dict) -> bytes:
    """A state dict in torch's own format: what versions before the npz published, still read."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def npz_of(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # the object array pickled: never unpickled by the reader
    return buffer.getvalue()


with torch.random.fork_rng():  # the same blobs every run, and the other tests' torch RNG left alone
    torch.manual_seed(0)
    BLOBS = [
        weights_to_bytes(torch.nn.Linear(3, 2)),
        blob_of({"count": torch.tensor(3), "mask": torch.ones(2, dtype=torch.bool)}),
        npz_of({"name": np.array(["ab"]), "boxed": np.array([1, None], dtype=object), "x": np.zeros(2)}),
    ]


def check_weights(blob: bytes) -> None:
    """The property: a state dict of finite numeric numpy arrays, or ValueError (what the loaders catch)."""
    try:
        state = weights_from_bytes(blob)
    except ValueError:
        return
    for array in state.values():
        assert isinstance(array, np.ndarray) and array.dtype.kind in "biufc"
        assert array.dtype.kind not in "fc" or np.isfinite(array).all()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, for a mutated protocol byte
@fuzz(200)
@given(blob=bytes_like(*BLOBS))
def test_a_weights_blob_of_any_bytes_loads_as_finite_tensors_or_is_a_value_error(blob: bytes) -> None:
    """numpy's and torch.load's own errors of every kind (zip, npy header, pickle, storage) come out as
    ValueError."""
    check_weights(blob)


ODD_TENSORS = [
    lambda: torch.zeros(2, dtype=torch.float8_e4m3fn),
    lambda: torch.zeros(2, dtype=torch.complex64),
    lambda: torch.zeros(2, dtype=torch.bfloat16),
    lambda: torch.zeros(2, dtype=torch.uint16),
    lambda: torch.zeros(3).to_sparse(),
    lambda: torch.zeros(2, device="meta"),
    lambda: torch.full((2,), float("nan")),
    lambda: torch.tensor([1.0, float("inf")], dtype=torch.float64),
    lambda: torch.zeros(0, 3),
]
state_values = st.sampled_from(ODD_TENSORS).map(lambda make: make()) | st.sampled_from(
    [1, "x", [torch.ones(1)], None]
)


@fuzz(100)
@given(state=st.dictionaries(st.text(max_size=3) | st.integers(0, 3), state_values, max_size=3)
       | st.lists(state_values, max_size=2))  # fmt: skip
def test_a_saved_object_of_odd_tensors_loads_as_finite_tensors_or_is_a_value_error(state) -> None:
    """Found by the fuzzer: float8, sparse and meta tensors, which torch.load makes, raised NotImplementedError
    or RuntimeError from the finite check; the trainer catches only ValueError."""
    check_weights(blob_of(state))


class WeightsHash:
    """What the weights readers ask of Redis: fields of one hash (HGET, HMGET), as Redis returns them."""

    def __init__(self, fields: dict[str, bytes]) -> None:
        self.fields = fields

    def hget(self, key: str, name: str) -> bytes | None:
        return self.fields.get(name)

    def hmget(self, key: str, names: list[str]) -> list[bytes | None]:
        return [self.fields.get(name) for name in names]


def weights_fields(version: bytes, blob: bytes, spec: bytes, key: bytes | None) -> dict[str, bytes]:
    digest = hashlib.sha256(blob).hexdigest().encode()
    fields = {"version": version, "blob": blob, "spec": spec, "digest": digest, "published_at": b"1.5"}
    if key is not None:
        fields["sig"] = signature(key, version, spec, digest)
    return fields


VERSIONS = [b"3", b"-1", b" 7 ", b"1_000", b"0x10", b"1e3", b"9" * 5000, "\u0663".encode(), b"\xff", b""]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def weights_records(draw: st.DrawFn, key: bytes | None) -> dict[str, bytes]:
    """A record as the trainer writes it, then edited by a careless writer (who may re-sign and re-digest
    what it wrote, holding the token) or by one without the token (whose record is no longer signed)."""
    version = draw(st.sampled_from(VERSIONS))
    spec = draw(
        st.just(b'{"obs_dim": 3, "hidden_sizes": [4]}') | json_values.map(lambda v: json.dumps(v).encode())
    )
    blob = draw(bytes_like(*BLOBS))
    fields = weights_fields(version, blob, spec, key if draw(st.booleans()) else None)
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["version", "blob", "spec", "digest", "sig"]))
        if draw(st.booleans()):
            fields.pop(name, None)
        else:
            fields[name] = draw(bytes_like(fields.get(name, b"")))
    return fields


def check_weights_hash(fields: dict[str, bytes]) -> None:
    """The property: every reader of the weights hash answers or raises WeightsRecordError."""
    client = WeightsHash(fields)
    for read in (published_version, verified_version):
        try:
            version = read(client, RUN)
        except WeightsRecordError:
            continue
        assert version is None or (isinstance(version, int) and version >= 0)
    try:
        published = fetch_weights(client, RUN)
    except WeightsRecordError:
        return
    if published is not None:
        assert isinstance(published, PublishedWeights) and isinstance(published.spec, dict)
        assert hashlib.sha256(published.blob).hexdigest().encode() == fields["digest"]


@fuzz(300)
@given(data=st.data())
def test_a_weights_hash_without_a_token_is_read_or_is_a_weights_record_error(data) -> None:
    """Version, spec and digest of the weights hash, as anyone with Redis access may have written them."""
    with mock.patch.dict(os.environ, clear=False):
        os.environ.pop("TA_TOKEN", None)
        os.environ.pop("TA_TOKEN_FILE", None)
        check_weights_hash(data.draw(weights_records(None)))


@fuzz(200)
@given(data=st.data())
def test_a_weights_hash_with_a_token_is_read_or_is_a_weights_record_error(data) -> None:
    """The same with the run's token, so that the signature check is reached (and passed by re-signed edits)."""
    with mock.patch.dict(os.environ, {"TA_TOKEN": "fuzz-token"}):
        os.environ.pop("TA_TOKEN_FILE", None)
        check_weights_hash(data.draw(weights_records(derive_key("fuzz-token", "weights"))))


# -- registry entries (state/registry.py) ------------------------------------------------------------------
VALID_ENTRY = {
    b"kind": b"env",
    b"name": b"env@127.0.0.1:5000",
    b"address": b"127.0.0.1:5000",
    b"incarnation": b"0123abcd",
    b"started_at": b"1700000000.5",
    b"heartbeat_at": b"1700000001.25",
    b"layout": b"1",
    b"starts": b"2",
    b"figures": json.dumps({"steps": 10, "sessions": 1}).encode(),
}
ODD_FIELD_VALUES = [b"nan", b"inf", b"-1", b"1e999", b"1_000", b" 7 ", b"0x10", "\u0663".encode(), b"", b"\xff\xfe",
                    b"[]", b"null", b"1" * 5000, b'{"a": [1, {"b": null}]}']  # fmt: skip


@fuzz(300)
@given(data=st.data())
def test_a_registry_entry_is_a_service_record_or_an_error_live_services_skips(data) -> None:
    """Discovery reads entries anyone with Redis access can write; live_services skips an entry that raises
    KeyError, ValueError or TypeError, and anything else would take the reader down."""
    entry = dict(VALID_ENTRY)
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from([*VALID_ENTRY, b"\xff", b"other"]))
        if data.draw(st.booleans()):
            entry.pop(name, None)
        else:
            entry[name] = data.draw(st.sampled_from(ODD_FIELD_VALUES) | bytes_like(entry.get(name, b"1"))
                                    | json_values.map(lambda v: json.dumps(v).encode()))  # fmt: skip
    try:
        record = registry._parse_entry(entry)
    except (KeyError, ValueError, TypeError):
        return
    assert isinstance(record, registry.ServiceRecord) and isinstance(record.figures, dict)


# -- the config loader (config.py) ------------------------------------------------------------------------
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))
BASE_CONFIGS = [yaml.safe_load(path.read_text()) for path in CONFIG_FILES]
SECTIONS = {name: field.annotation for name, field in Config.model_fields.items()}
SECTIONS |= {f"trainer.{name}": field.annotation for name, field in SECTIONS["trainer"].model_fields.items()
             if isinstance(field.annotation, type) and field.annotation.__module__ == Config.__module__}  # fmt: skip
SECTIONS["trainer.ppo"] = core.algorithm("ppo").hyperparameters
# No ':' (a 'module:name' algorithm is imported while validating), '@' or brackets (a URL that masks differently)
plain_text = st.text(st.characters(blacklist_characters=":@[]", blacklist_categories=("Cs",)), max_size=12)
config_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | plain_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain_text, inner, max_size=3),
    max_leaves=6,
)
special_values = st.sampled_from([0, -1, 1, 2**63, 1e308, float("nan"), float("inf"), "", "cpu", "cuda:0", "auto",
                                  "ppo", "grpc", "drop", "mujoco", "CartPole-v1", [], {}, True, "hyperparameters"])  # fmt: skip


@st.composite
def config_dicts(draw: st.DrawFn) -> dict:
    """A shipped config with a field or two set to odd values, a section replaced or removed, or a field added
    that is no field of it (one or two edits, so that many still validate and are printed back)."""
    data = copy.deepcopy(draw(st.sampled_from(BASE_CONFIGS)))
    for _ in range(draw(st.integers(1, 2))):
        section = draw(st.sampled_from(sorted(SECTIONS)))
        *parents, last = section.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        op = draw(st.sampled_from(["field", "field", "section", "delete", "unknown", "unknown"]))
        if op == "section":
            node[last] = draw(config_values)
            continue
        if op == "delete":
            node.pop(last, None)
            continue
        if not isinstance(node.get(last), dict):
            node[last] = {}
        if op == "field":
            name = draw(st.sampled_from(sorted(SECTIONS[section].model_fields)))
        else:  # what a confused writer adds: a field of another section, a renamed or internal one, anything
            name = draw(
                st.sampled_from(["hyperparameters", "chunks_per_update", "ppo", "id", "url"]) | plain_text
            )
        node[last][name] = draw(special_values | config_values)
    return data


def check_config(data: dict) -> None:
    """The property: a ConfigError, or a Config that prints (`up` writes it to the run folder, and every service
    re-reads that file) and validates again, the same."""
    try:
        config = parse_config(data)
    except ConfigError:
        return
    assert parse_config(yaml.safe_load(config.to_yaml())) == config


@fuzz(250)
@given(data=config_dicts())
def test_a_config_of_any_values_validates_or_is_a_config_error_and_round_trips(data: dict) -> None:
    """Every section and field of the shipped configs, edited."""
    check_config(data)


TRAINER_NAMES = [*SECTIONS["trainer"].model_fields, "ppo", "chunks_per_update", "hyperparameters"]


@fuzz(150)
@given(
    trainer=st.dictionaries(
        st.sampled_from(TRAINER_NAMES) | plain_text, special_values | config_values, max_size=4
    )
)
def test_a_trainer_section_of_any_fields_validates_or_is_a_config_error_and_round_trips(
    trainer: dict,
) -> None:
    """The trainer section has the one hand-written validator (the algorithm's own section, renamed and internal
    fields): any mix of its fields and others."""
    check_config({"trainer": trainer})


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("configs")


YAML_CHARS = ":[]{}-&*!|>'\"#%@`,? \n\t" + string.ascii_letters[:6] + string.digits


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A shipped config file with characters replaced, inserted or deleted (YAML syntax among them)."""
    text = list(draw(st.sampled_from(CONFIG_FILES)).read_text())
    for _ in range(draw(st.integers(1, 6))):
        if not text:
            break
        at = draw(st.integers(0, len(text) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        if op == "replace":
            text[at] = draw(st.sampled_from(YAML_CHARS))
        elif op == "insert":
            text[at:at] = draw(st.text(st.sampled_from(YAML_CHARS), min_size=1, max_size=4))
        elif op == "delete":
            del text[at : at + draw(st.integers(1, 6))]
        else:
            del text[at:]
    return "".join(text) or draw(
        st.sampled_from(["", "[", "- 1", "{{", "\t", "!!python/object:os.system {}"])
    )


@fuzz(250)
@given(text=config_texts())
def test_a_config_file_of_any_text_loads_or_is_a_config_error(config_dir: Path, text: str) -> None:
    """What the loader promises on the command line: a Config, or a ConfigError that names the problem."""
    path = config_dir / "run.yaml"
    path.write_text(text)
    try:
        config = load_config(path)
    except ConfigError as error:
        assert str(error).startswith(("invalid config", "config", "cannot read config"))
        return
    assert isinstance(yaml.safe_load(config.to_yaml()), dict)


def test_config_inputs_the_fuzzer_found_are_config_errors(config_dir: Path) -> None:
    """Found by the fuzzer: deep YAML nesting raised RecursionError; a `hyperparameters` key in the trainer
    section validated into a config whose printing raised; an alias bomb made an error message of 10^7 items."""
    path = config_dir / "deep.yaml"
    path.write_text("run: " + "[" * 3000 + "]" * 3000)
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(path)
    for value in (None, {}, {"gamma": 0.5}):
        with pytest.raises(ConfigError, match="trainer.hyperparameters: unknown field"):
            parse_config({"trainer": {"hyperparameters": value}})
    bomb = ["x"] * 10
    for _ in range(7):
        bomb = [bomb] * 10  # 10^8 leaves, all the same list: cheap to hold, not to print
    with pytest.raises(
        ConfigError, match=r"run.name: Input should be a valid string \(got \[\[\["
    ) as refused:
        parse_config({"run": {"name": bomb}})
    assert len(str(refused.value)) < 500  # shown bounded, not all 10^8 leaves


# -- what the fuzzer found in the readers of JSON fields and Redis URLs ------------------------------------
@pytest.fixture
def valkey_client(valkey) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(valkey.url)
    yield client
    client.close()


def test_a_registry_entry_with_deeply_nested_figures_is_skipped(valkey_client: redis.Redis) -> None:
    """A registry entry anyone with Redis access can write must not take discovery down."""
    name = keys.service("fuzz-registry", "env", "deep")
    valkey_client.hset(
        name, mapping={**{k.decode(): v for k, v in VALID_ENTRY.items()}, "figures": "[" * 100_000}
    )
    try:
        assert registry.live_services(valkey_client, "fuzz-registry") == []
    finally:
        valkey_client.delete(name)


def test_a_weights_spec_nested_too_deeply_is_a_weights_record_error(valkey_client: redis.Redis) -> None:
    """A weights record without a token is anyone's to write: its spec is checked like the rest."""
    with mock.patch.dict(os.environ, clear=False):
        os.environ.pop("TA_TOKEN", None)
        os.environ.pop("TA_TOKEN_FILE", None)
        publish_weights(valkey_client, "fuzz-weights", 1, BLOBS[0], {"obs_dim": 3})
        valkey_client.hset(keys.weights("fuzz-weights"), "spec", "[" * 100_000)
        try:
            with pytest.raises(WeightsRecordError):
                fetch_weights(valkey_client, "fuzz-weights")
        finally:
            valkey_client.delete(keys.weights("fuzz-weights"))


def test_an_episode_entry_nested_too_deeply_is_left_out(valkey_client: redis.Redis) -> None:
    """The episodes list is written through Redis like the rest: an entry that is no episode is left out."""
    valkey_client.lpush(
        keys.episodes("fuzz-episodes"), "[" * 100_000, json.dumps({"return": 1.0, "length": 2})
    )
    try:
        assert experience.recent_episodes(valkey_client, "fuzz-episodes", 5) == [{"return": 1.0, "length": 2}]
    finally:
        valkey_client.delete(keys.episodes("fuzz-episodes"))


def test_a_redis_url_the_config_accepts_can_be_printed() -> None:
    """A config that validates is printed by `up` and written to the run folder."""
    for url in ("redis://user:secret@host:port/0", "redis://user:secret@[::1"):
        try:
            config = parse_config({"redis": {"url": url}})
        except ConfigError:  # refused where it is validated: as good a fix
            continue
        assert "secret" not in config.to_yaml()


# -- running services fed garbage on every port --------------------------------------------------------------
@dataclass
class Running:
    env: registry.ServiceRecord
    trainer: registry.ServiceRecord
    processes: Processes
    client: redis.Redis


@pytest.fixture(scope="module")
def running(valkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A real env service and a real trainer as processes on free ports of 127.0.0.1, for the whole module."""
    directory = tmp_path_factory.mktemp("fuzz-services")
    processes = Processes(directory)
    client = redis.Redis.from_url(valkey.url)
    try:
        config = config_file(directory, run={"name": RUN}, env={"instances": 4})  # what start_env writes too
        processes.start("trainer", "--config", str(config), "--redis-url", valkey.url, "--port", "0",
                        "--run-dir", str(directory / "run"), name="trainer")  # fmt: skip
        env = start_env(directory, processes, valkey.url, client)
        trainer = wait_for(
            lambda: next(iter(registry.live_services(client, RUN, "trainer")), None), 60, "the trainer"
        )
        yield Running(env, trainer, processes, client)
    finally:
        processes.stop_all()
        client.close()


def status_of(address: str) -> services_pb2.ServiceStatus:
    with grpc.insecure_channel(address) as channel:
        return services_pb2_grpc.StatusStub(channel).GetStatus(services_pb2.StatusRequest(), timeout=5)


def assert_still_serving(running: Running) -> None:
    """Both processes alive, health SERVING, GetStatus answered, and an env client opens a session and steps over
    the local socket and over gRPC, getting every instance back."""
    for process in running.processes.started:
        assert process.poll() is None, running.processes.log("env") + running.processes.log("trainer")
    for name in ("env", "trainer"):  # grpcio logs one traceback per request it cannot parse; no other
        log = running.processes.log(name)
        assert log.count("Traceback") == log.count("ERROR grpc._common: Exception deserializing message!"), (
            log
        )
    for service, kind in ((running.env, "environment"), (running.trainer, "trainer")):
        assert check_health(service.address, timeout_s=5), service
        assert status_of(service.address).WhichOneof("kind") == kind
    for transport, carrier in (("auto", "local"), ("grpc", "grpc")):
        with EnvClient(running.env.address, transport) as client:
            wait_for(lambda c=client: c.describe().free_instances == 4, 10, "every instance free")
            session = client.open(4, seed=1)
            assert session.carrier == carrier and session.observations.shape == (4, 3)
            assert session.step(np.zeros((4, 1), np.float32)).rewards.shape == (4,)
            session.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def http2_frame(rng: random.Random) -> bytes:
    """A frame header of any type, flags and stream, whose length may not match its payload."""
    payload = rng.randbytes(rng.choice([0, 1, 8, 64, 300]))
    length = len(payload) if rng.random() < 0.6 else rng.choice([0, 9, 2**14, 2**24 - 1])
    kind = rng.choice([0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9, rng.randrange(256)])
    stream = rng.choice([0, 1, 3, 2**31 - 1, rng.randrange(2**32)])
    return length.to_bytes(3, "big") + bytes([kind, rng.randrange(256)]) + stream.to_bytes(4, "big") + payload


def garbage_connection(port: int, rng: random.Random) -> socket.socket:
    """A connection that sent garbage: random bytes, or the HTTP/2 preface and garbage frames, maybe cut off
    in the middle of one. Returned open: the caller closes it, abruptly or not."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
    kind = rng.choice(["bytes", "frames", "frames", "cut"])
    if kind == "bytes":
        data = rng.randbytes(rng.randrange(1, 2000))
    else:
        data = PREFACE + b"".join(http2_frame(rng) for _ in range(rng.randrange(1, 6)))
        if kind == "cut":
            data = data[: rng.randrange(len(PREFACE), len(data) + 1)]
    with contextlib.suppress(OSError):  # the server already hung up on what it read: what it should do
        sock.sendall(data)
    return sock


def close(sock: socket.socket, rng: random.Random) -> None:
    if rng.random() < 0.5:  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


@pytest.mark.integration
def test_garbage_on_the_grpc_ports_leaves_both_services_serving(running: Running) -> None:
    """Raw TCP garbage and half-open connections on the env service's and the trainer's gRPC port: each connection
    harms only itself, also while 30 half-sent ones are held open."""
    rng = random.Random(7)
    for service in (running.env, running.trainer):
        port = int(service.address.rsplit(":", 1)[1])
        for _ in range(60):
            close(garbage_connection(port, rng), rng)
        held = [garbage_connection(port, rng) for _ in range(30)]
        assert check_health(service.address, timeout_s=5)
        for sock in held:
            close(sock, rng)
    assert_still_serving(running)


OK_OR_REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,  # grpcio's answer to a request its deserializer cannot parse
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,  # a health check of a service name that is not served
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a health watch, which streams until its deadline
}
UNARY_METHODS = [
    "/tinker_atropos.v1.Environment/Describe",
    "/tinker_atropos.v1.Status/GetStatus",
    "/grpc.health.v1.Health/Check",
    "/tinker_atropos.v1.Environment/Nothing",
    "/no.such.Service/Method",
]


def garbage_request(rng: random.Random) -> bytes:
    valid = rng.choice([pb.DescribeRequest(), services_pb2.StatusRequest(), health_pb2.HealthCheckRequest(service="x"),
                        pb.SessionRequest(open=pb.OpenSession(num_instances=1))]).SerializeToString()  # fmt: skip
    data = bytearray(valid + rng.randbytes(rng.randrange(0, 12)))
    for _ in range(rng.randrange(0, 4)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data) if rng.random() < 0.8 else rng.randbytes(rng.randrange(0, 64))


@pytest.mark.integration
def test_garbage_requests_to_every_method_are_answered_or_refused_with_a_status(running: Running) -> None:
    """Raw request bytes to each method of both services (and to methods they do not have), through identity
    serializers: an answer or a status that says the request was refused, never UNKNOWN or UNAVAILABLE."""
    rng = random.Random(11)
    for service in (running.env, running.trainer):
        with grpc.insecure_channel(service.address) as channel:
            for method in UNARY_METHODS:
                call = channel.unary_unary(method)
                for _ in range(15):
                    try:
                        assert isinstance(call(garbage_request(rng), timeout=5), bytes)
                    except grpc.RpcError as error:
                        assert error.code() in OK_OR_REFUSED, (method, error)
            watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
            for _ in range(5):
                with pytest.raises(grpc.RpcError) as ended:
                    list(watch(garbage_request(rng), timeout=0.3))
                assert ended.value.code() in OK_OR_REFUSED
    invalid = 0
    with grpc.insecure_channel(
        running.env.address
    ) as channel:  # the session stream: garbage after any first frame
        for _ in range(25):
            stream = RawStream(channel)
            first = pb.SessionRequest(open=pb.OpenSession(num_instances=rng.randrange(0, 6)))
            stream.send(first.SerializeToString() if rng.random() < 0.5 else garbage_request(rng))
            for _ in range(rng.randrange(0, 3)):
                stream.send(garbage_request(rng))
            stream.send(b"\xff\xff")  # never a SessionRequest: every stream ends, with a status
            wait_for(lambda s=stream: s.ended is not None, 10, "the stream to end")
            assert stream.ended.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
            invalid += stream.ended.code() == grpc.StatusCode.INVALID_ARGUMENT
            stream.close()
    assert invalid and status_of(running.env.address).environment.bad_requests >= invalid
    assert_still_serving(running)


def local_garbage(rng: random.Random) -> bytes:
    """Bytes for the local socket: random, a header claiming anything, a valid open then garbage, cut frames."""
    open_frame = frames(pb.SessionRequest(open=pb.OpenSession(num_instances=rng.randrange(0, 6))))
    kind = rng.choice(["bytes", "header", "open then bytes", "cut", "huge"])
    if kind == "bytes":
        return rng.randbytes(rng.randrange(1, 200))
    if kind == "header":
        return local_stream.HEADER.pack(rng.randrange(0, 64)) + rng.randbytes(rng.randrange(0, 64))
    if kind == "open then bytes":
        return open_frame + local_stream.HEADER.pack(8) + rng.randbytes(8)
    if kind == "cut":
        return open_frame[: rng.randrange(1, len(open_frame))]
    return local_stream.HEADER.pack(rng.choice([local_stream.MAX_FRAME_BYTES, 2**32 - 1])) + b"x"


def vm_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.integration
def test_garbage_on_the_local_socket_ends_only_its_connection(running: Running) -> None:
    """The env service's local fast path: each garbage connection gets a status frame or is closed, responses are
    real frames, and headers claiming 256 MiB commit no memory."""
    with EnvClient(running.env.address, "grpc") as client:
        address = client.describe().local_address
    rng = random.Random(13)
    statuses = set()
    for _ in range(40):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(local_stream.socket_name(address))
            sock.sendall(local_garbage(rng))
            sock.shutdown(socket.SHUT_WR)
            # responses, then a status or the end; past a status the socket may read as reset (the service
            # closed it with our garbage unread), so a status is the last thing read
            while (frame := local_stream.receive(sock, pb.LocalFrame)) is not None:
                if frame.WhichOneof("kind") == "status":
                    statuses.add(frame.status.code)
                    break
                assert frame.WhichOneof("kind") == "response"
    assert statuses and statuses <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, statuses
    env_pid = running.processes.started[1].pid  # started after the trainer
    before = vm_rss_mib(env_pid)
    held = []
    for _ in range(4):  # every stream the env admits, each waiting for a 256 MiB frame
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(local_stream.socket_name(address))
        sock.sendall(local_stream.HEADER.pack(local_stream.MAX_FRAME_BYTES) + b"x")
        held.append(sock)
    time.sleep(0.5)
    grown = vm_rss_mib(env_pid) - before
    for sock in held:
        sock.close()
    assert grown < 128, f"the env service grew by {grown:.0f} MiB for four frame headers"
    assert_still_serving(running)
