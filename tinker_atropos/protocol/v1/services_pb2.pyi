from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("environment", "rollout", "trainer", "atropos_api")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    ATROPOS_API_FIELD_NUMBER: _ClassVar[int]
    environment: EnvironmentStatus
    rollout: RolloutStatus
    trainer: TrainerStatus
    atropos_api: AtroposApiStatus
    def __init__(self, environment: _Optional[_Union[EnvironmentStatus, _Mapping]] = ..., rollout: _Optional[_Union[RolloutStatus, _Mapping]] = ..., trainer: _Optional[_Union[TrainerStatus, _Mapping]] = ..., atropos_api: _Optional[_Union[AtroposApiStatus, _Mapping]] = ...) -> None: ...

class EnvironmentStatus(_message.Message):
    __slots__ = ("incarnation", "env_id", "instances", "free_instances", "sessions", "streams", "steps", "episodes", "episodes_cut_nonfinite", "bad_requests", "streams_refused", "streams_timed_out", "local_peers_refused", "sessions_refused_busy", "sessions_taken_over")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    FREE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_CUT_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    BAD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PEERS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REFUSED_BUSY_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    env_id: str
    instances: int
    free_instances: int
    sessions: int
    streams: int
    steps: int
    episodes: int
    episodes_cut_nonfinite: int
    bad_requests: int
    streams_refused: int
    streams_timed_out: int
    local_peers_refused: int
    sessions_refused_busy: int
    sessions_taken_over: int
    def __init__(self, incarnation: _Optional[str] = ..., env_id: _Optional[str] = ..., instances: _Optional[int] = ..., free_instances: _Optional[int] = ..., sessions: _Optional[int] = ..., streams: _Optional[int] = ..., steps: _Optional[int] = ..., episodes: _Optional[int] = ..., episodes_cut_nonfinite: _Optional[int] = ..., bad_requests: _Optional[int] = ..., streams_refused: _Optional[int] = ..., streams_timed_out: _Optional[int] = ..., local_peers_refused: _Optional[int] = ..., sessions_refused_busy: _Optional[int] = ..., sessions_taken_over: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("incarnation", "policy_version", "updates", "env_steps_trained", "chunks_consumed", "chunks_rejected_stale", "busy_fraction", "policy_lag_min", "policy_lag_mean", "policy_lag_max", "losses", "records_rejected", "updates_discarded_nonfinite", "tinker_api", "policy_lag_counts", "eval_policy_version", "eval_return_mean", "eval_return_std", "eval_best_policy_version", "eval_best_return_mean", "writes_failed", "write_failure", "write_failing_s", "tinker_events", "write_failures")
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
    class PolicyLagCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class WritesFailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TinkerEventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WriteFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
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
    TINKER_API_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EVAL_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_RETURN_MEAN_FIELD_NUMBER: _ClassVar[int]
    EVAL_RETURN_STD_FIELD_NUMBER: _ClassVar[int]
    EVAL_BEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_BEST_RETURN_MEAN_FIELD_NUMBER: _ClassVar[int]
    WRITES_FAILED_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURE_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILING_S_FIELD_NUMBER: _ClassVar[int]
    TINKER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
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
    tinker_api: str
    policy_lag_counts: _containers.ScalarMap[int, int]
    eval_policy_version: int
    eval_return_mean: float
    eval_return_std: float
    eval_best_policy_version: int
    eval_best_return_mean: float
    writes_failed: _containers.ScalarMap[str, int]
    write_failure: str
    write_failing_s: float
    tinker_events: _containers.ScalarMap[str, int]
    write_failures: _containers.ScalarMap[str, str]
    def __init__(self, incarnation: _Optional[str] = ..., policy_version: _Optional[int] = ..., updates: _Optional[int] = ..., env_steps_trained: _Optional[int] = ..., chunks_consumed: _Optional[int] = ..., chunks_rejected_stale: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., policy_lag_min: _Optional[float] = ..., policy_lag_mean: _Optional[float] = ..., policy_lag_max: _Optional[float] = ..., losses: _Optional[_Mapping[str, float]] = ..., records_rejected: _Optional[_Mapping[str, int]] = ..., updates_discarded_nonfinite: _Optional[int] = ..., tinker_api: _Optional[str] = ..., policy_lag_counts: _Optional[_Mapping[int, int]] = ..., eval_policy_version: _Optional[int] = ..., eval_return_mean: _Optional[float] = ..., eval_return_std: _Optional[float] = ..., eval_best_policy_version: _Optional[int] = ..., eval_best_return_mean: _Optional[float] = ..., writes_failed: _Optional[_Mapping[str, int]] = ..., write_failure: _Optional[str] = ..., write_failing_s: _Optional[float] = ..., tinker_events: _Optional[_Mapping[str, int]] = ..., write_failures: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("incarnation", "policy_version", "env_steps", "chunks_written", "partial_chunks_dropped", "connected_sessions", "episodes", "weights_rejected", "episode_return_mean", "sessions_lost", "weights_refused", "instances_held", "instances_by_env", "units_assigned", "rollouts_seen", "units_handed_over", "leases_lost", "lease_records_skipped")
    class WeightsRefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class InstancesByEnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LeaseRecordsSkippedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_MEAN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_LOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_HELD_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_BY_ENV_FIELD_NUMBER: _ClassVar[int]
    UNITS_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_SEEN_FIELD_NUMBER: _ClassVar[int]
    UNITS_HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_FIELD_NUMBER: _ClassVar[int]
    LEASE_RECORDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    policy_version: int
    env_steps: int
    chunks_written: int
    partial_chunks_dropped: int
    connected_sessions: int
    episodes: int
    weights_rejected: int
    episode_return_mean: float
    sessions_lost: int
    weights_refused: _containers.ScalarMap[str, int]
    instances_held: int
    instances_by_env: _containers.ScalarMap[str, int]
    units_assigned: int
    rollouts_seen: int
    units_handed_over: int
    leases_lost: int
    lease_records_skipped: _containers.ScalarMap[str, int]
    def __init__(self, incarnation: _Optional[str] = ..., policy_version: _Optional[int] = ..., env_steps: _Optional[int] = ..., chunks_written: _Optional[int] = ..., partial_chunks_dropped: _Optional[int] = ..., connected_sessions: _Optional[int] = ..., episodes: _Optional[int] = ..., weights_rejected: _Optional[int] = ..., episode_return_mean: _Optional[float] = ..., sessions_lost: _Optional[int] = ..., weights_refused: _Optional[_Mapping[str, int]] = ..., instances_held: _Optional[int] = ..., instances_by_env: _Optional[_Mapping[str, int]] = ..., units_assigned: _Optional[int] = ..., rollouts_seen: _Optional[int] = ..., units_handed_over: _Optional[int] = ..., leases_lost: _Optional[int] = ..., lease_records_skipped: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AtroposApiStatus(_message.Message):
    __slots__ = ("incarnation", "url", "step", "queue_groups", "queue_sequences", "pending_batches", "envs_registered", "envs_connected", "groups_received", "groups_buffered", "groups_refused_full", "groups_duplicate", "batches_served", "sequences_served", "records_skipped", "groups_refused_invalid")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PENDING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ENVS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ENVS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_BUFFERED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REFUSED_FULL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_SERVED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_REFUSED_INVALID_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    url: str
    step: int
    queue_groups: int
    queue_sequences: int
    pending_batches: int
    envs_registered: int
    envs_connected: int
    groups_received: int
    groups_buffered: int
    groups_refused_full: int
    groups_duplicate: int
    batches_served: int
    sequences_served: int
    records_skipped: int
    groups_refused_invalid: int
    def __init__(self, incarnation: _Optional[str] = ..., url: _Optional[str] = ..., step: _Optional[int] = ..., queue_groups: _Optional[int] = ..., queue_sequences: _Optional[int] = ..., pending_batches: _Optional[int] = ..., envs_registered: _Optional[int] = ..., envs_connected: _Optional[int] = ..., groups_received: _Optional[int] = ..., groups_buffered: _Optional[int] = ..., groups_refused_full: _Optional[int] = ..., groups_duplicate: _Optional[int] = ..., batches_served: _Optional[int] = ..., sequences_served: _Optional[int] = ..., records_skipped: _Optional[int] = ..., groups_refused_invalid: _Optional[int] = ...) -> None: ...
