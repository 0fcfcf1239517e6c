"""Sample Factory 2.x from our side: where its venv is, how our config maps onto its MuJoCo examples, and the
command line of ``bench/sf_appo.py`` (which runs inside that venv and imports nothing of ours).

Used by bench-learn (a whole run for the budget) and by the throughput benchmark (its env steps/s in slices).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tinker_atropos.config import Config
from tinker_atropos.launcher.progress import RETURN_WINDOW

SF_PYTHON = Path(__file__).resolve().parent / ".venv-sf" / "bin" / "python"
# Sample Factory 2.1.1 pins gymnasium 0.29, whose MuJoCo tasks are v4: our env id's name -> its env name
SF_ENVS = {"Humanoid": "mujoco_humanoid", "HalfCheetah": "mujoco_halfcheetah", "Hopper": "mujoco_hopper"}
SF_ENV_VERSION = "v4 (gymnasium 0.29, pinned by Sample Factory 2.1.1)"


def sf_workers(instances: int, cores: int) -> tuple[int, int]:
    """(workers, envs per worker) for ``instances`` env instances: at most one worker per core, as Sample
    Factory advises, and an even count per worker (its MuJoCo defaults split each worker's envs in two)."""
    for workers in range(min(cores, instances), 0, -1):
        per_worker, rest = divmod(instances, workers)
        if rest == 0 and per_worker % 2 == 0:
            return workers, per_worker
    raise ValueError(f"Sample Factory needs an even instance count per worker; env instances: {instances}")


def unavailable(config: Config) -> str | None:
    """Why Sample Factory cannot run ``config``'s env here, or None when it can."""
    if config.env.id.split("-v")[0] not in SF_ENVS:
        return f"Sample Factory's MuJoCo examples have no {config.env.id}; allowed: {sorted(SF_ENVS)}"
    if not SF_PYTHON.exists():
        return f"{SF_PYTHON} is missing: `make bench` and `make bench-learn` create Sample Factory's venv"
    return None


def sf_command(
    config: Config, budget_s: float, report_interval_s: float, work_dir: Path, async_rl: bool
) -> list[str]:
    """``bench/sf_appo.py`` training ``config``'s env with Sample Factory's tuned MuJoCo defaults, its instance
    count and seed, for ``budget_s`` from now; its curve goes to ``work_dir / "curve.jsonl"``."""
    if (reason := unavailable(config)) is not None:
        raise RuntimeError(reason)
    workers, per_worker = sf_workers(config.env.total_instances, os.cpu_count() or 1)
    return [
        # -P: bench/ stays off its sys.path, where a module of ours could shadow one of its own
        str(SF_PYTHON),
        "-P",
        str(Path(__file__).with_name("sf_appo.py")),
        f"--env={SF_ENVS[config.env.id.split('-v')[0]]}",
        f"--budget-s={budget_s}",
        f"--start-time={time.time()}",
        f"--seed={config.run.seed}",
        f"--workers={workers}",
        f"--envs-per-worker={per_worker}",
        f"--return-window={RETURN_WINDOW}",
        f"--async-rl={'on' if async_rl else 'off'}",
        f"--report-interval-s={report_interval_s}",
        f"--train-dir={work_dir / 'train'}",
        f"--curve={work_dir / 'curve.jsonl'}",
    ]
