"""The trainer's checkpoints: the one ``Checkpointer`` that writes every driver's (``driver.py``) on one cadence, and
the experience loop's own format (``ExperienceState``), with the version it goes on from (above newer weights in
Redis, or above a version the rollouts hold when Redis lost the weights).

The checkpointer asks a driver for its state (``save``) once ``trainer.checkpoint.every_updates`` of its steps or
``every_seconds`` have passed since the last one, writes it atomically as ``checkpoint-VERSION.pt`` in the driver's
folder, keeps the newest ``keep`` of them, and at stop writes a last one. Before each write the run folder is
checked to be still its run's (``RunFolderOwner``: RunFolderInUse otherwise); a write the disk refuses (full,
read-only) is counted and retried while learning goes on. On start the newest checkpoint that loads (a corrupt one
skipped; else the single file an earlier version wrote) goes back into the driver (``restore``), which reads the
formats its earlier versions wrote.

A checkpoint holds plain data (tensors, numbers, dicts): it loads wherever the classes move. An off-policy
learner's replay buffer is kept in the journal's segments beside it (``state/replay_journal.py``), each written
before the checkpoint that counts it. On resume, weights in Redis newer than the checkpoint (a trainer killed
between checkpoints) are continued from, so that the version only goes up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from tinker_atropos.algorithms.base import Learner
from tinker_atropos.config import CheckpointSection
from tinker_atropos.protocol.freshness import Freshness
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.state.checkpoint_files import load_latest_checkpoint, read_checkpoint, save_checkpoint
from tinker_atropos.state.experience import add_stats
from tinker_atropos.state.replay_journal import ReplayJournal
from tinker_atropos.state.run_dir import FolderWrites, RunFolderInUse, RunFolderOwner
from tinker_atropos.trainer.figures import write_figures
from tinker_atropos.training.driver import Checkpoint, Driver

log = logging.getLogger(__name__)

# {"format", "algorithm", "learner": Learner.state_dict(), "replay", "policy", "counters", "freshness"}; "replay" is
# None or {"added": N}, the buffer's transitions being in the journal's segments (format 2 held them in the file);
# "freshness": Freshness.state_dict(), the records taken (format 4 on)
CHECKPOINT_FORMAT = 4


class Checkpointer:
    """One driver's checkpoints in ``folder``: resumed from on start, written on the cadence of
    ``trainer.checkpoint`` (``save``, asked ten times a second by the trainer service) and once more at stop (``close``).
    ``earlier``: the name of the single file an earlier version of the driver kept there, resumed from when no
    checkpoint is."""

    def __init__(
        self,
        driver: Driver,
        folder: Path,
        policy: CheckpointSection,
        owner: RunFolderOwner | None,
        client: redis.Redis | None = None,
        run: str = "",
        earlier: str | None = None,
    ) -> None:
        self.driver, self.folder, self.policy, self.owner = driver, folder, policy, owner
        self.client, self.run, self.earlier = client, run, earlier
        self.writes = FolderWrites("checkpoint", "learning goes on without checkpoints")
        self._last = time.monotonic()
        self._saved_at = 0  # the driver's progress at its last checkpoint

    def resume(self) -> Path | None:
        """The newest checkpoint that loads, into the driver; which one, None when there is none."""
        found = load_latest_checkpoint(self.folder)
        if found is None and self.earlier is not None and (self.folder / self.earlier).exists():
            path = self.folder / self.earlier
            found = path, read_checkpoint(path)
        if found is None:
            return None
        path, state = found
        self.driver.restore(state, path)
        return path

    def due(self) -> bool:
        """Whether a checkpoint is due: ``every_updates`` steps since the last one, or ``every_seconds`` and a step,
        or a refused one to retry; never while the disk is waited out after a refusal."""
        steps = self.driver.progress() - self._saved_at
        overdue = time.monotonic() - self._last >= self.policy.every_seconds
        wanted = steps >= self.policy.every_updates or (steps > 0 and overdue) or self.writes.error != ""
        return wanted and self.writes.due()

    def save(self, force: bool = False) -> bool:
        """Write a checkpoint when one is due (``force``: now), unless the run folder now belongs to another run
        (RunFolderInUse). A disk that refuses it costs this checkpoint only: counted, said once, retried. Whether
        one was written."""
        if not (force or self.due()):
            return False
        if self.owner is not None:
            self.owner.check()
        progress = self.driver.progress()
        written = self.writes.attempt(self.folder, self._write)
        if written:
            self._last, self._saved_at = time.monotonic(), progress
        elif self.client is not None:
            with contextlib.suppress(redis.RedisError):  # Redis away: counted in the status only
                add_stats(self.client, self.run, checkpoints_failed=self.writes.take_unreported())
        return written

    def _write(self) -> None:
        # may write first what the checkpoint counts (a replay journal segment)
        checkpoint = self.driver.save()
        if checkpoint is None:
            return
        path = save_checkpoint(self.folder, checkpoint.version, checkpoint.state, self.policy.keep)
        if checkpoint.written is not None:
            checkpoint.written()
        log.info("checkpoint %s", path.name)

    def close(self) -> None:
        """A last checkpoint, once the driver stopped; none when the run folder is another run's now."""
        try:
            self.save(force=True)
        except RunFolderInUse as error:
            log.warning("no final checkpoint: %s", error)

    def status(self) -> services_pb2.TrainerStatus:
        return services_pb2.TrainerStatus(**write_figures(self.writes))


