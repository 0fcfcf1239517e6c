"""The interface every simulation backend of the environment service implements, and how one is chosen.

A backend steps a batch of instances of one env together and resets finished episodes itself (autoreset).
The service only validates requests, encodes tensors and keeps episode statistics, so a faster backend
(threads, C-level batching) can replace the gymnasium one without touching the protocol.

``env.backend`` names a backend as ``trainer.algorithm`` names an algorithm: a registered name (``register``: the
built-ins register in this package's ``__init__``) or ``module:Class`` for a third party's, a class whose constructor
takes a ``BatchSetup``; the module is imported only where a batch is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from tinker_atropos.errors import EnvError
from tinker_atropos.protocol.steps import StepBatch


class EnvBatch(Protocol):
    """N instances of one Gymnasium env id, stepped as a batch."""

    observation_space: gym.Space  # a Box; for a Dict env, its flat Box (``observation_layout`` is the Dict)
    action_space: gym.Space
    observation_layout: gym.spaces.Dict | None
    num_instances: int

    def reset(self, seed: int | None) -> np.ndarray:
        """Reset every instance; instance i is seeded with ``seed + i``. Returns [N, *obs_shape] float32."""
        ...

    def step(self, actions: np.ndarray) -> StepBatch:
        """Step every instance with its row of ``actions`` (already validated and clipped). The arrays are
        the caller's: the batch does not write into them afterwards."""
        ...

    def reset_instances(self, indices: np.ndarray) -> np.ndarray:
        """Start a new episode on the given instances (unseeded: they go on drawing from their own RNGs);
        returns their first observations, [len(indices), *obs_shape] float32."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BatchSetup:
    """What a backend is built from: the env (``env.id``, ``env.kwargs``), how many instances, and the threads it
    may simulate with (``env.threads``; a backend that steps in the caller's thread ignores them)."""

    env_id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_instances: int = 1
    num_threads: int = 1


_REGISTRY: dict[str, str] = {}  # a backend's name -> its class, as 'module:Class' (imported when built)


def register(name: str, reference: str) -> None:
    """Make ``name`` an ``env.backend``, built by the class ``reference`` names ('module:Class')."""
    if _REGISTRY.get(name, reference) != reference:
        raise ValueError(f"another env backend is already registered as {name!r}")
    _REGISTRY[name] = reference


def backend_class(backend: str) -> Callable[[BatchSetup], EnvBatch]:
    """The class ``env.backend`` names; EnvError saying why it cannot be used."""
    reference = _REGISTRY.get(backend, backend)
    module, _, name = reference.partition(":")
    if not name:
        raise EnvError(
            f"env.backend {backend!r} is not a registered backend; registered: "
            f"{', '.join(map(repr, sorted(_REGISTRY)))}, or 'module:Class' for a third party's"
        )
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # ImportError, AttributeError, or whatever the module raises while imported
        raise EnvError(f"env.backend {backend!r} does not import: {type(error).__name__}: {error}") from None


def make_env_batch(
    backend: str, env_id: str, kwargs: dict[str, Any], num_instances: int, threads: int = 2
) -> EnvBatch:
    """Build the backend named in the config (``env.backend``); ``threads`` is for backends that use them."""
    return backend_class(backend)(BatchSetup(env_id, kwargs, num_instances, threads))
