"""`up` supervises its services: a killed one is restarted and the run keeps learning; Ctrl-C stops all."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.support.processes import child_pids, stop_process, wait_for
from tests.support.running import REPO, start_up
from tests.support.running import report_rows as metrics
from tinker_atropos.config import load_config
from tinker_atropos.errors import EXIT_FATAL
from tinker_atropos.launcher import supervisor
from tinker_atropos.launcher.supervisor import Child, kill_hung, supervise
from tinker_atropos.launcher.up import UpOptions, run_local
from tinker_atropos.processes import free_port
from tinker_atropos.state.embedded import EmbeddedValkey


def service_pid(run_dir: Path, kind: str) -> int | None:
    found = subprocess.run(
        ["pgrep", "-f", f"tinker_atropos {kind} --config {run_dir}"], capture_output=True, text=True
    )
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


def kill_and_see_the_run_go_on(run_dir: Path, kind: str, stop: bool = False) -> None:
    """SIGKILL (or with ``stop``, SIGSTOP: a hung process) the run's ``kind`` service; wait for its restart, then
    for 10,000 env steps and 3 updates more."""
    victim = service_pid(run_dir, kind)
    assert victim is not None
    if stop:
        stop_process(victim)
    else:
        os.kill(victim, signal.SIGKILL)
    killed_at = metrics(run_dir)[-1]
    wait_for(lambda: (service_pid(run_dir, kind) or victim) != victim, 60, f"{kind} to be restarted")
    wait_for(
        lambda: (
            metrics(run_dir)[-1]["env_steps"] > killed_at["env_steps"] + 10_000
            and metrics(run_dir)[-1]["policy_version"] > killed_at["policy_version"] + 2
        ),
        90,
        f"env steps and policy version to keep rising after the {kind}'s restart",
    )


@pytest.mark.integration
def test_each_killed_service_is_restarted_and_the_run_goes_on(tmp_path: Path) -> None:
    """The env service, then the rollout, then the trainer are SIGKILLed in one run, then the trainer is SIGSTOPped
    (hung: its process runs, no exit code says so): each comes back and the run goes on learning after each, its
    policy version never going back."""
    run_dir = tmp_path / "run"
    up = start_up(REPO / "configs" / "pendulum.yaml", run_dir, "--set", "run.hang_timeout_s=8")
    try:
        wait_for(lambda: any(r["policy_version"] >= 2 for r in metrics(run_dir)), 90, "two updates")
        for kind in ("env", "rollout", "trainer"):
            kill_and_see_the_run_go_on(run_dir, kind)
        kill_and_see_the_run_go_on(run_dir, "trainer", stop=True)
        children = child_pids(up.pid)
        assert len(children) == 4  # valkey, env, rollout, trainer
        versions = [r["policy_version"] for r in metrics(run_dir)]
        assert versions == sorted(versions), f"the policy version went back: {versions}"
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        output = up.communicate(timeout=30)[0]
    assert up.returncode == 0, output[-3000:]
    for kind in ("env", "rollout", "trainer"):
        assert any(kind in line and "restart 1" in line for line in output.splitlines()), output[-3000:]
    hung = [line for line in output.splitlines() if "trainer has shown no heartbeat for" in line]
    assert len(hung) == 1 and "though its process runs (hung or stopped)" in hung[0], output[-3000:]
    assert "  restarts     env-0 1, rollout-0 1, trainer 2\n" in output, output[-3000:]  # the summary
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left behind: {alive}"


# A child that runs for the seconds its N-th start reads from a file, says so, then exits with a code.
FLAKY = """
import sys, time
from pathlib import Path
plan = Path(sys.argv[1]).read_text().split()
count = Path(sys.argv[1] + ".starts")
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
seconds, code = plan[n].split(":") if n < len(plan) else ("600", "0")
time.sleep(float(seconds))
print(f"start {n} ends with code {code}", flush=True)
sys.exit(int(code))
"""


def flaky_child(tmp_path: Path, plan: str) -> Child:
    (tmp_path / "plan").write_text(plan)
    return Child(
        "flaky", [str(tmp_path / "plan")], tmp_path / "flaky.log", program=[sys.executable, "-c", FLAKY]
    )


def supervise_until(children: list[Child], console: Console, seconds: float) -> supervisor.GiveUp | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if give_up := supervise(children, console):
            return give_up
        time.sleep(0.02)
    return None


def test_the_restart_budget_decays_after_a_healthy_period(tmp_path: Path, monkeypatch) -> None:
    """Three quick crashes in a row exhaust a budget of 3; a long healthy run in between starts it afresh, as
    Kubernetes resets its crash-loop backoff, so rare crashes never add up to giving up."""
    monkeypatch.setattr(supervisor, "MAX_RESTARTS", 3)
    monkeypatch.setattr(supervisor, "HEALTHY_AFTER_S", 1.0)
    monkeypatch.setattr(supervisor, "BACKOFF_S", 0.05)
    console = Console(file=io.StringIO(), width=200)
    child = flaky_child(tmp_path, "0:1 0:1 0:1 1.5:1 0:1 0:1 0:1")
    try:
        give_up = supervise_until([child], console, 30)
    finally:
        child.terminate()
        child.wait(time.monotonic() + 5)
    output = console.file.getvalue()
    assert give_up == supervisor.GiveUp("flaky kept crashing", 1), output
    assert child.restarts == 6  # 3 before the healthy run, 3 after it; without the decay it would stop at 3
    assert "start 6 ends with code 1" in output  # the console shows the child's last words


def test_a_child_that_exits_with_exit_fatal_is_not_restarted(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), width=200)
    child = flaky_child(tmp_path, f"0:{EXIT_FATAL}")
    give_up = supervise_until([child], console, 30)
    child.wait(time.monotonic() + 5)
    assert give_up == supervisor.GiveUp("flaky failed", EXIT_FATAL)
    assert child.restarts == 0 and "start 0 ends with code 2" in console.file.getvalue()


# A child that writes numbered lines of ~100 bytes to its log as fast as it can, until told to stop: one write
# per line, as a logging handler writes a record (print may write a line's text and its newline apart).
CHATTY = """
import os, sys
from pathlib import Path
stop, n = Path(sys.argv[1]), 0
while not stop.exists():
    for _ in range(100):
        os.write(1, f"line {n:08d} {'x' * 85}\\n".encode())
        n += 1
