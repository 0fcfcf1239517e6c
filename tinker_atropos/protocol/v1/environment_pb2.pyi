from tinker_atropos.protocol.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Box(_message.Message):
    __slots__ = ("shape", "dtype", "low", "high")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _tensor_pb2.DType
    low: _tensor_pb2.Tensor
    high: _tensor_pb2.Tensor
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., low: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., high: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Discrete(_message.Message):
    __slots__ = ("n", "start")
    N_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    n: int
    start: int
    def __init__(self, n: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class Space(_message.Message):
    __slots__ = ("box", "discrete", "dict")
    BOX_FIELD_NUMBER: _ClassVar[int]
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    box: Box
    discrete: Discrete
    dict: Dict
    def __init__(self, box: _Optional[_Union[Box, _Mapping]] = ..., discrete: _Optional[_Union[Discrete, _Mapping]] = ..., dict: _Optional[_Union[Dict, _Mapping]] = ...) -> None: ...

class Dict(_message.Message):
    __slots__ = ("keys", "spaces")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    spaces: _containers.RepeatedCompositeFieldContainer[Space]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., spaces: _Optional[_Iterable[_Union[Space, _Mapping]]] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("env_id", "observation_space", "action_space", "num_instances", "free_instances", "incarnation", "backend", "local_address", "observation_layout")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    FREE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    observation_space: Space
    action_space: Space
    num_instances: int
    free_instances: int
    incarnation: str
    backend: str
    local_address: str
    observation_layout: Space
    def __init__(self, env_id: _Optional[str] = ..., observation_space: _Optional[_Union[Space, _Mapping]] = ..., action_space: _Optional[_Union[Space, _Mapping]] = ..., num_instances: _Optional[int] = ..., free_instances: _Optional[int] = ..., incarnation: _Optional[str] = ..., backend: _Optional[str] = ..., local_address: _Optional[str] = ..., observation_layout: _Optional[_Union[Space, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    step: StepRequest
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("num_instances", "seed")
    NUM_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    num_instances: int
    seed: int
    def __init__(self, num_instances: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "actions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    actions: _tensor_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., actions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "step")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    step: StepResult
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "incarnation", "num_instances", "observations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    incarnation: str
    num_instances: int
    observations: _tensor_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., num_instances: _Optional[int] = ..., observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("observations", "rewards", "terminated", "truncated", "final_observations", "final_indices", "episodes")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    FINAL_INDICES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    observations: _tensor_pb2.Tensor
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    final_observations: _tensor_pb2.Tensor
    final_indices: _tensor_pb2.Tensor
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeEnd]
    def __init__(self, observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_observations: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_indices: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., episodes: _Optional[_Iterable[_Union[EpisodeEnd, _Mapping]]] = ...) -> None: ...

class EpisodeEnd(_message.Message):
    __slots__ = ("instance", "episode_return", "length", "terminated", "cut_nonfinite")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    CUT_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    instance: int
    episode_return: float
    length: int
    terminated: bool
    cut_nonfinite: bool
    def __init__(self, instance: _Optional[int] = ..., episode_return: _Optional[float] = ..., length: _Optional[int] = ..., terminated: _Optional[bool] = ..., cut_nonfinite: _Optional[bool] = ...) -> None: ...

class LocalFrame(_message.Message):
    __slots__ = ("response", "status")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    response: SessionResponse
    status: LocalStatus
    def __init__(self, response: _Optional[_Union[SessionResponse, _Mapping]] = ..., status: _Optional[_Union[LocalStatus, _Mapping]] = ...) -> None: ...

class LocalStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
