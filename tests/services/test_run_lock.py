"""One run folder, one owner: a second `up` on a folder in use says in one line who holds it and exits 2, a
trainer started by hand on it is refused the same way, and the folder of an `up` that was killed is taken over.
`status RUN_DIR` (or `status` where the run is) finds the run's Redis and password; without them it names the
file to set. A client that floods a service with calls it refuses costs a line every 10 s, not one per call."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
import redis

from tests.support.processes import wait_for
from tests.support.running import cli, config_file, leftovers, metrics, report_rows, start_up
from tinker_atropos.protocol.v1 import environment_pb2, environment_pb2_grpc
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.run_dir import read_holder

pytestmark = pytest.mark.integration

FLOOD = 300


def refused_calls(address: str) -> None:
    """``FLOOD`` calls without the run's token, each on a new connection (a new port), as a script in a loop."""
    for _ in range(FLOOD // 10):
        with grpc.insecure_channel(address) as channel:
            stub = environment_pb2_grpc.EnvironmentStub(channel)
            for _ in range(10):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Describe(environment_pb2.DescribeRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_run_folder_has_one_owner_and_status_finds_its_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "pendulum"  # where `up` puts it by default, seen from tmp_path
    config = config_file(tmp_path)
    up = start_up(config, run_dir)
    try:
        holder = wait_for(
            lambda: (h := read_holder(run_dir)) and h.redis_url and h, 60, "up to note its Redis"
        )
        password = (run_dir / "redis-password").read_text().strip()
        url = holder.redis_url.replace("redis://", f"redis://:{quote(password, safe='')}@")
        client = redis.Redis.from_url(url)
        wait_for(
            lambda: report_rows(run_dir) and report_rows(run_dir)[-1]["policy_version"] >= 1, 120, "learning"
        )
        env = live_services(client, "pendulum", "env")[0]
        log = run_dir / "logs" / "env-0.log"
        before = log.stat().st_size
        refused_calls(env.address)
        flooded_at = time.monotonic()

        # a second `up`: one line, exit 2, nothing written
        lines = len(metrics(run_dir))
        second = cli("up", str(config), "--run-dir", str(run_dir), "--total-steps", "100")
        in_use = (
            f"error: run folder {run_dir} is in use by `up` (pid {up.pid} on {socket.gethostname()}) since "
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert (second.stdout + second.stderr).strip().startswith(in_use), second.stdout + second.stderr
        assert len((second.stdout + second.stderr).strip().splitlines()) == 1, second.stdout
        assert "resume" not in [row.get("event") for row in metrics(run_dir)[lines:]]
        # a trainer started by hand on the folder: refused before it writes there
        manual = cli(
            "trainer",
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
            "--port",
            "0",
            env={"TA_REDIS_URL": url, "TA_TOKEN_FILE": str(run_dir / "token")},
        )
        assert manual.returncode == 2 and manual.stderr.startswith(in_use), manual.stderr[-2000:]

        # `status` finds the run from its folder, or from the folder that holds it, with its password
        for shown in (cli("status", str(run_dir)), cli("status", cwd=tmp_path)):
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert "run 'pendulum'" in shown.stdout and "trainer" in shown.stdout, shown.stdout
        bare = cli("status", "--redis-url", holder.redis_url)  # the URL alone: the password is missing
        assert bare.returncode == 1
        assert "wants a password: set TA_REDIS_PASSWORD_FILE to the file that holds it" in bare.stdout, (
            bare.stdout
        )

        # the flood: one line at once, then one with the count once 10 s have passed and a call is refused again
        time.sleep(max(0.0, flooded_at + 10.5 - time.monotonic()))
        refused_calls(env.address)
        flood_lines = [line for line in log.read_text().splitlines() if "refused" in line]
        assert len(flood_lines) == 2, flood_lines
        assert "1 calls refused for want of the run's token (no token from ipv4:127.0.0.1)" in flood_lines[0]
        counted = (
            f"{FLOOD} calls refused for want of the run's token (no token from ipv4:127.0.0.1) in the last"
        )
        assert counted in flood_lines[1], flood_lines[1]
        assert log.stat().st_size - before < 2000  # one line per call would be ~60 KB
        wait_for(
            lambda: live_services(client, "pendulum", "env")[0].figures["calls_refused"] >= 2 * FLOOD,
            10,
            "every refused call counted in the env service's figures",
        )
        client.close()
    finally:
        up.kill()  # SIGKILL: its lock is left behind, its services drain on their own
        up.wait()
    wait_for(lambda: leftovers(run_dir) == "", 30, "the killed up's services to drain")

    stopped = cli("status", str(run_dir))
    assert stopped.returncode == 1
    assert f"the run in {run_dir} is not running: no `up` holds it; it was held by `up` (pid {up.pid}" in (
        stopped.stderr
    ), stopped.stderr
    again = cli("up", str(config), "--run-dir", str(run_dir), "--total-steps", "1")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"took over the run folder's lock from `up` (pid {up.pid} on " in again.stdout
    assert "nothing to do" in again.stdout
    assert read_holder(run_dir) is None  # released: empty, until the next `up`
    assert os.path.exists(run_dir / "run.lock")


def test_status_without_a_run_says_where_it_looked(tmp_path: Path) -> None:
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "config.yaml").write_text("run: {name: a}\n")
    (tmp_path / "runs" / "b").mkdir()
    (tmp_path / "runs" / "b" / "config.yaml").write_text("run: {name: b}\n")
    several = cli("status", cwd=tmp_path)
    assert several.returncode == 2
    assert several.stderr.strip() == (
        f"error: 2 runs in {tmp_path / 'runs'} (a, b), 0 of them running: pass one, e.g. "
        f"`tinker-atropos status {tmp_path / 'runs' / 'a'}`"
    )
    missing = cli("status", str(tmp_path / "nowhere"))
    assert (missing.returncode, missing.stderr.strip()) == (
        2,
        f"error: {tmp_path / 'nowhere'} does not exist: pass a run folder (runs/NAME by default)",
    )
