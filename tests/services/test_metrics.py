"""Prometheus metrics: the three services started with ``--metrics-port 0`` each serve a scrape that parses, holds
the named series with the run label, counts gRPC calls by method and code (refused and failed calls included),
and agrees with the status the service writes to the registry."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import Processes, wait_for
from tests.support.running import REPO, config_file
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.environment.streams import GrpcSessionStream
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

pytestmark = pytest.mark.integration

NAMED = {
    "env": {
        "tinker_atropos_env_steps",
        "tinker_atropos_env_episodes",
        "tinker_atropos_env_free_instances",
        "tinker_atropos_env_sessions",
        "tinker_atropos_env_bad_requests",
        "tinker_atropos_env_calls_refused",
    },
    "rollout": {
        "tinker_atropos_rollout_env_steps",
        "tinker_atropos_rollout_chunks_written",
        "tinker_atropos_rollout_policy_version",
        "tinker_atropos_rollout_episode_return_mean",
        "tinker_atropos_rollout_sessions_lost",
        "tinker_atropos_rollout_weights_rejected",
    },
    "trainer": {
        "tinker_atropos_trainer_updates",
        "tinker_atropos_trainer_busy_fraction",
        "tinker_atropos_trainer_policy_version",
        "tinker_atropos_trainer_policy_lag_mean",
        "tinker_atropos_trainer_losses",
        "tinker_atropos_trainer_chunks_consumed",
        "tinker_atropos_trainer_records_rejected",
    },
}


def scrape(address: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return {family.name: family for family in text_string_to_metric_families(response.read().decode())}


def test_every_service_serves_its_status_and_its_grpc_calls_to_prometheus(
    tmp_path: Path, valkey, redis_client, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_file(
        tmp_path,
        run={"name": "metrics"},
        env={"instances": 4},
        trainer={"samples_per_update": 512},
        rollout={"chunk_length": 32},
    )
    token = tmp_path / "token"
    token.write_text("metrics-test-token\n")
    monkeypatch.setenv("TA_TOKEN_FILE", str(token))  # the children's token, and our first probe's
    common = ["--config", str(config), "--redis-url", valkey.url, "--port", "0", "--metrics-port", "0"]
    processes.start("env", *common, name="env")
    processes.start("trainer", *common, "--run-dir", str(tmp_path / "run"), name="trainer")
    processes.start("rollout", *common, name="rollout")
    wait_for(lambda: (published_version(redis_client, "metrics") or 0) >= 2, 120, "two updates")
    services = {s.kind: s for s in live_services(redis_client, "metrics")}
    assert services.keys() == NAMED.keys()

    env = services["env"]
    with EnvClient(env.address, "grpc") as client:  # with the token: all instances taken, then a bad opening
        with pytest.raises(grpc.RpcError) as busy:
            client.open(1, seed=0)
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream = GrpcSessionStream(client._stub)
        stream.send(pb.SessionRequest(step=pb.StepRequest(session_id="x")))
        with pytest.raises(grpc.RpcError) as refused:
            stream.receive()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    monkeypatch.delenv("TA_TOKEN_FILE")
    with EnvClient(env.address, "grpc") as stranger, pytest.raises(grpc.RpcError) as unauthenticated:
        stranger.describe()
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED

    for kind, service in services.items():
        families = scrape(service.figures["metrics_address"])
        assert NAMED[kind] <= families.keys(), (kind, NAMED[kind] - families.keys())
        info = families[f"tinker_atropos_{kind}_service_info"].samples[0].labels
        assert info["run"] == "metrics" and info["incarnation"] == service.incarnation
        for name in NAMED[kind]:
            assert all(sample.labels["run"] == "metrics" for sample in families[name].samples), name
        assert families[f"tinker_atropos_{kind}_calls_refused"].type == "counter"

    env_families = scrape(env.figures["metrics_address"])
    calls = {
        (s.labels["grpc_method"], s.labels["grpc_code"]): s.value
        for s in env_families["grpc_server_handled"].samples
    }
    assert calls[("/tinker_atropos.v1.Environment/Session", "INVALID_ARGUMENT")] >= 1
    assert calls[("/tinker_atropos.v1.Environment/Session", "RESOURCE_EXHAUSTED")] >= 1
    assert calls[("/tinker_atropos.v1.Environment/Describe", "UNAUTHENTICATED")] >= 1
    assert calls[("/tinker_atropos.v1.Environment/Describe", "OK")] >= 2  # the rollout's, then ours
    assert env_families["tinker_atropos_env_bad_requests"].samples[0].value >= 1
    assert env_families["tinker_atropos_env_calls_refused"].samples[0].value >= 1
    assert env_families["tinker_atropos_env_free_instances"].type == "gauge"

    trainer = scrape(services["trainer"].figures["metrics_address"])
    assert trainer["tinker_atropos_trainer_updates"].samples[0].value >= 2
    assert {s.labels["loss"] for s in trainer["tinker_atropos_trainer_losses"].samples} >= {"policy_loss"}
    rollout = scrape(services["rollout"].figures["metrics_address"])
    # the Grafana dashboard asks only for series the services serve
    served = {
        family.name + ("_total" if family.type == "counter" else "")
        for families in (env_families, trainer, rollout)
        for family in families.values()
    }
    dashboard = json.loads((REPO / "deploy" / "grafana" / "tinker-atropos.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(?:tinker_atropos|grpc_server)_\w+", target["expr"])
    }
    assert len(asked) >= 15 and asked <= served, asked - served
    assert rollout["tinker_atropos_rollout_env_steps"].samples[0].value > 0
    assert rollout["tinker_atropos_rollout_episode_return_mean"].samples[0].value < 0  # Pendulum's
