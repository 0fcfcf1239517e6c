"""The experience loop's checkpoints: their format, writing one, resuming from the latest, and the version it goes
on from (above newer weights in Redis, or above a version the rollouts hold when Redis lost the weights).

A checkpoint holds plain data (tensors, numbers, dicts): it loads wherever the classes move. An off-policy
learner's replay buffer is kept in the journal's segments beside it (``state/replay_journal.py``), each written
before the checkpoint that counts it. On resume, weights in Redis newer than the checkpoint (a trainer killed
between checkpoints) are continued from, so that the version only goes up. A checkpoint that the disk refuses
(full, read-only) is counted and retried while learning goes on; before each one the run folder is checked to be
still its run's (``RunFolderOwner``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import redis

from tinker_atropos.algorithms.base import Learner
from tinker_atropos.config import Config
from tinker_atropos.models.weight_bytes import load_weights
from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.state.checkpoints import load_latest_checkpoint, save_checkpoint
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.replay_journal import ReplayJournal
from tinker_atropos.state.run_dir import FolderWrites, RunFolderOwner
from tinker_atropos.state.weights import fetch_weights

log = logging.getLogger(__name__)

# {"format", "algorithm", "learner": Learner.state_dict(), "replay", "policy", "counters", "freshness"}; "replay" is
# None or {"added": N}, the buffer's transitions being in the journal's segments (format 2 held them in the file);
# "freshness": Freshness.state_dict(), the records taken (format 4 on)
CHECKPOINT_FORMAT = 4


class Checkpointing:
    def __init__(self, config: Config, run_dir: Path, algorithm: str, owner: RunFolderOwner | None) -> None:
        self.policy, self.algorithm, self.owner = config.trainer.checkpoint, algorithm, owner
        self.writes = FolderWrites("checkpoint", "learning goes on without checkpoints")
        self.directory = run_dir / "checkpoints"
        self.journal = ReplayJournal(self.directory / "replay")  # used by an off-policy learner only
        self._journaled = 0  # the replay buffer's transitions numbered below this are in the journal
        self._last = time.monotonic()

    def due(self, updates: int) -> bool:
        """Whether a checkpoint is due after ``updates`` (by count or by time), and the disk is not being waited
        out after a refusal."""
        overdue = time.monotonic() - self._last >= self.policy.every_seconds
        return (overdue or updates % self.policy.every_updates == 0) and self.writes.due()

    def resume(self, learner: Learner) -> dict[str, Any] | None:
        """Load the latest checkpoint into ``learner`` and refill its replay buffer; the checkpoint, for its
        counters and freshness. None when there is none, or it is of another algorithm, model or layout: then
        the learner starts fresh above its version."""
        restored = load_latest_checkpoint(self.directory)
        if restored is None:
            self._restore_replay(learner, None)
            return None
        path, state = restored
        core = state["learner"].get("core", {}) if state.get("format", 1) >= 2 else {}
        version = core.get("version", state.get("counters", {}).get("version", 0))  # format 1: in counters
        if state.get("algorithm") != self.algorithm or core.get("spec") != learner.core.spec:
            log.warning("checkpoint %s is of another algorithm, model or layout; starting fresh above its "
                        "version %d", path, version)  # fmt: skip
            learner.core.version = version + 1
            self._restore_replay(learner, None)
            return None
        learner.load_state_dict(state["learner"])
        self._restore_replay(learner, state.get("replay"))
        log.info("resumed from %s at policy version %d", path, learner.core.version)
        return state

    def _restore_replay(self, learner: Learner, saved: dict[str, Any] | None) -> None:
        """Refill an off-policy learner's buffer as the checkpoint left it, and drop journal segments written
        after it (``saved`` None: the buffer starts empty, the whole journal is dropped)."""
        replay = learner.replay
        if replay is None:
            return
        if saved is not None and "rewards" in saved:  # format 2: the transitions inside the checkpoint
            columns = {name: rows.numpy() for name, rows in saved.items()}
            added = len(columns["rewards"])
            self.journal.append(0, columns)  # so that the next checkpoint's segment follows on
        else:
            added = saved["added"] if saved is not None else 0
            columns = self.journal.restore(added, replay.capacity)
        if columns is not None:
            replay.refill(columns, added)
            log.info("replay buffer restored: %d transitions", len(replay))
        replay.added = self._journaled = added

    def state(self, learner: Learner, counters: dict[str, int], freshness: Freshness) -> dict[str, Any]:
        """What a checkpoint holds (``CHECKPOINT_FORMAT``)."""
        core = learner.core
        return {
            "format": CHECKPOINT_FORMAT,
            "algorithm": self.algorithm,
            "learner": learner.state_dict(),
            "replay": None if learner.replay is None else {"added": learner.replay.added},
            # the acting policy as the rollouts receive it: what `tinker-atropos eval` and `export` load
            "policy": {"spec": core.spec, "version": core.version, "weights": core.weights()},
            "counters": counters,
            "freshness": freshness.state_dict(),
        }

    def save(self, learner: Learner, counters: dict[str, int], freshness: Freshness) -> bool:
        """Write a checkpoint, unless the run folder now belongs to another run (RunFolderInUse). A disk that
        refuses it costs this checkpoint only: counted, said once, retried (``writes``). Whether it was written."""
        if self.owner is not None:
            self.owner.check()
        written = self.writes.attempt(self.directory, lambda: self._write(learner, counters, freshness))
        if written:
            self._last = time.monotonic()
        return written

    def _write(self, learner: Learner, counters: dict[str, int], freshness: Freshness) -> None:
        """The journal's new segment first, then the checkpoint that counts it: a crash between the two leaves a
        segment past the latest checkpoint, which the next resume deletes."""
        replay = learner.replay
        if replay is not None:
            columns = replay.since(self._journaled)  # fewer than asked when the journal fell a buffer behind
            self.journal.append(replay.added - len(columns["rewards"]), columns)
            self._journaled = replay.added
        state = self.state(learner, counters, freshness)
        path = save_checkpoint(self.directory, learner.core.version, state, self.policy.keep)
        if replay is not None:
            self.journal.prune(replay.added, replay.capacity)
        log.info("checkpoint %s", path.name)


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
        core.version = published.version + 1
        return
    try:
        load_weights(core.model, published.blob)
    except ValueError as error:  # a NaN in them, or bytes that are not weights: never adopted
        log.warning("not adopting version %d from Redis (%s); continuing above it", published.version, error)
        core.version = published.version + 1
        return
    log.info("continuing from the weights of version %d found in Redis", published.version)
    core.version = published.version


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
        log.warning("rollouts act with policy version %d, above this trainer's %d (its newer weights were lost with "
                    "Redis's data); continuing at version %d", ahead, core.version, ahead + 1)  # fmt: skip
        core.version = ahead + 1
    return True