os.write(1, f"last line {n}\\n".encode())
"""


def test_a_log_past_its_size_is_rotated_and_the_child_writes_on_into_the_emptied_file(tmp_path: Path) -> None:
    """Copy-truncate rotation of a live child's log: NAME.log stays about the bound, NAME.log.1 and .2 hold the
    latest older lines, nothing beyond the backups is kept, and the child, unaware, keeps writing into NAME.log."""
    child = Child(
        "chatty", [str(tmp_path / "stop")], tmp_path / "chatty.log", program=[sys.executable, "-c", CHATTY]
    )
    max_bytes, sizes = 64 * 1024, []
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "chatty.log.2").exists() or len(sizes) < 20:
            assert time.monotonic() < deadline, "the log was not rotated twice within a minute"
            supervisor.rotate_logs([child], max_bytes, backups=2)
            sizes.append(child.log_path.stat().st_size)
            time.sleep(0.01)
        (tmp_path / "stop").touch()
        child.wait(time.monotonic() + 10)
    finally:
        child.terminate()
        child.wait(time.monotonic() + 5)
    assert sorted(p.name for p in tmp_path.glob("chatty.log*")) == [
        "chatty.log",
        "chatty.log.1",
        "chatty.log.2",
    ]
    current = child.log_path.read_text()
    # written on from the start, not after a hole
    assert current.startswith("line ") and current.endswith("\n")
    assert "\0" not in current
    assert current.splitlines()[-1].startswith("last line ")
    newest, older = (
        int(p.read_text().split()[1]) for p in (tmp_path / "chatty.log.1", tmp_path / "chatty.log.2")
    )
    assert older < newest < int(current.split()[1])  # .1 is newer than .2, the live log newest of all
    # bounded: what the child writes between two looks (10 ms here, 1 s in `up`) beyond the bound at most
    assert max(sizes) < max_bytes + 2 * 1024 * 1024, max(sizes)


def test_only_a_child_seen_since_its_start_and_silent_while_redis_answered_is_killed_as_hung(
    tmp_path: Path,
) -> None:
    child, console = flaky_child(tmp_path, "600:0"), Console(file=io.StringIO())
    child.start()
    try:
        started, long_ago = child.started_at, time.monotonic() - 100
        kill_hung([child], {}, long_ago, 5.0, console)  # never seen: starting
        kill_hung([child], {"flaky": started - 1}, long_ago, 5.0, console)  # seen before this start only
        kill_hung([child], {"flaky": started + 0.001}, time.monotonic(), 5.0, console)  # Redis just came back
        assert child.process.poll() is None
        time.sleep(0.2)
        kill_hung([child], {"flaky": started + 0.001}, long_ago, 0.1, console)  # seen, then silent
        assert child.process.wait(timeout=10) == -signal.SIGKILL
        assert "flaky has shown no heartbeat for 0 s though its process runs" in console.file.getvalue()
    finally:
        child.wait(time.monotonic())


def test_a_fixed_port_in_use_fails_up_at_once_naming_its_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found before anything starts, not by the trainer seconds into its start-up (``max_seconds`` bounds a run
    that would start anyway)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        settings = ["trainer.tinker.enabled=true", f"trainer.tinker.port={port}"]
        config = load_config(REPO / "configs" / "pendulum.yaml", settings)
        code = run_local(config, tmp_path / "run", None, UpOptions(max_seconds=5))
    shown = capsys.readouterr().out
    assert code == EXIT_FATAL, shown[-3000:]
    assert shown == f"error: trainer.tinker.port {port} is in use on 127.0.0.1: free it or set another\n", (
        shown
    )
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


@pytest.mark.integration
def test_ctrl_c_during_start_up_reports_the_time_since_up_began(tmp_path: Path) -> None:
    """Ctrl-C while ``up`` waits for its Redis, before any service starts: the summary's time counts from the
    start of ``up``, not from the services' start."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    up = start_up(REPO / "configs" / "pendulum.yaml", tmp_path / "run", "--redis-url", url)
    server = None
    try:
        assert up.stdout is not None
        seen = [up.stdout.readline()]
        while "unreachable" not in seen[-1] and seen[-1]:  # waiting for Redis: its Ctrl-C handler is set
            seen.append(up.stdout.readline())
        time.sleep(1.5)
        up.send_signal(signal.SIGINT)
        server = EmbeddedValkey(tmp_path / "valkey", port=port)  # up goes on to its summary
        output = "".join(seen) + up.communicate(timeout=60)[0]
    finally:
        if up.poll() is None:
            up.kill()
        if server is not None:
            server.stop()
    stopped = re.search(r"stopped \(Ctrl-C\) after ([0-9.]+) s", output)
    assert stopped is not None and float(stopped[1]) >= 1.5, output[-3000:]
