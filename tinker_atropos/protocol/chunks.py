"""The experience record (an ``ExperienceRecord`` envelope around a ``TrajectoryChunk``) and its checked decoding
into numpy arrays, the trainer's side of ``rollout/chunks.py``.

Whatever is read from the stream is untrusted: a record that does not decode, carries another schema version,
lacks a tensor, does not fit the run's spaces or holds a NaN raises ``RecordError`` with the reason it is
counted under. None of them reaches the learner.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from google.protobuf.message import DecodeError

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import experience_pb2

SCHEMA_VERSION = 1

TENSOR_FIELDS = (
    "observations",
    "actions",
    "log_probs",
    "values",
    "rewards",
    "terminated",
    "truncated",
    "truncation_values",
    "bootstrap_observations",
    "bootstrap_values",
)
_TIME_MAJOR = (
    "observations",
    "actions",
    "log_probs",
    "values",
    "terminated",
    "truncated",
    "truncation_values",
)
_FLOAT32 = ("observations", "log_probs", "values", "rewards", "truncation_values", "bootstrap_observations",
            "bootstrap_values")  # fmt: skip


class RecordError(ValueError):
    """An experience record that is skipped; ``reason`` names what it is counted under."""

    REASONS = (
        "undecodable",
        "schema_version",
        "missing_field",
        "spec_mismatch",
        "impossible_version",
        "non_finite",
    )

    def __init__(self, reason: str, message: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TrajectorySpec:
    """What every chunk of a run must fit: the observation shape and the action space of its env."""

    obs_shape: tuple[int, ...]
    action_shape: tuple[int, ...]
    discrete: tuple[int, int] | None  # (first action, last action) of a Discrete space, else None (Box)

    @classmethod
    def from_spaces(cls, observation_space: gym.Space, action_space: gym.Space) -> TrajectorySpec:
        if isinstance(action_space, gym.spaces.Discrete):
            start = int(action_space.start)
            return cls(tuple(observation_space.shape), (), (start, start + int(action_space.n) - 1))
        return cls(tuple(observation_space.shape), tuple(action_space.shape), None)


@dataclass(frozen=True)
class ChunkArrays:
    policy_version: int
    env_incarnation: str
    observations: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape]
    log_probs: np.ndarray  # [T, N]
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    truncation_values: np.ndarray
    bootstrap_observations: np.ndarray  # [N, *obs_shape]
    bootstrap_values: np.ndarray  # [N]

    @property
    def num_steps(self) -> int:
        return int(self.rewards.size)


def encode_record(chunk: experience_pb2.TrajectoryChunk) -> bytes:
    """A chunk as one entry of the experience stream."""
    record = experience_pb2.ExperienceRecord(schema_version=SCHEMA_VERSION, trajectory_chunk=chunk)
    return record.SerializeToString()


def decode_record(data: bytes, spec: TrajectorySpec) -> ChunkArrays:
    """Parse and check one stream entry; RecordError on anything the learner must not see."""
    try:
        record = experience_pb2.ExperienceRecord.FromString(data)
    except DecodeError as error:
        raise RecordError("undecodable", f"not an ExperienceRecord: {error}") from None
    if record.schema_version != SCHEMA_VERSION:
        raise RecordError(
            "schema_version", f"schema version {record.schema_version}; this trainer reads {SCHEMA_VERSION}"
        )
    if record.WhichOneof("kind") != "trajectory_chunk":
        raise RecordError("missing_field", "a record without a trajectory_chunk")
    chunk = record.trajectory_chunk
    missing = [name for name in TENSOR_FIELDS if not chunk.HasField(name)]
    if missing:
        raise RecordError("missing_field", f"a chunk without {', '.join(missing)}")
    try:
        arrays = {name: tensors.decode(getattr(chunk, name)) for name in TENSOR_FIELDS}
    except tensors.TensorError as error:
        raise RecordError("undecodable", f"a chunk tensor does not decode: {error}") from None
    _check_shapes(arrays, spec)
    not_finite = [
        name
        for name in TENSOR_FIELDS
        if arrays[name].dtype.kind == "f" and not np.isfinite(arrays[name]).all()
    ]
    if not_finite:
        raise RecordError("non_finite", f"NaN or infinity in {', '.join(not_finite)}")
    return ChunkArrays(policy_version=chunk.policy_version, env_incarnation=chunk.env_incarnation, **arrays)


def _check_shapes(arrays: dict[str, np.ndarray], spec: TrajectorySpec) -> None:
    def mismatch(message: str) -> RecordError:
        return RecordError("spec_mismatch", message)

    t_n = arrays["rewards"].shape
    if len(t_n) != 2 or 0 in t_n:
        raise mismatch(f"rewards must be [T, N] with T, N > 0, got shape {t_n}")
    if any(arrays[k].shape[:2] != t_n for k in _TIME_MAJOR):
        raise mismatch(f"chunk tensors disagree on [T, N]: { ({k: v.shape for k, v in arrays.items()}) }")
    n = t_n[1]
    expected = {
        "observations": (*t_n, *spec.obs_shape),
        "actions": (*t_n, *spec.action_shape),
        "bootstrap_observations": (n, *spec.obs_shape),
        "bootstrap_values": (n,),
        **{k: t_n for k in ("log_probs", "values", "terminated", "truncated", "truncation_values")},
    }
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise mismatch(f"{name} of shape {arrays[name].shape}, the run's spaces make {shape}")
    wrong = [k for k in _FLOAT32 if arrays[k].dtype != np.float32]
    wrong += [k for k in ("terminated", "truncated") if arrays[k].dtype != np.bool_]
    if wrong:
        raise mismatch(f"wrong dtype for {', '.join(f'{k} ({arrays[k].dtype})' for k in wrong)}")
    actions = arrays["actions"]
    if spec.discrete is None:
        if actions.dtype.kind != "f":
            raise mismatch(f"Box actions must be floats, got {actions.dtype}")
    else:
        low, high = spec.discrete
        if actions.dtype.kind not in "iu":
            raise mismatch(f"Discrete actions must be integers, got {actions.dtype}")
        if actions.min() < low or actions.max() > high:
            raise mismatch(f"Discrete actions outside [{low}, {high}]: {actions.min()}..{actions.max()}")
