"""TensorBoard event files for researchers, written by the trainer to ``RUN_DIR/tensorboard`` (``tensorboard
--logdir runs``): one log per trainer, shared by its drivers (``trainer/service.py`` opens it, so a W&B mirror is
one run). A control run's tags are those CleanRL and SB3 users know, against the run's env steps as the global step:

    charts/episodic_return, charts/episodic_length   every episode the rollouts finished (from the run's
                                                     episode list in Redis, each written once)
    charts/SPS                                       env steps collected per second, over the last interval
    charts/policy_version, charts/trainer_busy, charts/policy_lag_mean, charts/updates
    losses/<name>                                    the algorithm's latest losses (policy_loss, value_loss, …)
    eval/episodic_return, eval/episodic_return_std   each periodic evaluation (``trainer.evaluation``)

A language model's (the Atropos loop, ``LANGUAGE_MODEL_TAGS``), those TRL and verl users read, against its
optimizer step: reward/mean and reward/std over a batch's answers, answers/length_mean (tokens),
policy/kl_sampler_learner, policy/entropy and policy/clip_fraction, train/loss and train/grad_norm,
throughput/sampled_tokens_per_s and throughput/trained_tokens_per_s, time/step_s and time/weight_sync_s, and
every ``eval/...`` figure of its evaluations as it is named. A Tinker client's model: tinker/<model id>/loss,
tinker/<model id>/tokens and tinker/<model id>/grad_norm, against that model's optimizer step.

A disk that refuses the event file (full, read-only) pauses it: said once, counted, retried every
``run_dir.RETRY_S`` with a new event file, the episodes finished meanwhile written then (the run's list keeps the
latest 1,000); learning never waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from tinker_atropos.config import Config, WandbSection
from tinker_atropos.errors import FatalError
from tinker_atropos.state.experience import read_stats, recent_episodes
from tinker_atropos.state.run_dir import FolderWrites

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

CHARTS_INTERVAL_S = 5.0  # between two points of the charts other than the episodes
MAX_EPISODES_PER_LOOK = 1000  # beyond, the oldest of a burst are skipped (the run's list keeps fewer anyway)
EVALUATION = "eval/"  # an evaluation's figures: written under their own names

# a language model's step figures (the Atropos loop's, as its status reports them) -> their tags
LANGUAGE_MODEL_TAGS = {
    "score_mean": "reward/mean",
    "score_std": "reward/std",
    "answer_tokens_mean": "answers/length_mean",
    "kl_sampler_learner": "policy/kl_sampler_learner",
    "entropy": "policy/entropy",
    "clip_fraction": "policy/clip_fraction",
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "sampled_tokens_per_s": "throughput/sampled_tokens_per_s",
    "trained_tokens_per_s": "throughput/trained_tokens_per_s",
    "step_seconds": "time/step_s",
    "weight_sync_seconds": "time/weight_sync_s",
}


def language_model_points(figures: Mapping[str, float]) -> dict[str, float]:
    """The figures that have a tag (``LANGUAGE_MODEL_TAGS``, or an evaluation's own ``eval/...`` name), by tag."""
    points = {
        LANGUAGE_MODEL_TAGS[name]: value for name, value in figures.items() if name in LANGUAGE_MODEL_TAGS
    }
    return points | {name: value for name, value in figures.items() if name.startswith(EVALUATION)}


class TensorBoardLog:
    """With ``wandb`` enabled, the same events are mirrored to Weights & Biases (``sync_tensorboard``), under the
    run's name, with the resolved config; wandb is imported only then."""

    def __init__(
        self,
        log_dir: Path,
        client: redis.Redis,
        run: str,
        wandb: WandbSection | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self._wandb_run = (
            _start_wandb(wandb, log_dir.parent, run, config) if wandb and wandb.enabled else None
        )
        _quiet_writer_threads()
        self.log_dir = log_dir
        self.writes = FolderWrites("TensorBoard events", "learning goes on without them")
        self.writer: SummaryWriter | None = None
        self._lock = threading.Lock()  # evaluations write from their own thread
        self.client, self.run = client, run
        self._episodes_seen: int | None = None  # the run's episode count at the last look written
        self._last_chart: tuple[float, int] | None = None  # (time, env steps) of the last charts point
        with self._lock:
            self._open()

    def _open(self) -> SummaryWriter | None:
        """The event file's writer, a new one if the last one died of a disk error and a retry is due; None
        meanwhile. Called with the lock held."""
        from torch.utils.tensorboard import SummaryWriter

        def open_writer() -> None:
            self.writer = SummaryWriter(str(self.log_dir), flush_secs=10)

        if self.writer is None and self.writes.due():
            self.writes.attempt(self.log_dir, open_writer)
        return self.writer

    def _add(self, points: list[tuple[str, float, int]], flush: bool = False) -> bool:
        """Write (tag, value, step) points, flushed to the file if ``flush``; False (said, counted, the file
        dropped, a new one tried after ``writes.retry_s``) when the disk refuses them."""
        with self._lock:
            writer = self._open()
            if writer is None:
                return False

            def add() -> None:
                for tag, value, step in points:
                    writer.add_scalar(tag, value, step)
                if flush:
                    writer.flush()

            if self.writes.attempt(self.log_dir, add):
                return True
            with contextlib.suppress(OSError):  # its writer thread died of the same error
                writer.close()
            self.writer = None
            return False

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
            points = []
            for episode in reversed(new):  # oldest first
                points.append(("charts/episodic_return", episode["return"], steps))
                points.append(("charts/episodic_length", episode["length"], steps))
            if not self._add(points):
                return  # the same episodes again at the next look that writes
        self._episodes_seen = episodes
        now = time.monotonic()
        if self._last_chart is not None and now - self._last_chart[0] < CHARTS_INTERVAL_S:
            return
        if self._last_chart is not None:
            then, steps_then = self._last_chart
            self._add([("charts/SPS", (steps - steps_then) / (now - then), steps)])
        self._last_chart = (now, steps)
        charts = {
            "policy_version": version,
            "updates": updates,
            "trainer_busy": busy,
            "policy_lag_mean": lag_mean,
        }
        points = [(f"charts/{name}", value, steps) for name, value in charts.items()]
        self._add(points + [(f"losses/{name}", value, steps) for name, value in losses.items()])

    def add_step(self, points: Mapping[str, float], step: int) -> None:
        """A learner's step (the Atropos loop's, a Tinker model's): its points by tag, flushed at once (steps are
        seconds apart: whoever watches the curves sees each as it comes). What the disk refuses is lost (said and
        counted); the next step's points follow."""
        self._add([(tag, value, step) for tag, value in points.items()], flush=True)

    def add_evaluation(self, return_mean: float, return_std: float) -> None:
        """A periodic evaluation's result, at the run's env steps now."""
        steps = int(read_stats(self.client, self.run).get("env_steps", 0))
        self._add(
            [("eval/episodic_return", return_mean, steps), ("eval/episodic_return_std", return_std, steps)]
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writes.attempt(self.log_dir, self.writer.close)
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.finish()
            # finish() returns before wandb's service has written the run's file (offline: often only its
            # header); teardown waits for it, so a process stopped right after loses nothing
            wandb.teardown()


def run_log(config: Config, client: redis.Redis, run_dir: Path) -> TensorBoardLog | None:
    """The run's log in ``<run folder>/tensorboard`` (mirrored to W&B with the resolved config when
    ``trainer.wandb`` is on); None when ``trainer.tensorboard`` is off."""
    trainer = config.trainer
    if not trainer.tensorboard:
        return None
    dumped = config.model_dump(mode="json")
    return TensorBoardLog(run_dir / "tensorboard", client, config.run.name, trainer.wandb, dumped)


def _start_wandb(section: WandbSection, run_dir: Path, run: str, config: dict[str, Any] | None) -> Any:
    """A W&B run mirroring the event files written after it (it patches TensorBoard's writer: start it first)."""
    try:
        import wandb
    except ImportError:
        raise FatalError("trainer.wandb.enabled needs wandb: pip install 'tinker-atropos[wandb]'") from None
    return wandb.init(
        project=section.project,
        entity=section.entity,
        mode=section.mode,
        dir=str(run_dir),
        name=run,
        config=config,
        sync_tensorboard=True,
    )


def _quiet_writer_threads() -> None:
    """An event file's writer thread that dies of a disk error would print its traceback to the log; the error
    is said once, in one line, by ``TensorBoardLog.writes`` (the writer re-raises it to the next write)."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook
