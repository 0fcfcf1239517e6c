"""Periodic evaluation (``trainer.evaluation``): every ``every_updates`` updates, the policy just published plays
whole episodes on the run's evaluation env service (``env --role eval``: registered as ``eval_env``, which the
rollouts never use, so evaluation episodes never reach the experience stream), in a thread of its own while
learning goes on. The mean and spread of the returns go to the trainer's log, its status (``eval_return_mean``,
for ``status`` and Prometheus) and TensorBoard (``eval/episodic_return``). A policy whose mean return is above
every earlier evaluation's of the run (a resumed one included) is kept as ``checkpoints/best.pt``, beside the
latest checkpoints: a run whose policy got worse later still has its best one, for ``eval --best`` and
``export --best``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis

from tinker_atropos.config import Config
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.environment.episodes import equal_shares
from tinker_atropos.models.acting import InferencePolicy, load_policy
from tinker_atropos.state.checkpoint_files import BEST, read_checkpoint, save_best
from tinker_atropos.state.registry import live_services
from tinker_atropos.trainer.tensorboard import TensorBoardLog
from tinker_atropos.training.core import TrainingCore

log = logging.getLogger(__name__)


class PeriodicEvaluation:
    def __init__(
        self, config: Config, client: redis.Redis, tensorboard: TensorBoardLog | None, checkpoint_dir: Path
    ) -> None:
        """Of ``config``: ``trainer.evaluation``, the run's name and seed, and the policy network to load."""
        self.section, self.client, self.run = config.trainer.evaluation, client, config.run.name
        self.network, self.seed = config.trainer.model.network, config.run.seed
        self.tensorboard, self.checkpoint_dir = tensorboard, checkpoint_dir
        self.version, self.return_mean, self.return_std = 0, 0.0, 0.0  # of the latest evaluation
        self.best_version, self.best_return = 0, -math.inf  # of the best one, kept in best.pt
        self._thread: threading.Thread | None = None
        self._missing_logged = False
        if self.section.every_updates:
            self._read_best()

    def _read_best(self) -> None:
        """The best evaluation of the run so far, from its best.pt: a resumed run keeps it unless it beats it."""
        path = self.checkpoint_dir / BEST
        if not path.exists():
            return
        try:
            state = read_checkpoint(path)
            self.best_version = int(state["policy"]["version"])
            self.best_return = float(state["evaluation"]["return_mean"])
        except Exception as error:  # any unpickling failure, or a file of something else
            log.warning("%s is unreadable (%s); the next evaluation replaces it", path, error)

    def figures(self) -> dict[str, Any]:
        """Its fields of the trainer's status: the latest evaluation and the best one (0 before any)."""
        return {
            "eval_policy_version": self.version,
            "eval_return_mean": self.return_mean,
            "eval_return_std": self.return_std,
            "eval_best_policy_version": self.best_version,
            "eval_best_return_mean": self.best_return if self.best_version else 0.0,
        }

    def after_update(self, updates: int, core: TrainingCore) -> None:
        """Start an evaluation of the core's version when one is due and none is running (a slow one is not
        queued): its weights are copied now, learning goes on."""
        every = self.section.every_updates
        if not every or updates % every or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(
            target=self._evaluate,
            args=(core.version, core.spec, core.weights()),
            name="evaluation",
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _evaluate(self, version: int, spec: dict[str, Any], weights: bytes) -> None:
        try:
            services = live_services(self.client, self.run, "eval_env")
        except redis.RedisError as error:
            log.warning("no evaluation of version %d: the registry is unreadable (%s)", version, error)
            return
        if not services:
            if not self._missing_logged:
                log.warning(
                    "trainer.evaluation is on, but run %r has no evaluation env service (`tinker-atropos "
                    "env --role eval`; `up` starts one)",
                    self.run,
                )
                self._missing_logged = True
            return
        rng = np.random.default_rng(self.seed + version)
        policy = load_policy(spec, weights, "cpu", rng, self.network)
        try:
            returns = self._play(services[0].address, policy, version)
        except grpc.RpcError as error:  # the eval env service went away or is busy: the next one will try
            log.warning(
                "evaluation of version %d stopped: %s: %s", version, error.code().name, error.details()
            )
            return
        self.version = version
        self.return_mean, self.return_std = float(np.mean(returns)), float(np.std(returns))
        log.info(
            "evaluation of policy version %d: mean return %.1f ± %.1f over %d episodes",
            version,
            self.return_mean,
            self.return_std,
            len(returns),
        )
        if self.return_mean > self.best_return:
            self._keep_best(version, spec, weights, returns)
        if self.tensorboard is not None:
            with contextlib.suppress(redis.RedisError):
                self.tensorboard.add_evaluation(self.return_mean, self.return_std)

    def _keep_best(self, version: int, spec: dict[str, Any], weights: bytes, returns: list[float]) -> None:
        evaluation = {
            "return_mean": self.return_mean,
            "return_std": self.return_std,
            "episodes": len(returns),
            "deterministic": self.section.deterministic,
        }
        try:
            path = save_best(
                self.checkpoint_dir,
                {"policy": {"spec": spec, "version": version, "weights": weights}, "evaluation": evaluation},
            )
        except OSError as error:  # a full or read-only disk: the best stays the one before, tried again later
            log.warning("cannot write the best checkpoint (%s: %s)", error.filename, error.strerror)
            return
        self.best_version, self.best_return = version, self.return_mean
        log.info("%s: policy version %d, the best evaluation so far", path, version)

    def _play(self, address: str, policy: InferencePolicy, version: int) -> list[float]:
        """Whole episodes on every free instance of the eval env service, an equal share each."""
        with EnvClient(address) as client:
            env = client.describe()
            session = client.open(0, self.seed + version * 1000)
            try:
                owed = equal_shares(self.section.episodes, session.num_instances)
                obs, returns = session.observations, []
                while owed.any():
                    actions, _, _ = policy.act(obs, deterministic=self.section.deterministic)
                    step = session.step(actions.astype(env.action_dtype, copy=False))
                    for end in step.episodes:
                        if owed[end.instance] > 0:
                            owed[end.instance] -= 1
                            returns.append(end.episode_return)
                    obs = step.observations
                return returns
            finally:
                session.close()
