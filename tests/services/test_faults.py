"""Fault injection on real processes: any service (or Redis) can die and the run goes on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from tests.support.processes import Processes, wait_for
from tests.support.running import REPO
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.experience import queued_chunks, read_stats
from tinker_atropos.state.registry import ServiceRecord, live_services
from tinker_atropos.state.weights import published_version

pytestmark = pytest.mark.integration
RUN = "faults"


class Cluster:
    """Valkey-backed run whose services are started, killed and restarted one by one."""

    def __init__(self, tmp_path: Path, processes: Processes, url: str, **overrides: dict) -> None:
        config = yaml.safe_load((REPO / "configs" / "pendulum.yaml").read_text())
        config["run"]["name"] = RUN
        config["env"]["instances"] = 4
        config["redis"] = {"heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 2.0}
        config["trainer"]["checkpoint"] = {"every_updates": 2}
        for section, values in overrides.items():
            config.setdefault(section, {}).update(values)
        self.path = tmp_path / "run.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.run_dir = tmp_path / "run"
        self.processes, self.url = processes, url
        self.client = redis.Redis.from_url(url)
        self.count = 0

    def start(self, kind: str, name: str) -> subprocess.Popen:
        self.count += 1
        args = [kind, "--config", str(self.path), "--redis-url", self.url, "--port", "0", "--name", name]
        if kind == "trainer":
            args += ["--run-dir", str(self.run_dir)]
        return self.processes.start(*args, name=f"{name}-{self.count}")

    def services(self, kind: str | None = None) -> list[ServiceRecord]:
        return live_services(self.client, RUN, kind)

    def named(self, name: str) -> ServiceRecord | None:
        return next((s for s in self.services() if s.name == name), None)

    def env_steps(self) -> int:
        return read_stats(self.client, RUN).get("env_steps", 0)

    def version(self) -> int:
        return published_version(self.client, RUN) or 0

    def wait_progress(self, steps: int, timeout_s: float, what: str) -> None:
        target = self.env_steps() + steps
        wait_for(lambda: self.env_steps() >= target, timeout_s, what)


@pytest.fixture
def cluster(tmp_path: Path, valkey, redis_client, processes) -> Cluster:
    return Cluster(tmp_path, processes, valkey.url)


def no_tracebacks(processes: Processes) -> None:
    for log in processes.log_dir.glob("*.log"):
        assert "Traceback" not in log.read_text(), f"{log.name}:\n{log.read_text()[-3000:]}"


def test_env_service_death_costs_only_its_instances(cluster: Cluster, processes: Processes) -> None:
    # The kill must land mid-chunk. Flow control 'drop': the rollout never idles at a chunk boundary. Long chunks:
    # a kill during a chunk's first step or while the last one is being appended leaves nothing partial, which
    # with 128-step chunks happened once in a clean-clone run.
    overrides = {"flow_control": "drop", "chunk_length": 1024}
    cluster = Cluster(cluster.path.parent, processes, cluster.url, rollout=overrides)
    cluster.start("env", "env-a")
    env_b = cluster.start("env", "env-b")
    cluster.start("trainer", "trainer")
    rollout = cluster.start("rollout", "rollout")
    wait_for(lambda: cluster.version() >= 2, 90, "two updates")
    env_a = processes.started[0]
    os.kill(env_a.pid, signal.SIGKILL)
    cluster.wait_progress(2048, 30, "collection to go on with env-b alone")
    wait_for(
        lambda: cluster.named("rollout").figures["partial_chunks_dropped"] >= 1,
        5,
        "the partial chunk dropped",
    )

    cluster.start("env", "env-a")  # a new incarnation on a new port, found through the registry
    restarted = wait_for(lambda: (r := cluster.named("env-a")) and r.restarts == 1 and r, 30, "env-a back")
    wait_for(
        lambda: cluster.named("env-a").figures["sessions"] >= 1, 5 + 1, "rollout to reconnect within 5 s"
    )
    assert restarted.incarnation != "" and cluster.named("env-a").restarts == 1

    for env in (processes.started[-1], env_b):  # the only env services die: the rollout waits
        os.kill(env.pid, signal.SIGKILL)
    wait_for(lambda: cluster.named("rollout").figures["connected_sessions"] == 0, 15, "sessions to drop")
    time.sleep(2)
    assert rollout.poll() is None
    cluster.start("env", "env-b")
    cluster.wait_progress(2048, 30, "collection to resume")
    version = cluster.version()
    wait_for(lambda: cluster.version() > version, 60, "learning to resume")
    no_tracebacks(processes)


def test_rollout_death_pauses_learning_and_frees_env_instances(
    cluster: Cluster, processes: Processes
) -> None:
    cluster.start("env", "env")
    cluster.start("trainer", "trainer")
    rollout = cluster.start("rollout", "rollout")
    wait_for(lambda: cluster.version() >= 2, 90, "two updates")
    os.kill(rollout.pid, signal.SIGKILL)
    wait_for(lambda: cluster.named("env").figures["free_instances"] == 4, 10, "the dead session's instances")
    time.sleep(3)
    stalled = cluster.version()
    time.sleep(2)
    assert cluster.version() == stalled and cluster.named("trainer") is not None  # waits, alive
    cluster.start("rollout", "rollout")
    wait_for(lambda: cluster.version() > stalled, 60, "learning to resume with a new rollout")
    no_tracebacks(processes)


@pytest.mark.parametrize("algorithm", ["ppo", "appo", "sac"])
def test_trainer_death_resumes_from_checkpoint_with_a_higher_version(
    tmp_path: Path, valkey, redis_client, processes: Processes, algorithm: str
) -> None:
    cluster = Cluster(tmp_path, processes, valkey.url)
    config = yaml.safe_load(cluster.path.read_text())
    if algorithm == "appo":  # the same run with another algorithm: its section holds PPO's fields it shares
        shared = config["trainer"].pop("ppo")
        shared.pop("gae_lambda", None)
        config["trainer"] |= {"algorithm": algorithm, algorithm: shared}
    if algorithm == "sac":  # the shipped SAC config's trainer and chunks, checkpointing as often
        sac = yaml.safe_load((REPO / "configs" / "pendulum-sac.yaml").read_text())
        config["trainer"] = sac["trainer"] | {"checkpoint": config["trainer"]["checkpoint"]}
        config["rollout"] |= sac["rollout"]
    cluster.path.write_text(yaml.safe_dump(config))
    cluster.start("env", "env")
    trainer = cluster.start("trainer", "trainer")
    cluster.start("rollout", "rollout")
    # a checkpoint is written between two steps on the trainer's cadence: under load it may come an update or two
    # after the one that made it due, so one is waited for on disk before the kill
    wait_for(
        lambda: cluster.version() >= 4 and any(cluster.run_dir.rglob("checkpoint-*.pt")), 90, "a checkpoint"
    )
    os.kill(trainer.pid, signal.SIGKILL)
    before = cluster.version()
    time.sleep(2)
    rollout = cluster.named("rollout")
    assert rollout.figures["policy_version"] <= before  # rollouts keep acting with the last weights
    cluster.start("trainer", "trainer")
    wait_for(lambda: cluster.version() > before, 60, "the restarted trainer to publish")
    log = next(processes.log_dir.glob("trainer-4.log")).read_text()
    assert re.search(r"resumed from .*checkpoint-\d+\.pt at policy version \d+", log), log[-2000:]
    if algorithm == "sac":  # the replay buffer comes back with the checkpoint
        restored = re.search(r"replay buffer restored: (\d+) transitions", log)
        assert restored and int(restored[1]) > 0, log[-2000:]
    no_tracebacks(processes)


@pytest.mark.parametrize("append_only", [True, False], ids=["aof", "no-persistence"])
def test_redis_restart(tmp_path: Path, processes: Processes, append_only: bool) -> None:
    data = tmp_path / "valkey"
    server = EmbeddedValkey(data, append_only=append_only)
    try:
        cluster = Cluster(tmp_path, processes, server.url)
        for kind in ("env", "trainer", "rollout"):
            cluster.start(kind, kind)
        wait_for(lambda: cluster.version() >= 2, 90, "two updates")
        time.sleep(1.5)  # let the append-only file catch up (appendfsync everysec)
        version = cluster.version()
        server.process.kill()
        server.process.wait()
        server.stop()
        time.sleep(1.0)
        server = EmbeddedValkey(data, port=server.port, append_only=append_only)
        if append_only:  # the state is back the moment Redis is
            assert cluster.version() >= version - 1
            assert {s.kind for s in cluster.services()} >= {"env", "rollout", "trainer"}
        wait_for(
            lambda: {s.kind for s in cluster.services()} == {"env", "rollout", "trainer"},
            15,
            "re-registration",
        )
        wait_for(lambda: cluster.version() > version, 60, "learning to go on after the restart")
        no_tracebacks(processes)
    finally:
        processes.stop_all()
        server.stop()


def test_backpressure_keeps_the_stream_and_memory_bounded(cluster: Cluster, processes: Processes) -> None:
    cluster = Cluster(
        cluster.path.parent, processes, cluster.url, rollout={"flow_control": "drop", "max_queued_chunks": 8}
    )
    cluster.start("env", "env")
    trainer = cluster.start("trainer", "trainer")
    rollout = cluster.start("rollout", "rollout")
    wait_for(lambda: cluster.version() >= 1, 60, "first weights")
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=10) == 0
    samples = []
    start = time.monotonic()
    while time.monotonic() - start < 12:  # rollouts run flat out for 12 s with nobody consuming
        time.sleep(1.5)
        rss_kb = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{rollout.pid}/status").read_text()).group(1))
        samples.append(
            (queued_chunks(cluster.client, RUN), cluster.client.info("memory")["used_memory"], rss_kb)
        )
    assert all(queued <= 8 for queued, _, _ in samples)
    first, last = samples[1], samples[-1]
    assert last[1] <= first[1] * 1.2 + 1_000_000, f"Redis memory grew: {samples}"
    assert last[2] <= first[2] * 1.2 + 20_000, f"rollout memory grew: {samples}"
    dropped = read_stats(cluster.client, RUN)["chunks_dropped_backpressure"]
    assert dropped > 20
    shown = subprocess.run(
        [sys.executable, "-m", "tinker_atropos", "status", "--redis-url", cluster.url],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    shown_dropped = re.search(r"chunks_dropped_backpressure=(\d+)", shown)
    assert shown_dropped and int(shown_dropped.group(1)) >= dropped, shown


def test_stopped_service_leaves_discovery_after_its_ttl_and_comes_back(cluster: Cluster, processes) -> None:
    env = cluster.start("env", "env")
    cluster.start("trainer", "trainer")
    cluster.start("rollout", "rollout")
    wait_for(lambda: cluster.version() >= 1, 60, "first weights")
    os.kill(env.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: cluster.named("env") is None, 2.0 + 3, "the stopped service to expire")
    finally:
        os.kill(env.pid, signal.SIGCONT)
    wait_for(lambda: cluster.named("env") is not None, 3, "the service to heartbeat again")
    cluster.wait_progress(2048, 30, "collection to resume on the same env process")
    assert cluster.named("env").restarts == 0


@pytest.mark.parametrize("kind", ["env", "rollout", "trainer"])
def test_a_resumed_service_drains_promptly_on_sigterm(cluster: Cluster, kind: str) -> None:
    """SIGCONT then SIGTERM, as a supervisor stops a paused container: the kernel may hand the SIGTERM to any
    thread, and the main thread must still notice it without waiting for another signal."""
    for attempt in range(3):
        service = cluster.start(kind, f"{kind}-{attempt}")
        wait_for(lambda n=f"{kind}-{attempt}": cluster.named(n), 30, f"the {kind} service to register")
        os.kill(service.pid, signal.SIGSTOP)
        time.sleep(0.2)
        os.kill(service.pid, signal.SIGCONT)
        os.kill(service.pid, signal.SIGTERM)
        try:
            service.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {kind} service ignored SIGTERM after a pause (attempt {attempt + 1})")
        assert service.returncode == 0
