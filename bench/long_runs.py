"""Did long runs keep what they learned? ``python bench/long_runs.py RUN_DIR...`` reads each run folder's
metrics.jsonl and prints, per run, where the mean return (over windows of 50,000 env steps) first reached -250,
the worst window after that, the last one, whether a later window fell below -500 (a collapse, as
configs/pendulum.yaml's constant learning rate had in 3 of 4 runs of 1M steps), the largest approx_kl and
the share of progress reports whose latest update target_kl stopped.

The runs, one after the other (about 10 minutes each on 2 cores)::

    mkdir -p runs; for seed in 1 2 3 4; do .venv/bin/tinker-atropos up configs/pendulum.yaml --fresh --total-steps 1000000 \\
        --seed $seed --run-dir runs/pendulum-long-$seed > runs/pendulum-long-$seed.out 2>&1; done
    .venv/bin/python bench/long_runs.py runs/pendulum-long-{1,2,3,4}

The config of before, for a control: add ``--set trainer.ppo.anneal_lr=false --set trainer.ppo.target_kl=null``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WINDOW = 50_000  # env steps
LEARNED, COLLAPSED = -250.0, -500.0


def summary(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "event" not in row]
    windows: dict[int, list[float]] = {}
    for row in rows:
        if row.get("episode_return_mean") is not None:
            windows.setdefault(row["env_steps"] // WINDOW * WINDOW, []).append(row["episode_return_mean"])
    means = {start: sum(values) / len(values) for start, values in sorted(windows.items())}
    learned = next((start for start, mean in means.items() if mean >= LEARNED), None)
    later = [(mean, start) for start, mean in means.items() if learned is not None and start > learned]
    worst, worst_at = min(later, default=(None, None))
    losses = [row["losses"] for row in rows if row.get("losses")]
    kl = max((loss.get("approx_kl", 0.0) for loss in losses), default=0.0)
    epochs = [loss["epochs"] for loss in losses if "epochs" in loss]
    stopped = [done < max(epochs) for done in epochs]  # fewer epochs than a whole update's
    last = round(list(means.values())[-1]) if means else "-"
    collapsed = worst is not None and worst < COLLAPSED
    return (
        f"{run_dir.name}: {rows[-1]['env_steps']:,} env steps; mean return >= {LEARNED:g} from {learned}; "
        f"worst window after: {'-' if worst is None else round(worst)} (at {worst_at}); last window: {last}; "
        f"collapsed: {collapsed}; max approx_kl {kl:.3f}; "
        f"reports whose update target_kl stopped: {sum(stopped) / max(len(stopped), 1):.0%}"
    )


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        print(summary(Path(folder)))
