"""TensorBoard event files for researchers, written by the trainer to ``RUN_DIR/tensorboard`` (``tensorboard
--logdir runs``): the tags CleanRL and SB3 users know, against the run's env steps as the global step.

    charts/episodic_return, charts/episodic_length   every episode the rollouts finished (from the run's
                                                     episode list in Redis, each written once)
    charts/SPS                                       env steps collected per second, over the last interval
    charts/policy_version, charts/trainer_busy, charts/policy_lag_mean, charts/updates
    losses/<name>                                    the algorithm's latest losses (policy_loss, value_loss, …)
    eval/episodic_return, eval/episodic_return_std   each periodic evaluation (``trainer.evaluation``)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from tinker_atropos.config import WandbSection
from tinker_atropos.runtime import FatalError
from tinker_atropos.state.experience import read_stats, recent_episodes

CHARTS_INTERVAL_S = 5.0  # between two points of the charts other than the episodes
MAX_EPISODES_PER_LOOK = 1000  # beyond, the oldest of a burst are skipped (the run's list keeps fewer anyway)


class TensorBoardLog:
    """With ``wandb`` enabled, the same events are mirrored to Weights & Biases (``sync_tensorboard``), under the
    run's name, with the resolved config; wandb is imported only then."""

    def __init__(self, log_dir: Path, client: redis.Redis, run: str, wandb: WandbSection | None = None,
                 config: dict[str, Any] | None = None) -> None:  # fmt: skip
        from torch.utils.tensorboard import SummaryWriter

        self._wandb_run = (
            _start_wandb(wandb, log_dir.parent, run, config) if wandb and wandb.enabled else None
        )
        self.writer = SummaryWriter(str(log_dir), flush_secs=10)
        self.client, self.run = client, run
        self._episodes_seen: int | None = None  # the run's episode count at the last look
        self._last_chart: tuple[float, int] | None = None  # (time, env steps) of the last charts point

    def look(
        self, version: int, updates: int, busy: float, lag_mean: float, losses: dict[str, float]
    ) -> None:
        """Write the episodes finished since the last look; the charts too, every ``CHARTS_INTERVAL_S``.
        The first look only takes note: episodes from before this trainer started were written by its
        predecessor (or are too old to place on the curve)."""
        stats = read_stats(self.client, self.run)
        steps, episodes = int(stats.get("env_steps", 0)), int(stats.get("episodes", 0))
        if self._episodes_seen is not None and episodes > self._episodes_seen:
            new = recent_episodes(
                self.client, self.run, min(episodes - self._episodes_seen, MAX_EPISODES_PER_LOOK)
            )
            for episode in reversed(new):  # oldest first
                self.writer.add_scalar("charts/episodic_return", episode["return"], steps)
                self.writer.add_scalar("charts/episodic_length", episode["length"], steps)
        self._episodes_seen = episodes
        now = time.monotonic()
        if self._last_chart is not None and now - self._last_chart[0] < CHARTS_INTERVAL_S:
            return
        if self._last_chart is not None:
            then, steps_then = self._last_chart
            self.writer.add_scalar("charts/SPS", (steps - steps_then) / (now - then), steps)
        self._last_chart = (now, steps)
        charts = {
            "policy_version": version,
            "updates": updates,
            "trainer_busy": busy,
            "policy_lag_mean": lag_mean,
        }
        for name, value in charts.items():
            self.writer.add_scalar(f"charts/{name}", value, steps)
        for name, value in losses.items():
            self.writer.add_scalar(f"losses/{name}", value, steps)

    def add_evaluation(self, return_mean: float, return_std: float) -> None:
        """A periodic evaluation's result, at the run's env steps now."""
        steps = int(read_stats(self.client, self.run).get("env_steps", 0))
        self.writer.add_scalar("eval/episodic_return", return_mean, steps)
        self.writer.add_scalar("eval/episodic_return_std", return_std, steps)

    def close(self) -> None:
        self.writer.close()
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            # finish() returns before wandb's service has written the run's file (offline: often only its
            # header); teardown waits for it, so a process stopped right after loses nothing
            wandb.teardown()


def _start_wandb(section: WandbSection, run_dir: Path, run: str, config: dict[str, Any] | None) -> Any:
    """A W&B run mirroring the event files written after it (it patches TensorBoard's writer: start it first)."""
    try:
        import wandb
    except ImportError:
        raise FatalError("trainer.wandb.enabled needs wandb: pip install 'tinker-atropos[wandb]'") from None
    return wandb.init(project=section.project, entity=section.entity, mode=section.mode, dir=str(run_dir),
                      name=run, config=config, sync_tensorboard=True)  # fmt: skip