def snapshot(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, tuples of tensors, arrays, numbers) that later steps leave alone, its
    tensors on the CPU: what a driver's ``save`` returns."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(item) for item in value)
    return value


class ExperienceState:
    """The experience loop's checkpoints (format 4 and the ones before): what one holds, the learner and its
    replay buffer back from one, and the replay journal beside them."""

    def __init__(self, folder: Path, algorithm: str) -> None:
        self.folder, self.algorithm = folder, algorithm
        self.journal = ReplayJournal(folder / "replay")  # used by an off-policy learner only
        self._journaled = 0  # the replay buffer's transitions numbered below this are in the journal

    def restore(
        self, learner: Learner, state: dict[str, Any] | None, source: Path | None
    ) -> dict[str, Any] | None:
        """Load checkpoint ``state`` into ``learner`` and refill its replay buffer; ``state``, for its counters and
        freshness. None when there is none, or it is of another algorithm, model or layout: then the learner
        starts fresh above its version."""
        if state is None:
            self._restore_replay(learner, None)
            return None
        core = state["learner"].get("core", {}) if state.get("format", 1) >= 2 else {}
        version = core.get("version", state.get("counters", {}).get("version", 0))  # format 1: in counters
        if state.get("algorithm") != self.algorithm or core.get("spec") != learner.core.spec:
            log.warning(
                "checkpoint %s is of another algorithm, model or layout; starting fresh above its version %d",
                source,
                version,
            )
            learner.core.continue_above(version)
            self._restore_replay(learner, None)
            return None
        learner.load_state_dict(state["learner"])
        self._restore_replay(learner, state.get("replay"))
        log.info("resumed from %s at policy version %d", source, learner.core.version)
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

    def checkpoint(self, learner: Learner, counters: dict[str, int], freshness: Freshness) -> Checkpoint:
        """The journal's new segment written first, then the checkpoint that counts it (a copy); once that is on
        disk, the segments it no longer needs pruned. A crash between the two leaves a segment past the latest
        checkpoint, which the next resume deletes."""
        replay = learner.replay
        written = None
        if replay is not None:
            columns = replay.since(self._journaled)  # fewer than asked when the journal fell a buffer behind
            self.journal.append(replay.added - len(columns["rewards"]), columns)
            self._journaled = added = replay.added
            written = functools.partial(self.journal.prune, added, replay.capacity)
        state = snapshot(self.state(learner, counters, freshness))
        return Checkpoint(learner.core.version, state, written)
