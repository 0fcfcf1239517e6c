"""The experience loop's learner and how it updates: the algorithm's learner built for the env's spaces, its
data-parallel replicas (``trainer.learners`` > 1), and the non-finite guard around each update, which undoes one
that leaves a NaN or an infinity in the loss or the parameters (the replicas taken back with it) and stops the
trainer after ``trainer.max_nonfinite_updates`` in a row."""

from __future__ import annotations

import logging
from pathlib import Path

from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.algorithms.base import Learner, LearnerSetup
from tinker_atropos.config import Config
from tinker_atropos.device import resolve_device
from tinker_atropos.environment.client import EnvDescription
from tinker_atropos.errors import FatalError
from tinker_atropos.protocol.trajectory import Trajectory
from tinker_atropos.trainer.learner_replicas import Replicas
from tinker_atropos.training.guard import NonfiniteGuard

log = logging.getLogger(__name__)


class TrainingDiverged(FatalError):
    """Updates kept coming out non-finite: restarting would not help, the config or the data must change."""


class Updater:
    def __init__(self, config: Config, learners_folder: Path) -> None:
        self.config, self.learners_folder = config, learners_folder  # where CUDA learners meet (``Replicas``)
        self.device = resolve_device(config.trainer.device)
        self.algorithm = algorithms.algorithm(config.trainer.algorithm)
        self.learner: Learner | None = None
        self.replicas: Replicas | None = None  # the other data-parallel learners
        self.guard = NonfiniteGuard()  # counts the updates it undid: ``updates_discarded_nonfinite``
        self._setup: LearnerSetup | None = None

    def build(self, env: EnvDescription) -> Learner:
        """The algorithm's learner for the env's spaces; FatalError, one line, for spaces it cannot act in or a
        user network that does not fit."""
        trainer = self.config.trainer
        self._setup = LearnerSetup(
            env.observation_space,
            env.action_space,
            trainer,
            trainer.hyperparameters,
            self.device,
            self.config.run.seed,
            env.observation_layout,
        )
        try:
            self.learner = self.algorithm.build(self._setup)
        except ValueError as error:
            raise FatalError(
                f"trainer.algorithm {self.algorithm.name!r} cannot learn {self.config.env.id}: {error}"
            ) from None
        return self.learner

    def start_replicas(self) -> None:
        """The other learners, from this one's state once it is resumed."""
        assert self.learner is not None and self._setup is not None
        self.replicas = Replicas.beside(self.learner, self._setup, self.learners_folder)

    def learn(self, trajectories: list[Trajectory]) -> dict[str, float] | None:
        """One update, each learner on its share of the batch; its losses, or None when it was undone (the
        learner's whole state restored). TrainingDiverged after ``max_nonfinite_updates`` in a row."""
        learner = self.learner
        assert learner is not None
        if self.replicas is not None:  # each learner its share of the batch; this one learns from its own
            trajectories = self.replicas.learn(trajectories)
        losses, bad = self.guard.update(learner.core, learner, lambda: learner.learn(trajectories))
        if not bad:
            return losses
        if self.replicas is not None:  # they took the update too: they go back with this learner
            self.replicas.load(learner.state_dict())
        limit = self.config.trainer.max_nonfinite_updates
        log.warning(
            "update undone: NaN or infinity in %s (%d in a row; the trainer stops at %d)",
            ", ".join(bad),
            self.guard.in_a_row,
            limit,
        )
        if self.guard.in_a_row >= limit:
            raise TrainingDiverged(
                f"{limit} updates in a row came out NaN or infinite (the last in {', '.join(bad)}); the "
                f"parameters are those of policy version {learner.core.version}: lower the learning rate "
                "or check the env's rewards and observations"
            )
        return None

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
