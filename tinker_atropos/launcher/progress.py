"""``up``'s progress: one console line and one ``metrics.jsonl`` row per report, read from Redis.

It survives a Redis outage: one line when Redis goes, one when it is back, no rows meanwhile. Counters that
come back lower than at the last report (a Redis restarted without persistence, or a new one) are restored from
that report, so ``env_steps`` and ``--total-steps`` go on counting the whole run; a resumed run's counters are
put into its new Redis the same way, without an alarm. A metrics.jsonl that the disk refuses (full, read-only)
keeps its rows in memory (the latest ``PENDING_ROWS``) until it takes them again; that, and the trainer's own
write failures, are one line each, and ``write_failure`` says for how long.

What a row says is ``run_figures.py``'s, where it is written ``metrics_file.py``'s; here, the reports themselves
and the console's line, in a run's own words (``RunWords``): a control run's env steps, episodes and return, a
language model's tokens, answers and reward.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from tinker_atropos.launcher.lm_eval import PeriodicEvals, eval_line
from tinker_atropos.launcher.metrics_file import MetricsFile
from tinker_atropos.launcher.run_figures import RunFigures
from tinker_atropos.state import keys
from tinker_atropos.state.connection import connect_fast, describe
from tinker_atropos.state.experience import add_stats, read_stats

RETURN_WINDOW = 10  # episode_return_mean is over the latest this many episodes: run.return_window's default
PROGRESS_WIDTH = 20  # characters of the progress bar


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


@dataclass(frozen=True)
class RunWords:
    """What a run's figures are called where a user reads them (the console, ``up``'s summary, ``report``): a
    control run counts env steps, episodes and their return; a language model's (the Atropos loop's) counts the
    trained tokens of its answers and their reward, and has no policy lag measured (its trainer serves the
    samples itself), so none is shown."""

    steps: str  # what the run's env_steps counter counts
    step: str  # one of them, in the console's line
    episodes: str
    ret: str
    lag: bool

    @staticmethod
    def of(language_model: bool) -> RunWords:
        """A language model's words (``trainer.atropos.enabled``), or a control run's."""
        return LANGUAGE_MODEL if language_model else CONTROL

    def window(self, episodes: int) -> str:
        """The latest ``episodes`` a mean return averages, as the summary and ``report`` say it."""
        return f"last {episodes} {self.episodes}"


CONTROL = RunWords("env steps", "steps", "episodes", "return", lag=True)
LANGUAGE_MODEL = RunWords("tokens", "tokens", "answers", "reward", lag=False)


def format_return(mean: float | None) -> str:
    """A mean return as the console shows it: one decimal for a control task's, three for a reward in [-1, 1]
    (a language model's answers), where 0.6 and 0.64 differ."""
    if mean is None:
        return "-"
    return f"{mean:.3f}" if abs(mean) <= 1 else f"{mean:.1f}"


class TrainerWrites:
    """The trainer's writes into the run folder (checkpoints, TensorBoard events) as its figures tell: one console
    line when a kind starts failing (or fails otherwise), one when it works again, whichever kind a full disk
    fails first. The trainer's log has the same; the console is where the user looks."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.longest: tuple[str, float] = ("", 0.0)  # the failure going on longest and for how long
        self.failures: dict[str, str] = {}  # every kind failing now, as last said

    def note(self, trainer: dict[str, Any]) -> None:
        """Take the trainer's latest figures (empty while it restarts: its last word stands)."""
        if not trainer:
            return
        self.longest = (str(trainer.get("write_failure") or ""), float(trainer.get("write_failing_s") or 0.0))
        failures = {str(k): str(v) for k, v in (trainer.get("write_failures") or {}).items()}
        for kind, failure in failures.items():
            if failure != self.failures.get(kind):
                self.console.print(
                    f"[yellow]the trainer cannot write {failure}; learning goes on, the run stops if "
                    "it lasts run.write_failure_timeout_s",
                    highlight=False,
                )
        for kind, failure in self.failures.items():
            if kind not in failures:
                self.console.print(
                    f"[green]the trainer writes again (it could not write {failure})", highlight=False
                )
        self.failures = failures


class ProgressReporter:
    """Reports a run's figures in its ``words``; ``counters``, ``wall_offset_s`` and ``policy_version`` continue a
    resumed run."""

    def __init__(
        self,
        url: str,
        run: str,
        metrics_path: Path,
        console: Console,
        counters: dict[str, int] | None = None,
        wall_offset_s: float = 0.0,
        policy_version: int = 0,
        return_window: int = RETURN_WINDOW,
        words: RunWords = CONTROL,
    ) -> None:
        self.client, self.run, self.console, self.words = connect_fast(url), run, console, words
        self.figures = RunFigures(self.client, run, return_window, counters, wall_offset_s, policy_version)
        self.metrics = MetricsFile(metrics_path, console)
        self.evals = PeriodicEvals(metrics_path.parent)  # atropos.eval_every_steps's results
        self.trainer_writes = TrainerWrites(console)
        self.last_row: dict[str, Any] | None = None
        self.unreachable_since: float | None = None
        self.answering_since = time.monotonic()  # since when Redis has answered this reporter's reads
        # this reporter's marker key is in Redis: its disappearance means Redis lost its data
        self.marked = False
        # up's bounds, for the progress bar and its ETA
        self.total_steps: int | None = None
        self.max_seconds: float | None = None

    @property
    def heartbeats(self) -> dict[str, float]:
        """A service's name -> when a report last saw it in the registry."""
        return self.figures.heartbeats

    @property
    def tinker_api(self) -> str:
        """The trainer's Tinker API URL, once it serves one."""
        return self.figures.tinker_api

    def incidents(self) -> dict[str, int]:
        """Every counter of something refused, skipped, lost or failed, by name (``RunFigures.incidents``)."""
        return self.figures.incidents()

    def outage_s(self) -> float:
        """How long Redis has been unreachable (0 while it answers)."""
        return 0.0 if self.unreachable_since is None else time.monotonic() - self.unreachable_since

    def restore_counters(self) -> None:
        """Put the counters of the last report back if Redis lost them: the marker this reporter set is gone (it
        restarted empty; the services' increments since may already exceed the last report), or they went back
        (a counter overwritten)."""
        marker = keys.reporter_marker(self.run)
        present = bool(self.client.exists(marker))
        lost = self.marked and not present
        counters = self.figures.counters
        if lost or read_stats(self.client, self.run).get("env_steps", 0) < counters.get("env_steps", 0):
            add_stats(self.client, self.run, **counters)
            if self.marked or present:  # else a resumed run's first report: its new Redis started at 0
                self.console.print(
                    "[yellow]the run's counters in Redis went back (Redis restarted empty, or a counter was "
                    "overwritten); restored them from the last report"
                )
        if not present:
            self.client.set(marker, 1)
            self.marked = True

    def env_steps(self) -> int | None:
        """The run's env steps now, in one small read; None while Redis is away (not asked then: a read that
        waits for a timeout would slow ``up``'s supervision) or the counter is not a number."""
        if self.unreachable_since is not None:
            return None
        try:
            return int(self.client.hget(keys.stats(self.run), "env_steps") or 0)
        except (redis.RedisError, ValueError):
            return None

    def report(self, show: bool = True) -> dict[str, Any] | None:
        """Read, print (if ``show``) and append one row; None while Redis is unreachable."""
        try:
            self.restore_counters()
            row = self.figures.row()
        except redis.ResponseError as error:  # Redis answers, but refuses a command: not an outage
            self.console.print(f"[yellow]Redis refused a read of the run's figures ({describe(error)})")
            return None
        except redis.RedisError as error:
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
                self.console.print(f"[yellow]Redis unreachable ({describe(error)}); the services wait for it")
            return None
        self.trainer_writes.note(self.figures.trainer)
        if self.unreachable_since is not None:
            self.console.print(f"[green]Redis answers again after {self.outage_s():.1f} s")
            self.unreachable_since, self.answering_since = None, time.monotonic()
        self.metrics.append(row)
        if (evaluation := self.evals.new(row)) is not None:
            self.metrics.append(evaluation)
            self.console.print(eval_line(evaluation), highlight=False)
        with contextlib.suppress(redis.RedisError):  # counted in the next report's row, not this one's
            add_stats(self.client, self.run, metrics_writes_failed=self.metrics.writes.take_unreported())
        self.last_row = row
        if show:
            self.console.print(self.line(row))
        return row

    def write_failure(self) -> tuple[str, float]:
        """What write into the run folder has been failing longest (metrics.jsonl, or the trainer's checkpoints or
        TensorBoard events), and for how long; ("", 0.0) while every write succeeds."""
        own = (self.metrics.writes.error, self.metrics.writes.failing_s)
        return max(own, self.trainer_writes.longest, key=lambda failure: failure[1])

    def line(self, row: dict[str, Any]) -> str:
        """The console's line of ``row``, in the run's words."""
        ret = format_return(row["episode_return_mean"])
        busy = "-" if row["trainer_busy"] is None else f"{row['trainer_busy']:.0%}"
        counters = row["counters"]
        rejected = sum(n for k, n in counters.items() if k.startswith("records_rejected_"))
        notes = f"  lag {row['policy_lag_mean']:.1f}" if self.words.lag else ""
        if rejected:
            notes += f"  [yellow]bad records {rejected}[/]"
        if cut := counters.get("episodes_cut_nonfinite", 0):
            notes += f"  [yellow]NaN episodes {cut}[/]"
        step, episodes, returned = self.words.step, self.words.episodes, self.words.ret
        return (
            f"[bold]{row['env_steps']:>10,}[/] {step}  {row['env_steps_per_s']:>8,.0f} {step}/s  "
            f"{episodes} {row['episodes']:>6}  {returned} {ret:>8}  version {row['policy_version']:>5}  "
            f"trainer busy {busy}{notes}{self._progress(row)}"
        )

    def _progress(self, row: dict[str, Any]) -> str:
        """A bar towards the bound that stops ``up`` first (--total-steps or --max-seconds), and its ETA: the steps
        left at the row's rate, over the latest ``run_figures.RATE_WINDOW_S`` (not since the start, whose start-up
        would stretch it); "?" while no steps come."""
        elapsed = time.monotonic() - self.figures.start
        steps, rate = row["env_steps"], row["env_steps_per_s"]
        bounds = []  # (seconds left, fraction done)
        if self.total_steps:
            left = (self.total_steps - steps) / rate if rate > 0 else math.inf
            bounds.append((max(0.0, left), min(1.0, steps / self.total_steps)))
        if self.max_seconds:
            bounds.append((max(0.0, self.max_seconds - elapsed), min(1.0, elapsed / self.max_seconds)))
        if not bounds:
            return ""
        left, done = min(bounds)
        filled = round(done * PROGRESS_WIDTH)
        eta = "?" if math.isinf(left) else _duration(left)
        return f"  {'█' * filled}{'░' * (PROGRESS_WIDTH - filled)} {done:4.0%} ETA {eta}"

    def close(self) -> None:
        """Close the Redis client; rows metrics.jsonl never took are said to be lost, in one line."""
        self.metrics.close()
        self.client.close()
