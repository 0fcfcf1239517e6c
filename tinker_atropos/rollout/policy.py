"""The rollout's copy of the policy: rebuilt from the trainer's published weights when the version goes up.

A version below the one it acts with is refused (``rolled_back``), even signed: the trainer only publishes
upwards, so an older record in Redis is one written back over the current one. Every refusal is counted by reason,
in the rollout's status (``weights_refused``) and the run's counters (``weights_refused_<reason>``)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import redis

from tinker_atropos.models.acting import InferencePolicy, load_policy
from tinker_atropos.security import signing_key
from tinker_atropos.state.experience import add_stats
from tinker_atropos.state.weights import WeightsRecordError, fetch_weights, published_version

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
        self.refused: Counter[str] = Counter()  # by reason: WeightsRecordError.REASONS, not_loadable
        self._unreported: Counter[str] = Counter()  # not yet added to the run's counters
        self._rng = np.random.default_rng()  # one stream for every version: no two replay the same noise

    def refresh(self) -> VersionedPolicy | None:
        """The latest published policy (fetched only if its version is new); None before the first one.

        On a Redis error, or weights that do not load or hold a NaN, the last policy stays in use: a rollout
        keeps acting while the trainer or Redis is away, and never acts with poisoned weights."""
        version = None
        try:
            if self._unreported:
                self.report_refusals()
            version = published_version(self._client, self._run)
            if version is None or version in (self.version, self._refused):
                return self._current
            with self._lock:
                # read again: another session may have loaded a newer version since, which would make this
                # thread's read look like a record written back over it
                version = published_version(self._client, self._run)
                if version is None or version in (self.version, self._refused):
                    return self._current
                self._current = self._load(version) or self._current
        except redis.RedisError as error:
            log.warning("cannot refresh weights (%s); acting with version %s", error, self.version)
        except ValueError as error:  # a malformed weights record (a WeightsRecordError names why)
            self._refuse(version, getattr(error, "reason", "malformed"), error)
        return self._current

    def _load(self, version: int) -> VersionedPolicy | None:
        if self._rolled_back(version):
            return None
        published = fetch_weights(self._client, self._run, self._key)
        # the record may have changed since its version was read
        if published is None or self._rolled_back(published.version):
            return None
        try:
            network = load_policy(published.spec, published.blob, self._device, self._rng, self._network)
        except ValueError as error:  # a spec or blob we cannot act with
            self._refuse(published.version, "not_loadable", error)
            return None
        log.info("loaded policy version %d", published.version)
        return VersionedPolicy(published.version, network)

    def report_refusals(self) -> None:
        """Add the refusals not yet counted to the run's counters (``weights_refused_<reason>``); after each
        refusal, and as the rollout stops."""
        with self._lock:
            add_stats(
                self._client, self._run, **{f"weights_refused_{k}": n for k, n in self._unreported.items()}
            )
            self._unreported.clear()

    def _rolled_back(self, version: int) -> bool:
        """Whether ``version`` is below the one this rollout acts with: refused, counted (the trainer only
        publishes upwards; an older record is one written back over its own)."""
        if self.version is None or version >= self.version:
            return False
        error = WeightsRecordError(
            f"a weights record of version {version}, below the {self.version} this "
            "rollout acts with (written back over the trainer's)",
            "rolled_back",
        )
        self._refuse(version, "rolled_back", error)
        return True

    def _refuse(self, version: int | None, reason: str, error: Exception) -> None:
        """Count a refused record; log it once, not on every chunk while it stays in Redis."""
        message = f"{type(error).__name__}: {error}"
        if (version, message) != (self._refused, self._refused_reason):
            self.refused[reason] += 1
            self._unreported[reason] += 1
            log.warning(
                "refusing policy version %s (%s); acting with version %s", version, message, self.version
            )
        self._refused, self._refused_reason = version, message

    @property
    def rejected(self) -> int:
        """Weights refused, all reasons."""
        return sum(self.refused.values())

    @property
    def version(self) -> int | None:
        return None if self._current is None else self._current.version
