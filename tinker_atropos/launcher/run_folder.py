"""A run folder (``runs/NAME``): metrics.jsonl, logs, checkpoints, the embedded Valkey's data.

``up`` on a folder that already holds a run resumes it explicitly: the trainer continues from its latest
checkpoint, the counters from the last metrics row, and metrics.jsonl gets a resume marker. ``--fresh`` clears
what a run left there (and the run's keys in Redis) and starts over.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker_atropos.errors import FatalError
from tinker_atropos.state.checkpoint_files import PREFIX as CHECKPOINT_PREFIX

if TYPE_CHECKING:
    from tinker_atropos.models.mlp import ActorCritic

RUN_ITEMS = ("metrics.jsonl", "chaos.jsonl", "config.yaml", "logs", "checkpoints", "valkey")
# What the counters were called in rows written before metrics.jsonl kept them all under "counters".
_FLAT_COUNTERS = (
    "env_steps",
    "episodes",
    "chunks_written",
    "chunks_rejected_stale",
    "chunks_dropped_backpressure",
)


@dataclass(frozen=True)
class PreviousRun:
    """Where a run left off: its last metrics row and its latest checkpoint."""

    counters: dict[str, int]
    wall_time_s: float
    checkpoint: Path | None

    @property
    def env_steps(self) -> int:
        return self.counters.get("env_steps", 0)

    @property
    def policy_version(self) -> int | None:
        """The version of the latest checkpoint, read off its name."""
        if self.checkpoint is None:
            return None
        return int(self.checkpoint.stem.removeprefix(CHECKPOINT_PREFIX))


def metric_rows(path: Path) -> list[dict[str, Any]]:
    """The report rows of a metrics.jsonl: markers, lines a killed run cut short and rows without numeric
    env_steps and wall_time_s are left out."""
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path) as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and "event" not in row and _numbers(row, "env_steps", "wall_time_s"):
                    rows.append(row)
    return rows


def _numbers(row: dict[str, Any], *keys: str) -> bool:
    """Whether ``row`` holds a number (not a bool) under each key: a row edited or written by something else is
    skipped, not a crash of ``report`` or of a resume."""
    return all(isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool) for key in keys)


def latest_checkpoint(run_dir: Path, folder: str = "checkpoints") -> Path | None:
    """The newest checkpoint of the run's experience loop (or of the driver that checkpoints to ``folder``)."""
    return max((run_dir / folder).glob(f"{CHECKPOINT_PREFIX}*.pt"), default=None)


def previous_run(run_dir: Path) -> PreviousRun | None:
    """What the folder holds of an earlier run, None if nothing."""
    rows, checkpoint = metric_rows(run_dir / "metrics.jsonl"), latest_checkpoint(run_dir)
    if not rows and checkpoint is None:
        return None
    last = rows[-1] if rows else {}
    counters = last.get("counters") or {k: last[k] for k in _FLAT_COUNTERS if k in last}
    return PreviousRun(
        {k: int(v) for k, v in counters.items()}, float(last.get("wall_time_s", 0.0)), checkpoint
    )


def mark_resume(metrics_path: Path, run: str, previous: PreviousRun) -> None:
    marker = {
        "event": "resume",
        "run": run,
        "env_steps": previous.env_steps,
        "policy_version": previous.policy_version,
        "wall_time_s": previous.wall_time_s,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with open(metrics_path, "a") as metrics:
        metrics.write(json.dumps(marker) + "\n")


def clear_run_folder(run_dir: Path) -> list[str]:
    """Remove what a run left in ``run_dir`` (other files stay); the names removed."""
    removed = []
    for name in RUN_ITEMS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


@dataclass(frozen=True)
class RunPolicy:
    """The acting policy a checkpoint holds (as the rollouts received it), for ``eval`` and ``export``."""

    checkpoint: Path
    version: int
    model: ActorCritic


def run_policy(run_dir: Path, checkpoint: Path | None, network: str) -> RunPolicy:
    """The policy of ``checkpoint``, or of the run folder's newest readable checkpoint; FatalError, in one line,
    when there is none, it holds no policy, or the policy is not the config's ``network``."""
    from tinker_atropos.models.acting import load_network
    from tinker_atropos.state.checkpoint_files import load_latest_checkpoint, read_checkpoint

    if checkpoint is not None:
        try:
            found = checkpoint, read_checkpoint(checkpoint)
        except Exception as error:  # a missing file, or one torch cannot unpickle
            raise FatalError(f"checkpoint {checkpoint} does not load: {error}") from None
    elif (found := load_latest_checkpoint(run_dir / "checkpoints")) is None:
        raise FatalError(
            f"no readable checkpoint in {run_dir / 'checkpoints'}: train first (`tinker-atropos up`)"
        )
    path, state = found
    record = state.get("policy")
    if record is None:
        raise FatalError(
            f"{path} holds no policy: it was written by a version before 'eval' and 'export' existed"
        )
    try:
        model = load_network(record["spec"], record["weights"], network)
    except ValueError as error:  # weights of another network than the config's, or that do not load
        raise FatalError(f"{path}: {error}") from None
    return RunPolicy(path, int(record["version"]), model)
