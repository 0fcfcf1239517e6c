"""A run folder on a disk that fills up, empties, then turns read-only, as a real small filesystem (a tmpfs
mounted over the run folder in a mount namespace of the run's own): learning goes on while checkpoints and
metrics rows wait, each failure is one line naming the path and the error, both catch up when space is back,
and `up` stops with that reason once writes fail for longer than run.write_failure_timeout_s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from tests.support.processes import wait_for
from tests.support.running import REPO, config_file, leftovers
from tinker_atropos.state.run_dir import read_holder
from tinker_atropos.state.weights import published_version

pytestmark = pytest.mark.integration

DISK = "64m"
# a private mount namespace: root's own, or one inside a user namespace for anyone else
NAMESPACE = ["unshare", "--mount", "--propagation", "private"] + (
    [] if os.geteuid() == 0 else ["--map-root-user"]
)
MOUNT_THEN_RUN = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'


def unavailable_reason(folder: Path) -> str | None:
    probe = subprocess.run(
        [*NAMESPACE, "sh", "-c", MOUNT_THEN_RUN, "sh", "1m", str(folder), "true"],
        capture_output=True,
        text=True,
    )
    return (
        None
        if probe.returncode == 0
        else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"
    )


class Output(threading.Thread):
    """The lines a process prints, collected as they come."""

    def __init__(self, process: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.process, self.lines = process, []
        self.start()

    def run(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def having(self, *parts: str) -> list[str]:
        return [line for line in self.lines if all(part in line for part in parts)]


def checkpoint_versions(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (folder / "checkpoints").glob("checkpoint-*.pt"))


def fill(disk_file: Path) -> None:
    """Write zeros until the disk is full."""
    with open(disk_file, "wb", buffering=0) as file, pytest.raises(OSError, match="No space left on device"):
        while True:
            file.write(b"\0" * (1 << 20))


def test_a_full_then_read_only_disk_pauses_checkpoints_and_metrics_while_learning_goes_on(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if reason := unavailable_reason(run_dir):
        pytest.skip(reason)
    config = config_file(
        tmp_path,
        run={"name": "pendulum", "write_failure_timeout_s": 30},
        trainer={"checkpoint": {"every_updates": 1}},
    )
    up = subprocess.Popen(
        [
            *NAMESPACE,
            "sh",
            "-c",
            MOUNT_THEN_RUN,
            "sh",
            DISK,
            str(run_dir),
            sys.executable,
            "-m",
            "tinker_atropos",
            "up",
            str(config),
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    output = Output(up)
    inside = Path(f"/proc/{up.pid}/root") / run_dir.relative_to("/")  # the run folder as the run sees it
    try:
        wait_for(
            lambda: len(checkpoint_versions(inside)) >= 2, 120, f"two checkpoints\n{output.text()[-3000:]}"
        )
        holder = read_holder(inside)
        password = quote((inside / "redis-password").read_text().strip(), safe="")
        client = redis.Redis.from_url(holder.redis_url.replace("redis://", f"redis://:{password}@"))

        fill(inside / "filler")
        full_at = checkpoint_versions(inside)[-1]
        wait_for(
            lambda: output.having(
                "the trainer cannot write checkpoint: ", "No space left on device (ENOSPC)"
            ),
            60,
            f"the trainer's one line on the full disk\n{output.text()[-3000:]}",
        )
        wait_for(
            lambda: output.having("cannot write metrics rows: ", "metrics.jsonl: No space left on device"),
            30,
            "up's one line on metrics.jsonl",
        )
        version = published_version(client, "pendulum")
        wait_for(
            lambda: published_version(client, "pendulum") >= version + 2, 25, "learning to go on, disk full"
        )
        assert int(client.hget("ta:pendulum:stats", "checkpoints_failed")) >= 1
        assert checkpoint_versions(inside)[-1] == full_at  # none written meanwhile
        assert len(output.having("the trainer cannot write checkpoint")) == 1  # one line, not one per attempt

        (inside / "filler").unlink()  # space is back
        wait_for(lambda: checkpoint_versions(inside)[-1] > version + 2, 60, "a checkpoint once space is back")
        wait_for(
            lambda: output.having("the trainer writes again"),
            30,
            f"the console to say so\n{output.text()[-3000:]}",
        )
        wait_for(lambda: output.having("metrics rows: written again to"), 30, "metrics rows written again")
        lines = [line for line in (inside / "metrics.jsonl").read_text().splitlines() if line]
        rows = [json.loads(line) for line in lines]  # every line whole: none cut short by the full disk
        times = [row["wall_time_s"] for row in rows]
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 10, "rows were lost meanwhile"
        assert "restart" not in output.text() and "exited with code" not in output.text(), output.text()[
            -3000:
        ]

        # read-only now: writes fail for longer than run.write_failure_timeout_s (30 s) and up stops, saying why
        enter = ["nsenter", "-t", str(up.pid), "-m"] + (
            [] if os.geteuid() == 0 else ["-U", "--preserve-credentials"]
        )
        # a read-only view: logs stay open
        for mount in (
            ["--bind", str(run_dir)],
            ["-o", "remount,bind,ro"],
        ):
            subprocess.run([*enter, "mount", *mount, str(run_dir)], check=True)
        assert up.wait(timeout=90) == 1, output.text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    output.join(timeout=10)
    text = output.text()
    stopped = output.having("run 'pendulum' stopped (cannot write ")
    assert stopped and "Read-only file system (EROFS) for " in stopped[0], text[-3000:]
    assert "(run.write_failure_timeout_s)" in stopped[0]
    # one line a kind of write for the read-only folder, naming it as a path, not its temporary files' bytes
    read_only = output.having("the trainer cannot write", "Read-only file system (EROFS)")
    checkpoints = [line for line in read_only if "cannot write checkpoint: " in line]
    assert len(checkpoints) == 1 and f"{run_dir / 'checkpoints'}: " in checkpoints[0], read_only
    assert len({line.split(": ")[0] for line in read_only}) == len(read_only), read_only
    assert "b'" not in text and ".tmp-" not in text, text[-3000:]
    problems = output.having("  problems     ")[0]
    assert "checkpoints_failed " in problems and "metrics_writes_failed " in problems, problems
    assert "Traceback" not in text
    wait_for(lambda: leftovers(run_dir) == "", 30, "no process left behind")


# What the trainer writes, onto a full 4 MiB tmpfs: the plain OSError each time (torch's own file writer would
# raise a RuntimeError naming neither), and no temporary file left behind.
WRITES_ON_A_FULL_DISK = """
import sys
from pathlib import Path
import numpy as np, torch
from tinker_atropos.state.checkpoint_files import save_checkpoint
from tinker_atropos.state.replay_journal import ReplayJournal
folder = Path(sys.argv[1])
(folder / "filler").write_bytes(bytes(3 << 20))
for write in (lambda: save_checkpoint(folder / "checkpoints", 7, {"w": torch.zeros(500_000)}, keep=3),
              lambda: ReplayJournal(folder / "replay").append(0, {"rewards": np.zeros(500_000, np.float32)})):
    try:
        write()
        print("written")
    except OSError as error:
        print(error.strerror)
print(sorted(p.name for p in folder.rglob("*") if p.is_file()))
"""


def test_checkpoints_and_replay_segments_fail_with_the_disk_s_own_error_and_leave_nothing(
    tmp_path: Path,
) -> None:
    if reason := unavailable_reason(tmp_path):
        pytest.skip(reason)
    ran = subprocess.run(
        [
            *NAMESPACE,
            "sh",
            "-c",
            MOUNT_THEN_RUN,
            "sh",
            "4m",
            str(tmp_path),
            sys.executable,
            "-c",
            WRITES_ON_A_FULL_DISK,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert ran.stdout.splitlines() == ["No space left on device", "No space left on device", "['filler']"], (
        ran.stdout + ran.stderr
    )
