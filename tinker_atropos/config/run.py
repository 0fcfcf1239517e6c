"""The run's own sections: ``run`` (its name, seed, reporting, supervision of its services) and ``redis`` (the
server every service meets at)."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from tinker_atropos.sections import Section


class RunSection(Section):
    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Namespaces Redis keys (ta:{name}:…) and names the run folder, runs/{name}.",
    )
    seed: int = Field(1, ge=0, description="Seeds env instances, policy sampling and network initialisation.")
    report_interval_s: float = Field(2.0, gt=0, description="Seconds between progress reports of `up`.")
    return_window: int = Field(
        10,
        ge=1,
        le=1000,
        description="Latest episodes the reported return (and --target-return) averages: 10 for a control task's "
        "long episodes; a language model's answers are short and their rewards noisy, 64 or more. Redis keeps the "
        "latest 1000.",
    )
    write_failure_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long writes into the run folder (checkpoints, metrics.jsonl, TensorBoard) may keep "
        "failing (a full or read-only disk) before `up` stops the run with that reason; learning goes on "
        "meanwhile and each write is retried every 10 s.",
    )
    hang_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A service of `up` whose process runs but whose heartbeat the registry has not shown for "
        "this long (hung, or stopped by a signal) is killed and restarted as a crashed one is. Above "
        "redis.heartbeat_ttl_s.",
    )
    log_max_bytes: int = Field(
        20 * 1024 * 1024, ge=4096, description="A service's log under RUN_DIR/logs is rotated at this size."
    )
    log_backups: int = Field(
        3, ge=1, description="Rotated logs kept per service (NAME.log.1 the newest ... NAME.log.N)."
    )

    @field_validator("name")
    @classmethod
    def _a_folder_of_its_own(cls, name: str) -> str:
        # runs/.. is the folder that holds runs/: the run's checkpoints, secrets and logs would land beside the code
        if name in (".", ".."):
            raise ValueError(f"{name!r} is no folder of its own under runs/")
        return name


class RedisSection(Section):
    url: str | None = Field(
        None, description="redis:// URL of a Redis-protocol server; null = `up` starts an embedded Valkey."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Seconds between registry heartbeats.")
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="A service missing heartbeats this long is gone.")
    append_only: bool = Field(
        False,
        description="The embedded Valkey keeps an append-only file in the run folder: registry, weights "
        "and version survive a Redis restart.",
    )
    unreachable_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a starting service, or `up` at any time, waits for an unreachable Redis before "
        "it stops with an error (running services wait for it for ever).",
    )

    @field_validator("url")
    @classmethod
    def _parsable(cls, url: str | None) -> str | None:
        """A URL the Redis client can connect with: refused here, by field, rather than by every service."""
        if url is not None:
            from tinker_atropos.state.connection import check_url

            try:
                check_url(url)
            except ValueError as error:  # the message leaves the URL out: it may hold a password
                raise PydanticCustomError("redis_url", str(error)) from None
        return url
