"""The ``rollout`` section: how the rollout services act in the envs and stream their experience."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tinker_atropos.config.field_types import Auto, Device, Transport
from tinker_atropos.sections import Section


class RolloutSection(Section):
    replicas: Annotated[int, Field(ge=0, le=256)] | Auto = Field(
        1,
        description="Rollout services that `up` starts (0: none, as in an Atropos run); they share the env "
        "services' session slots. 'auto': enough for the acting the sizing rule expects.",
    )
    sessions_per_env: int = Field(
        1,
        ge=1,
        le=64,
        description="Session slots of each env service, its instances split among them: the units the rollouts "
        "share out, each to one rollout (with more rollouts than slots, the extra ones stand by).",
    )
    chunk_length: int = Field(64, ge=1, le=4096, description="Steps per trajectory chunk.")
    device: Device = Field("cpu", description="Where policy inference runs: cpu, cuda, cuda:N or auto.")
    max_queued_chunks: int = Field(
        64, ge=1, description="Bound of the experience stream in Redis; older chunks are dropped and counted."
    )
    flow_control: Literal["pause", "drop"] = Field(
        "pause",
        description="'pause': stop collecting while a full batch (trainer.samples_per_update env steps) waits "
        "in the stream, so no step goes stale; 'drop': collect flat out, the stream bound drops the excess.",
    )
    reconnect_backoff_s: float = Field(0.2, gt=0, description="First reconnect delay; doubles up to 5 s.")
    lease_ttl_s: float = Field(
        3.0,
        ge=0.5,
        le=60,
        description="Life of a rollout's membership and session-slot leases in Redis, refreshed 3 times per TTL: "
        "a rollout that dies has its share taken over by the others within about this long.",
    )
    transport: Transport = Field(
        "auto",
        description="'auto': an env service on the same host (and network namespace) is stepped over its local "
        "Unix socket, the others over gRPC; 'grpc': always gRPC.",
    )
