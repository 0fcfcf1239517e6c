"""Learners no other local user can reach, on a real run of two learners: the trainer
and its replica listen on nothing but the trainer's own gRPC port (gloo's listener on 127.0.0.1 took any local
user's connections: a flood of them aborted the trainer, and one naming a pair number joined the group and had its
pickles run), a flood of 100,000 connections as uid ``nobody`` against every port they listen on changes nothing,
and a trainer killed mid-run leaves nothing behind: its replica exits, its shared-memory shares are removed, and
no learners' folder stays behind."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import socket
import struct
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.processes import child_pids, wait_for
from tests.support.running import REPO, start_up
from tests.support.running import report_rows as metrics

pytestmark = pytest.mark.integration

FLOOD = 100_000


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def learners(up: int) -> tuple[int, list[int]] | None:
    """The run's trainer and its learner replicas, once both are up."""
    trainers = [pid for pid in child_pids(up) if " trainer --config " in command(pid)]
    if len(trainers) != 1:
        return None
    replicas = [pid for pid in child_pids(trainers[0]) if "learner_replicas" in command(pid)]
    return (trainers[0], replicas) if replicas else None


def listening(pid: int) -> set[tuple[str, str]]:
    """Every socket ``pid`` listens on: (protocol, port) for TCP and any bound UDP socket, ("unix", path) for a
    listening Unix socket (an abstract one included)."""
    inodes = {target[len("socket:[") : -1] for target in fd_targets(pid) if target.startswith("socket:[")}
    found = set()
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{protocol}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and (protocol.startswith("udp") or fields[3] == "0A"):  # 0A: LISTEN
                found.add((protocol, str(int(fields[1].rsplit(":", 1)[1], 16))))
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[6] in inodes and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
            found.add(("unix", fields[7] if len(fields) > 7 else ""))
    return found


def flood_as_nobody(ports: list[int], count: int, seconds: float = 45) -> int:
    """``count`` connect, send, close to each port from a child process of uid ``nobody``, each sending a gloo pair
    number, for ``seconds`` at most; how many connected."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # no exec: the venv's interpreter is not nobody's to run
        connected, deadline = 0, time.monotonic() + seconds
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            for port in ports:
                for pair in range(count):
                    if time.monotonic() > deadline:
                        break
                    with socket.socket() as connection, contextlib.suppress(OSError):
                        connection.settimeout(2)
                        connection.connect(("127.0.0.1", port))
                        connection.sendall(struct.pack("<Q", pair))
                        connected += 1
        finally:
            os.write(write, struct.pack("<Q", connected))
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    with os.fdopen(read, "rb") as answer:
        (connected,) = struct.unpack("<Q", answer.read(8))
    assert status == 0
    return connected


def fd_targets(pid: int) -> list[str]:
    """What ``pid``'s open files are (one closed while they are read is skipped)."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            targets.append(os.readlink(fd))
    return targets


def version(run_dir: Path) -> int:
    rows = metrics(run_dir)
    return rows[-1]["policy_version"] if rows else 0


def stop(up) -> str:
    up.send_signal(signal.SIGINT)
    output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    return output


def test_two_learners_listen_on_nothing_new_a_flood_as_nobody_changes_nothing_and_a_killed_trainer_leaves_nothing(
    tmp_path: Path,
) -> None:
    temporary = Path(tempfile.gettempdir())  # the run's TMPDIR: pytest's (tests/conftest.py)
    folders_before = set(temporary.glob("learners-*"))
    run_dir = tmp_path / "run"
    up = start_up(REPO / "configs" / "pendulum.yaml", run_dir, "--set", "trainer.learners=2")
    try:
        trainer, replicas = wait_for(lambda: learners(up.pid), 60, "the trainer and its replica")
        wait_for(lambda: version(run_dir) >= 2, 60, "two updates")
        served = re.search(
            r"trainer service \w+ serving on 127\.0\.0\.1:(\d+)", (run_dir / "logs/trainer.log").read_text()
        )
        assert served, "the trainer's gRPC port"
        assert {pid: listening(pid) for pid in replicas} == {pid: set() for pid in replicas}
        ports = listening(trainer)
        assert {port for _, port in ports} == {served[1]}, ports  # its gRPC port, as with one learner
        assert all(kind.startswith("tcp") for kind, _ in ports), ports

        before = version(run_dir)
        connected = flood_as_nobody(sorted({int(port) for _, port in ports}), FLOOD)
        assert connected > FLOOD * 0.99, f"{connected} of {FLOOD} connections"  # it reached every port
        wait_for(
            lambda: version(run_dir) >= before + 3, 60, "the policy version to keep rising after the flood"
        )
        assert learners(up.pid) == (trainer, replicas)  # the same processes: nothing restarted

        shares = {target for target in fd_targets(trainer) if "/dev/shm/" in target}
        assert shares, "the trainer's shared-memory shares"
        folders = set(temporary.glob("learners-*")) - folders_before
        os.kill(trainer, signal.SIGKILL)
        killed_at = version(run_dir)
        wait_for(lambda: (learners(up.pid) or (trainer,))[0] != trainer, 60, "the trainer restarted")
        wait_for(lambda: version(run_dir) > killed_at, 60, "the policy version past it after the restart")
        left = [pid for pid in replicas if Path(f"/proc/{pid}").exists()]
        assert left == [], f"the killed trainer's replicas left behind: {left}"
        assert [share for share in shares if Path(share).exists()] == []
        assert [folder for folder in folders if folder.exists()] == []
        assert not (run_dir / "learners").exists()
    finally:
        stop(up)
