"""The trajectory schema, written once: the typed record a rollout builds and an algorithm learns from, and its
one encode / decode pair over the experience stream (an ``ExperienceRecord`` envelope around a
``TrajectoryChunk``, experience.proto).

Whatever is read from the stream is untrusted: a record that does not decode, carries another schema version,
lacks a tensor, does not fit the run's spaces or holds a NaN raises ``RecordError`` with the reason it is
counted under. None of them reaches a learner. Each record names its writer (the rollout's incarnation) and its
place among that writer's records (``sequence``), so that a reader can refuse one it has taken before
(``protocol/freshness.py``): a signature proves who wrote a record, not that it is new.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
from google.protobuf.message import DecodeError

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2, experience_pb2

SCHEMA_VERSION = 3  # 3: sequence; 2: truncated_observations

# Tensors every trajectory carries, and those only a policy with a critic fills in (all three or none).
_PER_STEP = ("observations", "actions", "log_probs", "rewards", "terminated", "truncated")  # (T, N, ...)
REQUIRED = (*_PER_STEP, "bootstrap_observations", "truncated_observations")
CRITIC = ("values", "truncation_values", "bootstrap_values")
_TIME_MAJOR = (*_PER_STEP, "values", "truncation_values")
_FLOAT32 = (
    "observations",
    "log_probs",
    "rewards",
    "bootstrap_observations",
    "truncated_observations",
    *CRITIC,
)


class RecordError(ValueError):
    """An experience record that is skipped; ``reason`` names what it is counted under."""

    REASONS = (
        "undecodable",
        "schema_version",
        "missing_field",
        "spec_mismatch",
        "impossible_version",
        "non_finite",
        "unsigned",
        "bad_signature",
        "replayed",
        "out_of_order",
        "before_restart",
    )

    def __init__(self, reason: str, message: str) -> None:
        assert reason in self.REASONS, reason
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Trajectory:
    """T consecutive steps of the N instances of one env session, time-major ``[T, N, …]``, every action chosen
    by the policy of ``policy_version``. Never spans two incarnations of an env service."""

    policy_version: int
    observations: np.ndarray  # [T, N, *obs_shape] float32, raw (not normalised)
    actions: np.ndarray  # [T, N, *action_shape]
    log_probs: np.ndarray  # [T, N] float32, behaviour log-probabilities
    rewards: np.ndarray  # [T, N] float32
    terminated: np.ndarray  # [T, N] bool
    truncated: np.ndarray  # [T, N] bool
    bootstrap_observations: np.ndarray  # [N, *obs_shape] float32, the observation after the last step
    # [K, *obs_shape] float32, the final observation of each truncated step, in the order of truncated.nonzero()
    truncated_observations: np.ndarray
    # [T, N] float32, the acting policy's value estimates, if it has a critic
    values: np.ndarray | None = None
    # [T, N] value of the final observation where truncated, else 0
    truncation_values: np.ndarray | None = None
    bootstrap_values: np.ndarray | None = None  # [N] value of the bootstrap observations
    env_incarnation: str = ""
    rollout_incarnation: str = ""
    sequence: int = 0  # 1, 2, 3, ... among the records of ``rollout_incarnation``
    session_id: str = ""
    episodes: Sequence[environment_pb2.EpisodeEnd] = field(default=(), repr=False)
    created_at: float = 0.0  # unix time

    @property
    def num_steps(self) -> int:
        return int(self.rewards.size)

    @property
    def has_values(self) -> bool:
        return self.values is not None


def contiguous_runs(chunks: list[Trajectory]) -> list[list[Trajectory]]:
    """Group chunks that continue one another: a chunk whose first observations are exactly another's bootstrap
    observations comes from the same session, right after it.

    GAE then runs over a whole run as over one long rollout. Cut at every chunk, a quarter of the advantage
    weight of 64-step chunks would rest on bootstrapped values instead of rewards (with gamma 0.99, lambda 0.95).
    """
    runs: list[list[Trajectory]] = []
    run_ending_at: dict[bytes, int] = {}  # bootstrap observations -> the run they end
    for chunk in chunks:
        index = run_ending_at.pop(chunk.observations[0].tobytes(), None)
        if index is None or runs[index][-1].observations.shape[1:] != chunk.observations.shape[1:]:
            index = len(runs)
            runs.append([])
        runs[index].append(chunk)
        run_ending_at[chunk.bootstrap_observations.tobytes()] = index
    return runs


@dataclass(frozen=True)
class TrajectorySpec:
    """What every trajectory of a run must fit: the observation shape and the action space of its env."""

    obs_shape: tuple[int, ...]
    action_shape: tuple[int, ...]
    discrete: tuple[int, int] | None  # (first action, last action) of a Discrete space, else None (Box)

    @classmethod
    def from_spaces(cls, observation_space: gym.Space, action_space: gym.Space) -> TrajectorySpec:
        if isinstance(action_space, gym.spaces.Discrete):
            start = int(action_space.start)
            return cls(tuple(observation_space.shape), (), (start, start + int(action_space.n) - 1))
        return cls(tuple(observation_space.shape), tuple(action_space.shape), None)


def encode_trajectory(trajectory: Trajectory) -> bytes:
    """A trajectory as one entry of the experience stream."""
    tensor_fields = {
        name: tensors.encode(getattr(trajectory, name))
        for name in (*REQUIRED, *CRITIC)
        if getattr(trajectory, name) is not None
    }
    chunk = experience_pb2.TrajectoryChunk(
        rollout_incarnation=trajectory.rollout_incarnation,
        env_incarnation=trajectory.env_incarnation,
        session_id=trajectory.session_id,
        policy_version=trajectory.policy_version,
        sequence=trajectory.sequence,
        episodes=trajectory.episodes,
        created_at=trajectory.created_at or time.time(),
        **tensor_fields,
    )
    record = experience_pb2.ExperienceRecord(schema_version=SCHEMA_VERSION, trajectory_chunk=chunk)
    return record.SerializeToString()


def decode_trajectory(data: bytes, spec: TrajectorySpec) -> Trajectory:
    """Parse and check one stream entry; RecordError on anything a learner must not see."""
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
    critic = [name for name in CRITIC if chunk.HasField(name)]
    missing = [name for name in REQUIRED if not chunk.HasField(name)]
    if critic and len(critic) < len(CRITIC):
        missing += [name for name in CRITIC if name not in critic]
    missing += [name for name in ("rollout_incarnation", "sequence") if not getattr(chunk, name)]
    if missing:
        raise RecordError("missing_field", f"a chunk without {', '.join(missing)}")
    try:
        arrays = {name: tensors.decode(getattr(chunk, name)) for name in (*REQUIRED, *critic)}
    except tensors.TensorError as error:
        raise RecordError("undecodable", f"a chunk tensor does not decode: {error}") from None
    _check_shapes(arrays, spec)
    not_finite = [k for k, v in arrays.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
    if not_finite:
        raise RecordError("non_finite", f"NaN or infinity in {', '.join(not_finite)}")
    return Trajectory(
        policy_version=chunk.policy_version,
        env_incarnation=chunk.env_incarnation,
        rollout_incarnation=chunk.rollout_incarnation,
        sequence=chunk.sequence,
        session_id=chunk.session_id,
        episodes=chunk.episodes,
        created_at=chunk.created_at,
        **arrays,
    )


def _check_shapes(arrays: dict[str, np.ndarray], spec: TrajectorySpec) -> None:
    def mismatch(message: str) -> RecordError:
        return RecordError("spec_mismatch", message)

    t_n = arrays["rewards"].shape
    if len(t_n) != 2 or 0 in t_n:
        raise mismatch(f"rewards must be [T, N] with T, N > 0, got shape {t_n}")
    if any(arrays[k].shape[:2] != t_n for k in _TIME_MAJOR if k in arrays):
        raise mismatch(f"chunk tensors disagree on [T, N]: { ({k: v.shape for k, v in arrays.items()}) }")
    n = t_n[1]
    expected = {
        "observations": (*t_n, *spec.obs_shape),
        "actions": (*t_n, *spec.action_shape),
        "bootstrap_observations": (n, *spec.obs_shape),
        "truncated_observations": (int(arrays["truncated"].sum()), *spec.obs_shape),
        "bootstrap_values": (n,),
        **{k: t_n for k in ("log_probs", "values", "terminated", "truncated", "truncation_values")},
    }
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != shape:
            raise mismatch(f"{name} of shape {arrays[name].shape}, the run's spaces make {shape}")
    wrong = [k for k in _FLOAT32 if k in arrays and arrays[k].dtype != np.float32]
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
