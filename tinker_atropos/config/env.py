"""The ``env`` section: which Gymnasium env the env services host, on which backend, and how many of them."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any

from pydantic import Field, field_validator

from tinker_atropos.config.field_types import Auto
from tinker_atropos.errors import EnvError
from tinker_atropos.sections import Section


class EnvSection(Section):
    id: str = Field(
        "Pendulum-v1",
        description="A registered Gymnasium env id, 'module:EnvClass' (a gymnasium.Env subclass) or "
        "'module:registered-id' (the module registers it when imported).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for gymnasium.make.")
    backend: str = Field(
        "gymnasium",
        description="'gymnasium' steps gymnasium.make instances; 'mujoco' is the batched MuJoCo one; "
        "'module:Class' a third party's (a class built from a BatchSetup, environment/backends/base.py).",
    )
    instances: Annotated[int, Field(ge=1, le=4096)] | Auto = Field(
        16,
        description="Environment instances hosted by each env service; 'auto': a batch step of about 4 ms of "
        "the env's measured CPU time, within 4 and 64 (docs: Scaling, Sizing a run to the machine).",
    )
    threads: int = Field(
        2,
        ge=1,
        le=256,
        description="Simulation threads per session ('mujoco' backend; MuJoCo releases the GIL).",
    )
    services: Annotated[int, Field(ge=0, le=256)] | Auto = Field(
        1,
        description="Environment services that `up` starts (0: none, as in an Atropos run); 'auto': one per core "
        "left to the env services by the sizing rule.",
    )
    max_sessions: int | None = Field(
        None,
        ge=1,
        description="Streams an env service serves at once (local and gRPC together); past it a new one is "
        "refused with RESOURCE_EXHAUSTED. Null: one per instance.",
    )
    open_timeout_s: float = Field(
        10.0, gt=0, description="A stream that has not opened its session after this long is ended."
    )
    session_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="An open session without a step request for this long is ended and its instances freed "
        "(a rollout paused by flow control for longer reconnects).",
    )

    @property
    def session_limit(self) -> int:
        return self.max_sessions or self.instances

    @property
    def total_instances(self) -> int:
        """The instances of all the env services `up` starts: what the benchmark's peers step in one place."""
        return self.instances * self.services

    @field_validator("backend")
    @classmethod
    def _backend_form(cls, backend: str) -> str:
        # a name is looked up in the backends' registry, a 'module:Class' imported, where a batch is built
        # (check_env, before anything starts): the backends register themselves, as algorithms do
        if not re.fullmatch(r"[a-z][a-z0-9_]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*", backend):
            raise ValueError(
                "neither a registered backend's name (such as 'gymnasium', 'mujoco') nor 'module:Class'"
            )
        return backend

    @field_validator("id")
    @classmethod
    def _registered(cls, env_id: str) -> str:
        # A 'module:…' form is imported where the env is served (check_env), not by every reader of the config
        if ":" not in env_id:
            check_registered(env_id)
        return env_id


def check_registered(env_id: str) -> None:
    """Raise EnvError, with the closest registered ids, unless ``env_id`` is a registered Gymnasium id."""
    import gymnasium as gym

    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EnvError(f"unknown Gymnasium env id {env_id!r}{hint}")
