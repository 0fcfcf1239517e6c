"""The rollout's copy of the policy: rebuilt from the trainer's published weights when the version changes."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import redis

from tinker_atropos.models.acting import InferencePolicy, load_policy
from tinker_atropos.security import signing_key
from tinker_atropos.state.weights import fetch_weights, published_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionedPolicy:
    """One immutable (version, network) pair: a chunk is acted by exactly one of these."""

    version: int
    network: InferencePolicy

    @property
    def has_critic(self) -> bool:
        return self.network.has_critic

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return self.network.act(obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self.network.value(obs)


class PolicySource:
    """Pulls new weights from Redis on demand; shared by all sessions of a rollout service."""

    def __init__(self, client: redis.Redis, run: str, device: str, network: str = "mlp") -> None:
        self._client, self._run, self._device = client, run, device
        self._network = network  # trainer.model.network: the only one this rollout builds
        self._key = signing_key("weights")  # weights not signed with it are refused
        self._lock = threading.Lock()
        self._current: VersionedPolicy | None = None
        self._refused: int | None = None  # the latest version refused, not fetched again
        self._refused_reason = ""
        self.rejected = 0
        self._rng = np.random.default_rng()  # one stream for every version: no two replay the same noise

    def refresh(self) -> VersionedPolicy | None:
        """The latest published policy (fetched only if its version is new); None before the first one.

        On a Redis error, or weights that do not load or hold a NaN, the last policy stays in use: a rollout
        keeps acting while the trainer or Redis is away, and never acts with poisoned weights."""
        version = None
        try:
            version = published_version(self._client, self._run)
            if version is None or version in (self.version, self._refused):
                return self._current
            with self._lock:
                if version in (self.version, self._refused):
                    return self._current
                self._current = self._load() or self._current
        except redis.RedisError as error:
            log.warning("cannot refresh weights (%s); acting with version %s", error, self.version)
        except ValueError as error:  # a malformed weights record
            self._refuse(version, error)
        return self._current

    def _load(self) -> VersionedPolicy | None:
        published = fetch_weights(self._client, self._run, self._key)
        if published is None:
            return None
        try:
            network = load_policy(published.spec, published.blob, self._device, self._rng, self._network)
        except ValueError as error:  # a spec or blob we cannot act with
            self._refuse(published.version, error)
            return None
        log.info("loaded policy version %d", published.version)
        return VersionedPolicy(published.version, network)

    def _refuse(self, version: int | None, error: Exception) -> None:
        """Count a refused record; log it once, not on every chunk while it stays in Redis."""
        reason = f"{type(error).__name__}: {error}"
        if (version, reason) != (self._refused, self._refused_reason):
            self.rejected += 1
            log.warning(
                "refusing policy version %s (%s); acting with version %s", version, reason, self.version
            )
        self._refused, self._refused_reason = version, reason

    @property
    def version(self) -> int | None:
        return None if self._current is None else self._current.version
