"""Where a step's CPU goes inside each service: py-spy samples the env services and the rollout while they
collect (or, with ``learn``, while the whole system trains), and the samples are folded into the share of each
line of our code, so the README's profile table is a command's output rather than a transcription.

Every sample is charged to the innermost line of *our* package (the one that called ``mj_step``, a socket call or
numpy); a share is the fraction of the process's working samples spent there (``fold``).
"""

from __future__ import annotations

import json
import linecache
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import phases
from tinker_atropos.config import Config

OURS = "tinker_atropos/"
# calls that block until another process answers: time there is waiting, not work
WAITS = ("select.select(", ".recv_into(", ".recv(", "time.sleep(", ".wait(", "completion_queue.poll(")
MIN_SHARE = 0.02  # lines below 2 % of a process's samples are summed as "other"


def py_spy() -> str:
    """The py-spy executable of this venv (the ``bench`` extra), or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is not installed: `make bench` installs the bench extra")
    return found


def _location(frame: str) -> tuple[str, str]:
    """(path:line, the source line's text) of a py-spy frame ``function (path:line)``."""
    where = frame.rsplit(" (", 1)[-1].rstrip(")")
    path, _, line = where.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return where, text


def fold(raw: str) -> dict[str, Any]:
    """Shares per line of our code from py-spy's raw (collapsed) output, of the samples in which the process
    worked. Each stack is charged to its innermost frame in our package, which is the line that called into the
    library doing the work (``mujoco.mj_step``, a socket call, numpy). A line that blocks the thread until
    another process answers (``select``, ``recv``, ``sleep``, ``wait``) counts as waiting, not as work: py-spy
    samples a thread blocked in a C call as busy, so it is told apart by the line itself."""
    charged: Counter[str] = Counter()
    total = waiting = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames, samples = stack.split(";"), int(count)
        total += samples
        ours = [frame for frame in frames if OURS in frame]
        where, text = _location((ours or frames)[-1])
        if any(call in text for call in WAITS):
            waiting += samples
            continue
        name = where.split(OURS, 1)[1] if ours else f"(outside our code) {where.rsplit('/', 1)[-1]}"
        charged[f"{name}  {text[:70]}"] += samples
    busy = total - waiting
    major = {name: round(n / busy, 4) for name, n in charged.most_common() if busy and n / busy >= MIN_SHARE}
    return {
        "samples": total,
        "waiting": round(waiting / total, 4) if total else None,
        "shares": major,  # of the samples not waiting
        "other": round(1.0 - sum(major.values()), 4),
    }


def run_profile(
    config: Config, seconds: float, warmup_s: float, learn: bool, out: Path, console: Console
) -> dict:
    """Start the services as the benchmark does, let them run ``warmup_s``, then sample each env service and the
    rollout for ``seconds`` (in parallel, 100 Hz) and write profile.json."""
    spy = py_spy()
    out.mkdir(parents=True, exist_ok=True)
    timing = phases.Timing(warmup_s=warmup_s, window_s=seconds)
    with tempfile.TemporaryDirectory(prefix="profile-", dir=out) as scratch:
        with phases.services_meter(config, timing, Path(scratch), learn=learn) as meter:
            meter.resume()
            steps_before, started = meter.steps(), time.monotonic()
            targets = {name: pid for name, pid in meter.pids.items() if name.startswith(("env", "rollout"))}
            samplers = {
                name: subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(int(seconds)),
                        "--rate",
                        "100",
                        "--format",
                        "raw",
                        "--output",
                        str(Path(scratch) / f"{name}.txt"),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for name, pid in targets.items()
            }
            cpu_before = {name: phases.cpu_seconds(pid) for name, pid in meter.pids.items()}
            for name, sampler in samplers.items():
                if sampler.wait(timeout=seconds + 60) != 0:
                    raise RuntimeError(f"py-spy on {name} failed: {sampler.stderr.read()[-2000:]}")
            steps = meter.steps() - steps_before
            elapsed = time.monotonic() - started
            cpu = {name: phases.cpu_seconds(pid) - cpu_before[name] for name, pid in meter.pids.items()}
        processes = {name: fold((Path(scratch) / f"{name}.txt").read_text()) for name in targets}
    result = {
        "conditions": {
            "env_id": config.env.id,
            "instances": config.env.total_instances,
            "env_services": config.env.services,
            "learn": learn,
            "seconds": seconds,
            "note": "py-spy 100 Hz, non-blocking; --nonblocking sampling slows a process by ~1-3 %",
        },
        "env_steps_per_s": steps / elapsed,
        "cpu_us_per_env_step": {
            name: round(1e6 * s / steps, 1) if steps else None for name, s in cpu.items()
        },
        "processes": processes,
    }
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, folded in processes.items():
        title = f"{name}: {result['cpu_us_per_env_step'][name]} µs CPU per env step (all services' steps)"
        table = Table(title=f"{title}; waiting in {folded['waiting']:.0%} of the samples, shares of the rest")
        table.add_column("our line")
        table.add_column("share", justify="right")
        for where, share in folded["shares"].items():
            table.add_row(where, f"{share:.1%}")
        table.add_row("other", f"{folded['other']:.1%}")
        console.print(table)
    console.print(f"{result['env_steps_per_s']:,.0f} env steps/s while sampled; wrote {out / 'profile.json'}")
    return result
