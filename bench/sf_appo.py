"""Sample Factory 2.x APPO on MuJoCo for bench-learn, run by the Python of its own venv (bench/.venv-sf).

Sample Factory pins gymnasium 0.29 (so its Humanoid is v4), hence its own venv; this script imports nothing of
ours. It trains with Sample Factory's own tuned MuJoCo defaults (``sf_examples.mujoco``), changing only what the
comparison fixes: the instance count (workers x envs per worker), the CPU device, the seed, ``async_rl``. Every
report interval it appends one JSON line: wall time since ``--start-time`` (the parent's clock, so start-up
counts against the budget as for the other systems), env steps, and the mean return of the latest
``--return-window`` episodes (bench-learn's window). At the budget it asks the runner to stop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env", default="mujoco_humanoid", help="sf_examples.mujoco env name")
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--start-time", type=float, default=None, help="time.time() the budget counts from")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--async-rl", choices=("on", "off"), default="off")
    parser.add_argument("--report-interval-s", type=float, default=5.0)
    parser.add_argument("--return-window", type=int, default=10)
    parser.add_argument("--train-dir", type=Path, required=True)
    parser.add_argument("--curve", type=Path, required=True, help="JSON lines written here")
    args = parser.parse_args(argv)
    start = args.start_time if args.start_time is not None else time.time()

    from sample_factory.algo.runners.runner import AlgoObserver
    from sample_factory.train import make_runner
    from sf_examples.mujoco.train_mujoco import parse_mujoco_cfg, register_mujoco_components

    register_mujoco_components()
    cfg = parse_mujoco_cfg(
        [
            f"--env={args.env}",
            f"--experiment=sf-seed{args.seed}-async-{args.async_rl}",
            f"--train_dir={args.train_dir}",
            "--device=cpu",
            f"--seed={args.seed}",
            f"--num_workers={args.workers}",
            f"--num_envs_per_worker={args.envs_per_worker}",
            f"--async_rl={args.async_rl == 'on'}",
            "--restart_behavior=overwrite",
        ]
    )

    class Curve(AlgoObserver):
        """Samples (wall time, env steps, recent mean return) and ends training at the budget."""

        def __init__(self) -> None:
            self.next_report = start + args.report_interval_s

        def on_training_step(self, runner, training_iteration_since_resume: int) -> None:
            now = time.time()
            if now >= self.next_report:
                while self.next_report <= now:
                    self.next_report += args.report_interval_s
                rewards = list(runner.policy_avg_stats.get("reward", [[]])[0])[-args.return_window :]
                point = {
                    "wall_time_s": round(now - start, 2),
                    "env_steps": int(runner.env_steps.get(0, 0)),
                    "episode_return_mean": float(sum(rewards) / len(rewards)) if rewards else None,
                }
                with open(args.curve, "a") as out:
                    out.write(json.dumps(point) + "\n")
            if now - start >= args.budget_s:
                # the runner checks this right after the observers (its train_for_seconds counts only a resumed run's time)
                runner.cfg.train_for_env_steps = 0

    cfg, runner = make_runner(cfg)
    runner.register_observer(Curve())
    status = runner.init()
    if status == 0:
        status = runner.run()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
