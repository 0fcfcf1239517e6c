"""The rollout's copy of the policy: rebuilt from the trainer's published weights when the version changes."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import redis
import torch

from tinker_atropos.algorithms.ppo.networks import ActorCritic, InferencePolicy, weights_from_bytes
from tinker_atropos.state.weights import fetch_weights, published_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionedPolicy:
    """One immutable (version, network) pair: a chunk is acted by exactly one of these."""

    version: int
    network: InferencePolicy

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.network.act(obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self.network.value(obs)


class PolicySource:
    """Pulls new weights from Redis on demand; shared by all sessions of a rollout service."""

    def __init__(self, client: redis.Redis, run: str, device: torch.device) -> None:
        self._client, self._run, self._device = client, run, device
        self._lock = threading.Lock()
        self._current: VersionedPolicy | None = None
        self._rng = np.random.default_rng()  # one stream for every version: no two replay the same noise

    def refresh(self) -> VersionedPolicy | None:
        """The latest published policy (fetched only if its version is new); None before the first one.

        On a Redis error the last policy stays in use: a rollout keeps acting while the trainer or Redis
        is away."""
        try:
            version = published_version(self._client, self._run)
            if version is None or (self._current is not None and version == self._current.version):
                return self._current
            with self._lock:
                if self._current is not None and self._current.version == version:
                    return self._current
                published = fetch_weights(self._client, self._run)
                if published is None:
                    return self._current
                model = ActorCritic(published.spec)
                model.load_state_dict(weights_from_bytes(published.blob))
                network = InferencePolicy(model, self._device, self._rng)
                self._current = VersionedPolicy(published.version, network)
                log.info("loaded policy version %d", published.version)
        except redis.RedisError as error:
            log.warning("cannot refresh weights (%s); acting with version %s", error, self.version)
        return self._current

    @property
    def version(self) -> int | None:
        return None if self._current is None else self._current.version
