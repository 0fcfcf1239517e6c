"""The seam every learning algorithm plugs into, Acme-style: small interfaces and one registry.

An algorithm is registered under a name (``trainer.algorithm``) with its hyper-parameter section, validated as
``trainer.<name>`` by its own model, and the learner it builds. A ``Learner`` is the algorithm's maths: it turns
the experience it asks for into updates of a ``TrainingCore`` (model, optimizer, version), and publishes what a
rollout acts with as the core's spec. The drivers (``trainer/``: the experience loop) drive learners and
cores and never import an algorithm; the rollout acts with the published spec (``models.acting``).

Registering is cheap: the learner is named as ``module:Class`` and imported only where one is built, so that
reading a config never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    import gymnasium as gym
    import torch

    from tinker_atropos.protocol.trajectory import Trajectory
    from tinker_atropos.training.core import TrainingCore
    from tinker_atropos.training.replay import ReplayBuffer

# What a learner consumes: "trajectories", on-policy batches of whole chunks acted by recent versions (older than
# trainer.max_policy_lag: rejected as stale); "transitions", chunks of any age for a replay buffer (``replay``).
Experience = Literal["trajectories", "transitions"]


@dataclass(frozen=True)
class LearnerSetup:
    """What a learner is built from: the env's spaces, the trainer's config and the algorithm's section."""

    observation_space: gym.Space
    action_space: gym.Space
    trainer: Any  # the run's config.TrainerSection (not imported: the config validates through this registry)
    hyperparameters: Any  # the algorithm's validated section, an instance of ``Algorithm.hyperparameters``
    device: torch.device
    seed: int
    observation_layout: gym.spaces.Dict | None = None  # a Dict env's entries, observed as the flat Box above


class Learner(Protocol):
    """An algorithm's maths over a training core. ``state_dict`` holds everything a checkpoint must restore
    (the core's state and the learner's own, e.g. its RNG)."""

    core: TrainingCore
    experience: Experience
    needs_values: bool  # learns from the acting policy's critic values (its trajectories must carry them)
    replay: ReplayBuffer | None  # an off-policy learner's transitions, checkpointed beside its state_dict

    def learn(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One update from a batch of experience; its loss metrics."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What an undone update restores and a checkpoint holds; the replay buffer is saved apart."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: ``trainer.algorithm`` names it, ``trainer.<name>`` holds its section."""

    name: str
    hyperparameters: type[BaseModel]
    learner: str  # "module:Class" of its Learner, whose constructor takes a LearnerSetup
    description: str = ""

    def build(self, setup: LearnerSetup) -> Learner:
        module, _, name = self.learner.partition(":")
        return getattr(importlib.import_module(module), name)(setup)


_REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Make ``algorithm`` known by its name (idempotent for the same definition)."""
    known = _REGISTRY.get(algorithm.name)
    if known is not None and known != algorithm:
        raise ValueError(f"another algorithm is already registered as {algorithm.name!r}")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def names() -> list[str]:
    return sorted(_REGISTRY)


def algorithm(reference: str) -> Algorithm:
    """The algorithm ``trainer.algorithm`` names: a registered name, or ``module:name`` for one that the module
    registers when imported. ValueError naming the registered ones otherwise."""
    module, _, name = reference.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except Exception as error:  # ImportError, or whatever the module raises while it is imported
            raise ValueError(f"cannot import {module!r}: {type(error).__name__}: {error}") from None
    if name not in _REGISTRY:
        where = f"; {module!r} registers none of that name" if module else ""
        raise ValueError(f"unknown algorithm {name!r}{where}; registered: {', '.join(names())}")
    return _REGISTRY[name]
