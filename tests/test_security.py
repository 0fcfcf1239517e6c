"""The run's token on every gRPC call: an env service started with one refuses calls without it (and with a
wrong one) with UNAUTHENTICATED, counts them and keeps serving the authorised client; health stays open for
probes; `up` makes a token per run and its services use it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.conftest import Processes, wait_for
from tests.support.running import config_file
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.runtime import check_health
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration
RUN = "secured"


def test_an_env_service_with_a_token_refuses_every_call_without_it(
    tmp_path: Path, processes: Processes, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-run\n")
    token.chmod(0o600)
    monkeypatch.setenv("TA_TOKEN_FILE", str(token))  # the service inherits it
    config = config_file(tmp_path, run={"name": RUN}, env={"instances": 2})
    processes.start("env", "--config", str(config), "--redis-url", valkey.url, "--port", "0", name="env")
    record = wait_for(
        lambda: next(iter(live_services(redis_client, RUN, "env")), None), 60, "the env service"
    )

    monkeypatch.delenv("TA_TOKEN_FILE")
    for wrong in (None, "not-the-token"):
        if wrong is not None:
            monkeypatch.setenv("TA_TOKEN", wrong)
        with EnvClient(record.address, "grpc") as client, pytest.raises(grpc.RpcError) as refused:
            client.describe(timeout_s=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in refused.value.details()
    assert check_health(record.address)  # probes need no token

    monkeypatch.delenv("TA_TOKEN")
    monkeypatch.setenv("TA_TOKEN_FILE", str(token))
    with EnvClient(record.address, "grpc") as client:
        assert client.describe(timeout_s=5).num_instances == 2
        session = client.open(num_instances=1, seed=1)  # the stream call carries it too
        assert session.num_instances == 1
        session.close()
    refused = wait_for(
        lambda: (r := next(iter(live_services(redis_client, RUN, "env")), None)) and r.figures.get("calls_refused"),
        10, "the refusals in the registry",
    )  # fmt: skip
    assert refused == 2
