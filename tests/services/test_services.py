"""The three services started one by one, as containers or other machines would start them."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from tests.support.processes import wait_for
from tests.support.running import REPO
from tinker_atropos.protocol.v1 import services_pb2, services_pb2_grpc
from tinker_atropos.state.experience import read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tinker_atropos", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(("transport", "carrier"), [("auto", "local"), ("grpc", "grpc")])
def test_services_discover_each_other_through_redis_and_drain_on_sigterm(
    tmp_path: Path, valkey, redis_client, processes, transport: str, carrier: str
) -> None:
    config = yaml.safe_load((REPO / "configs" / "pendulum.yaml").read_text())
    config["run"]["name"] = "services-test"
    config["env"]["instances"] = 4
    config["rollout"]["transport"] = transport
    config["trainer"]["samples_per_update"] = 1024  # 2 chunks of 4 instances x 128 steps
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    common = ["--config", str(path), "--redis-url", valkey.url, "--port", "0"]
    procs = {
        "env": processes.start("env", *common, name="env"),
        "trainer": processes.start("trainer", *common, "--run-dir", str(tmp_path / "run"), name="trainer"),
        "rollout": processes.start("rollout", *common, name="rollout"),
    }
    services = wait_for(
        lambda: (
            len(live_services(redis_client, "services-test")) == 3
            and live_services(redis_client, "services-test")
        ),
        60,
        "three registered services",
    )
    assert {s.kind for s in services} == {"env", "rollout", "trainer"}
    assert len({s.incarnation for s in services}) == 3

    for service in services:  # the standard gRPC health protocol, through the CLI as a container would
        assert cli("health", service.address).returncode == 0, service

    wait_for(lambda: (published_version(redis_client, "services-test") or 0) >= 2, 120, "two PPO updates")
    assert read_stats(redis_client, "services-test")["env_steps"] > 0
    # same host: the socket, unless told
    assert f"open over {carrier}: 4 instances" in processes.log("rollout")

    trainer = next(s for s in services if s.kind == "trainer")
    with grpc.insecure_channel(trainer.address) as channel:
        reply = services_pb2_grpc.StatusStub(channel).GetStatus(services_pb2.StatusRequest(), timeout=5)
    status = reply.trainer  # every service answers Status.GetStatus, each with its own message
    assert reply.WhichOneof("kind") == "trainer"
    assert status.policy_version >= 2 and status.chunks_consumed >= 2 * 2

    shown = cli("status", "--redis-url", valkey.url, "--run", "services-test")
    assert shown.returncode == 0
    for service in services:
        assert service.incarnation in shown.stdout

    for name in ("rollout", "env", "trainer"):
        started = time.monotonic()
        procs[name].send_signal(signal.SIGTERM)
        assert procs[name].wait(timeout=10) == 0, processes.log(name)
        assert time.monotonic() - started < 10
    assert live_services(redis_client, "services-test") == []  # each deregistered on its way out
    assert list((tmp_path / "run" / "checkpoints").glob("checkpoint-*.pt")), "the trainer checkpoints on stop"
    assert cli("health", services[0].address).returncode == 1


def test_a_service_without_redis_url_says_how_to_give_one(tmp_path: Path) -> None:
    result = cli("env", "--config", str(REPO / "configs" / "pendulum.yaml"))
    assert result.returncode == 2
    assert "no Redis URL" in result.stderr


def test_a_bad_config_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("env:\n  id: Pendulum-v1\n  backend: bullet/physics\n")
    result = cli("trainer", "--config", str(path), "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 2
    assert (
        "env.backend: neither a registered backend's name (such as 'gymnasium', 'mujoco') nor 'module:Class'"
        in (result.stderr)
    )
