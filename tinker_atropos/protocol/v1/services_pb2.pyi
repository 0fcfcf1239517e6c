from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("incarnation", "policy_version", "updates", "env_steps_trained", "chunks_consumed", "chunks_rejected_stale", "busy_fraction", "policy_lag_min", "policy_lag_mean", "policy_lag_max", "losses", "records_rejected", "updates_discarded_nonfinite")
    class LossesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RecordsRejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REJECTED_STALE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_MIN_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_MEAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_MAX_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_DISCARDED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    policy_version: int
    updates: int
    env_steps_trained: int
    chunks_consumed: int
    chunks_rejected_stale: int
    busy_fraction: float
    policy_lag_min: float
    policy_lag_mean: float
    policy_lag_max: float
    losses: _containers.ScalarMap[str, float]
    records_rejected: _containers.ScalarMap[str, int]
    updates_discarded_nonfinite: int
    def __init__(self, incarnation: _Optional[str] = ..., policy_version: _Optional[int] = ..., updates: _Optional[int] = ..., env_steps_trained: _Optional[int] = ..., chunks_consumed: _Optional[int] = ..., chunks_rejected_stale: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., policy_lag_min: _Optional[float] = ..., policy_lag_mean: _Optional[float] = ..., policy_lag_max: _Optional[float] = ..., losses: _Optional[_Mapping[str, float]] = ..., records_rejected: _Optional[_Mapping[str, int]] = ..., updates_discarded_nonfinite: _Optional[int] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("incarnation", "policy_version", "env_steps", "chunks_written", "partial_chunks_dropped", "connected_sessions", "episodes", "weights_rejected")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    policy_version: int
    env_steps: int
    chunks_written: int
    partial_chunks_dropped: int
    connected_sessions: int
    episodes: int
    weights_rejected: int
    def __init__(self, incarnation: _Optional[str] = ..., policy_version: _Optional[int] = ..., env_steps: _Optional[int] = ..., chunks_written: _Optional[int] = ..., partial_chunks_dropped: _Optional[int] = ..., connected_sessions: _Optional[int] = ..., episodes: _Optional[int] = ..., weights_rejected: _Optional[int] = ...) -> None: ...
