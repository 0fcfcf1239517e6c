"""Where the experience loop's policy goes out to the rollouts: each version published to Redis signed with the run's
weights key, never below the version already there; published again when Redis lost it (restarted without
persistence) or missed the last publication; on start, newer weights found in Redis adopted rather than older
parameters, and a version a live rollout acts with that Redis lost continued above. The rollouts refuse weights
older than those they act with, so the run's versions only rise (``TrainingCore.continue_above``)."""

from __future__ import annotations

import functools
import logging

import redis

from tinker_atropos.algorithms.base import Learner
from tinker_atropos.models.weight_bytes import load_weights
from tinker_atropos.security import signing_key
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, verified_version
from tinker_atropos.training.core import TrainingCore

log = logging.getLogger(__name__)


class PolicyPublisher:
    """The run's weights record in Redis, as the experience loop keeps it current."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client, self.run = client, run
        self.key = signing_key("weights")  # what the rollouts check the published weights against

    def publish(self, core: TrainingCore) -> None:
        """Publish the core's version, or above it when another driver (a Tinker client's policy) published a
        higher one: the core continues from the version published."""
        wanted = core.version
        core.publish_weights(functools.partial(publish_weights, self.client, self.run, key=self.key))
        if core.version != wanted:
            log.warning(
                "Redis holds a policy version at or above %d; published as version %d", wanted, core.version
            )

    def adopt_newer(self, learner: Learner) -> None:
        adopt_newer_weights(self.client, self.run, self.key, learner)

    def keep_current(self, learner: Learner, ahead: int) -> bool:
        """Continue above ``ahead`` (a version rollouts reported acting with) if a live rollout holds it, then
        publish again if Redis lacks the core's version or holds weights that are not this run's. Whether ``ahead``
        was dealt with (the registry read)."""
        core = learner.core
        try:
            published = verified_version(self.client, self.run, self.key)
        except ValueError as error:  # a malformed record, or one this trainer did not sign: replace it
            log.warning(
                "the weights in Redis are not this run's (%s); publishing version %d over them",
                error,
                core.version,
            )
            published = None
        dealt = ahead > core.version and continue_above_rollouts(self.client, self.run, ahead, learner)
        if published is None or published < core.version:
            log.info("Redis lacks policy version %d; publishing it again", core.version)
            self.publish(core)
        return dealt


def adopt_newer_weights(client: redis.Redis, run: str, key: bytes | None, learner: Learner) -> None:
    """Weights in Redis newer than the checkpoint (a trainer killed between checkpoints) are the policy the
    rollouts act with: continue from them rather than from older parameters, so a restart loses only the
    optimizer moments since the checkpoint and the version stays monotonic."""
    core = learner.core
    try:
        published = fetch_weights(client, run, key)
    except ValueError as error:  # a malformed record: nothing to continue from, the next publish replaces it
        log.warning("the weights record in Redis is malformed (%s); publishing over it", error)
        return
    if published is None or published.version <= core.version:
        return
    if published.spec != core.spec:
        log.warning("Redis holds version %d of another model; continuing above it", published.version)
        core.continue_above(published.version)
        return
    try:
        load_weights(core.model, published.blob)
    except ValueError as error:  # a NaN in them, or bytes that are not weights: never adopted
        log.warning("not adopting version %d from Redis (%s); continuing above it", published.version, error)
        core.continue_above(published.version)
        return
    log.info("continuing from the weights of version %d found in Redis", published.version)
    core.continue_above(published.version, adopt=True)


def continue_above_rollouts(client: redis.Redis, run: str, ahead: int, learner: Learner) -> bool:
    """Rollouts refuse weights older than those they act with. Chunks acted by a version above the trainer's
    (up to ``ahead``), which a live rollout reports holding, mean that it resumed from a checkpoint while Redis had
    lost the newer weights: it continues above that version, so that the rollouts take its next one. (The version
    of a chunk alone is not enough: a holder of the token may write any.) Whether the registry could be read (if
    not, the next sync asks again)."""
    core = learner.core
    try:
        rollouts = live_services(client, run, "rollout")
        held = max((int(r.figures.get("policy_version") or 0) for r in rollouts), default=0)
    except redis.RedisError:
        return False
    except (ValueError, TypeError):  # a registry entry written by something else
        held = 0
    ahead = min(ahead, held)
    if ahead > core.version:
        log.warning(
            "rollouts act with policy version %d, above this trainer's %d (its newer weights were lost with "
            "Redis's data); continuing at version %d",
            ahead,
            core.version,
            ahead + 1,
        )
        core.continue_above(ahead)
    return True
