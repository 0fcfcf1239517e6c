"""Fuzzing what is read from Redis: experience records and their stream entries, weights blobs and the weights hash,
registry entries and the JSON fields the fuzzer found nested too deeply. Each reader returns a value or raises its
documented error, never another exception."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
import redis
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz import arrays, bytes_like, dimensions, fuzz
from tests.support.raw_env import RUN
from tests.support.records import serialized_chunk
from tinker_atropos.models.weight_bytes import weights_from_bytes, weights_to_bytes
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.trajectory import (
    CRITIC,
    REQUIRED,
    RecordError,
    Trajectory,
    TrajectorySpec,
    decode_trajectory,
    encode_trajectory,
)
from tinker_atropos.protocol.v1 import experience_pb2, tensor_pb2
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
        rollout_incarnation="rollout",
        sequence=seed + 1,
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
        op = draw(
            st.sampled_from(
                ["shape", "unit dims", "dtype", "data", "array", "clear", "nan", "schema", "version"]
            )
        )
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


# -- weights blobs (models/weight_bytes.py) and the weights hash (state/weights.py) -------------------------------
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
@given(
    state=st.dictionaries(st.text(max_size=3) | st.integers(0, 3), state_values, max_size=3)
    | st.lists(state_values, max_size=2)
)
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
ODD_FIELD_VALUES = [
    b"nan",
    b"inf",
    b"-1",
    b"1e999",
    b"1_000",
    b" 7 ",
    b"0x10",
    "\u0663".encode(),
    b"",
    b"\xff\xfe",
    b"[]",
    b"null",
    b"1" * 5000,
    b'{"a": [1, {"b": null}]}',
]


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
            entry[name] = data.draw(
                st.sampled_from(ODD_FIELD_VALUES)
                | bytes_like(entry.get(name, b"1"))
                | json_values.map(lambda v: json.dumps(v).encode())
            )
    try:
        record = registry._parse_entry(entry)
    except (KeyError, ValueError, TypeError):
        return
    assert isinstance(record, registry.ServiceRecord) and isinstance(record.figures, dict)


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
