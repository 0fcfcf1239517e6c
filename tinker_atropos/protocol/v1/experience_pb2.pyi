from tinker_atropos.protocol.v1 import environment_pb2 as _environment_pb2
from tinker_atropos.protocol.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExperienceRecord(_message.Message):
    __slots__ = ("schema_version", "trajectory_chunk")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_CHUNK_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    trajectory_chunk: TrajectoryChunk
    def __init__(self, schema_version: _Optional[int] = ..., trajectory_chunk: _Optional[_Union[TrajectoryChunk, _Mapping]] = ...) -> None: ...

class TrajectoryChunk(_message.Message):
    __slots__ = ("rollout_incarnation", "env_incarnation", "session_id", "policy_version", "observations", "actions", "log_probs", "values", "rewards", "terminated", "truncated", "truncation_values", "bootstrap_observations", "bootstrap_values", "episodes", "created_at", "truncated_observations", "sequence")
    ROLLOUT_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENV_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_VALUES_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_VALUES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    rollout_incarnation: str
    env_incarnation: str
    session_id: str
    policy_version: int
    observations: _tensor_pb2.Tensor
    actions: _tensor_pb2.Tensor
    log_probs: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    truncation_values: _tensor_pb2.Tensor
    bootstrap_observations: _tensor_pb2.Tensor
    bootstrap_values: _tensor_pb2.Tensor
    episodes: _containers.RepeatedCompositeFieldContainer[_environment_pb2.EpisodeEnd]
    created_at: float
    truncated_observations: _tensor_pb2.Tensor
    sequence: int
    def __init__(self, rollout_incarnation: _Optional[str] = ..., env_incarnation: _Optional[str] = ..., session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., actions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., log_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncation_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bootstrap_observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bootstrap_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., episodes: _Optional[_Iterable[_Union[_environment_pb2.EpisodeEnd, _Mapping]]] = ..., created_at: _Optional[float] = ..., truncated_observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...
