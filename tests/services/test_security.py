"""What protects each link, tried on real processes: the run's token on every gRPC call (UNAUTHENTICATED,
counted, health open for probes), mutual TLS (plaintext, no certificate, another CA: no handshake), the refusal
of a non-loopback bind without them, the embedded Valkey's password (never on a command line; a service without
it names the file to set), a password in
the config masked where it is printed, and ``rediss://`` verified against TA_REDIS_CA."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import redis
import tinker

from tests.support.processes import Processes, wait_for
from tests.support.running import cli, config_file
from tests.support.tinker_server import KEY, TinkerTrainer
from tests.support.tls_proxy import TlsProxy
from tinker_atropos.config import load_config
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.launcher.secrets import write_secrets
from tinker_atropos.service_host import check_health
from tinker_atropos.state.connection import connect, connect_fast, masked
from tinker_atropos.state.embedded import EmbeddedValkey
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
        lambda: (
            (r := next(iter(live_services(redis_client, RUN, "env")), None))
            and r.figures.get("calls_refused")
        ),
        10,
        "the refusals in the registry",
    )
    assert refused == 2


def _tls_environment(monkeypatch: pytest.MonkeyPatch, folder: Path, *, client_ca: bool = True) -> None:
    """Point this process (and the services it starts) at the files of ``tinker-atropos secrets``."""
    monkeypatch.setenv("TA_TOKEN_FILE", str(folder / "token"))
    monkeypatch.setenv("TA_TLS_CERT", str(folder / "tls.crt"))
    monkeypatch.setenv("TA_TLS_KEY", str(folder / "tls.key"))
    monkeypatch.setenv("TA_TLS_CA", str(folder / "ca.crt"))
    if client_ca:
        monkeypatch.setenv("TA_TLS_CLIENT_CA", str(folder / "ca.crt"))


def test_mutual_tls_refuses_plaintext_no_certificate_and_another_ca_while_the_session_steps(
    tmp_path: Path, processes: Processes, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_secrets(ours)
    write_secrets(theirs)  # a CA of its own: its certificate is well-formed, and not ours
    _tls_environment(monkeypatch, ours)
    config = config_file(tmp_path, run={"name": "tls"}, env={"instances": 2})
    processes.start("env", "--config", str(config), "--redis-url", valkey.url, "--port", "0", name="env")
    record = wait_for(lambda: next(iter(live_services(redis_client, "tls", "env")), None), 60, "the env")
    assert check_health(record.address)  # over TLS

    authorised = EnvClient(record.address, "grpc")
    session = authorised.open(num_instances=1, seed=3)
    actions = np.zeros((1, 1), np.float32)
    session.step(actions)
    intruders = {
        "plaintext": {"TA_TLS_CA": None, "TA_TLS_CERT": None, "TA_TLS_KEY": None},
        "no client certificate": {"TA_TLS_CERT": None, "TA_TLS_KEY": None},
        "a certificate of another CA": {"TA_TLS_CERT": theirs / "tls.crt", "TA_TLS_KEY": theirs / "tls.key"},
        "a server checked against another CA": {"TA_TLS_CA": theirs / "ca.crt"},
    }
    for what, variables in intruders.items():
        with monkeypatch.context() as scoped:
            for name, value in variables.items():
                scoped.delenv(name) if value is None else scoped.setenv(name, str(value))
            with EnvClient(record.address, "grpc") as client, pytest.raises(grpc.RpcError) as refused:
                client.describe(timeout_s=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, what  # no TLS handshake, no call
        assert session.step(actions).rewards.shape == (1,), what  # the authorised session steps on
    session.close()
    authorised.close()
    assert processes.started[0].poll() is None


def test_a_non_loopback_bind_without_token_and_tls_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_file(tmp_path, redis={"unreachable_timeout_s": 1})
    nowhere = ("--config", str(config), "--redis-url", "redis://127.0.0.1:1/0", "--host", "0.0.0.0")
    for kind in ("env", "rollout", "trainer"):
        refused = cli(kind, *nowhere, "--port", "0")
        assert refused.returncode == 2, refused.stderr
        assert "refusing to serve on 0.0.0.0 without a token" in refused.stderr
        assert "and TLS" in refused.stderr and "tinker-atropos secrets" in refused.stderr
    allowed = cli("env", *nowhere, "--port", "0", "--insecure")  # gets past the check, to Redis
    assert "warning: --insecure: serving on 0.0.0.0 without" in allowed.stderr
    assert allowed.returncode == 1 and "unreachable" in allowed.stderr
    write_secrets(tmp_path / "secrets")
    _tls_environment(monkeypatch, tmp_path / "secrets", client_ca=False)
    configured = cli("env", *nowhere, "--port", "0")  # the CLI runs with this process's environment
    assert configured.returncode == 1 and "refusing" not in configured.stderr, configured.stderr


def test_the_embedded_valkey_wants_its_password_which_no_command_line_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password = "pw-" + "x" * 20
    server = EmbeddedValkey(tmp_path / "valkey", password=password)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0").ping()
        secret = tmp_path / "redis-password"
        secret.write_text(password + "\n")
        monkeypatch.setenv("TA_REDIS_PASSWORD_FILE", str(secret))
        assert connect(server.url).ping()
        assert password not in Path(f"/proc/{server.process.pid}/cmdline").read_text()
        assert (tmp_path / "valkey" / "valkey.conf").stat().st_mode & 0o777 == 0o600
        assert masked(server.client_url) == server.url.replace("//", "//:***@")

        # a service without the password, or with a wrong one, says at once which file to set (no 60 s of waiting)
        config = str(config_file(tmp_path))
        monkeypatch.delenv("TA_REDIS_PASSWORD_FILE")
        bare = cli("env", "--config", config, "--redis-url", server.url, timeout=60)
        assert bare.returncode == 2, bare.stderr[-2000:]
        assert bare.stderr.strip().splitlines()[-1] == (
            f"error: Redis at {server.url} wants a password: set TA_REDIS_PASSWORD_FILE to the file that holds it "
            "(a run of `up` keeps it in RUN_DIR/redis-password) or put it in the URL (redis://:PASSWORD@HOST:PORT)"
        )
        (tmp_path / "wrong").write_text("wrong\n")
        wrong = cli(
            "env",
            "--config",
            config,
            "--redis-url",
            server.url,
            env={"TA_REDIS_PASSWORD_FILE": str(tmp_path / "wrong")},
            timeout=60,
        )
        assert wrong.returncode == 2
        assert f"refused the password of TA_REDIS_PASSWORD_FILE {tmp_path / 'wrong'}" in wrong.stderr, (
            wrong.stderr
        )
    finally:
        server.stop()


def test_a_password_in_redis_url_is_masked_where_the_config_is_printed(tmp_path: Path) -> None:
    config = load_config(config_file(tmp_path, redis={"url": "redis://app:hunter2@redis:6379/0"}))
    assert "hunter2" not in config.to_yaml() and "redis://app:***@redis:6379/0" in config.to_yaml()
    assert config.redis.url == "redis://app:hunter2@redis:6379/0"


def test_rediss_with_the_ca_of_ta_redis_ca(tmp_path: Path, valkey, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS endpoint in front of Valkey (the embedded binary is built without TLS): ``rediss://`` verifies
    the server against TA_REDIS_CA, and refuses it without."""
    write_secrets(tmp_path / "secrets")
    with TlsProxy(tmp_path / "secrets", valkey.port) as port:
        url = f"rediss://127.0.0.1:{port}/0"
        with pytest.raises(redis.ConnectionError):
            connect_fast(url).ping()  # the system's CAs do not know ours
        monkeypatch.setenv("TA_REDIS_CA", str(tmp_path / "secrets" / "ca.crt"))
        client = connect(url)
        client.set("through-tls", b"1")
        assert redis.Redis.from_url(valkey.url).get("through-tls") == b"1"
        client.close()


def test_the_tinker_api_serves_https_with_the_services_certificate(
    tmp_path: Path, processes: Processes, valkey, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_secrets(tmp_path / "secrets")
    _tls_environment(monkeypatch, tmp_path / "secrets", client_ca=False)
    # how httpx, so the SDK, trusts it
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "secrets" / "ca.crt"))
    trainer = TinkerTrainer(processes, tmp_path, valkey.url, "tk-tls", scheme="https")
    trainer.start()
    rest = tinker.RestClient(base_url=trainer.url, api_key=KEY)
    models = rest.get_server_capabilities().result(timeout=30).supported_models
    assert any(m.model_name == "tiny-byte-lm" for m in models)
    with pytest.raises(httpx.TransportError):  # no plaintext beside it
        httpx.get(trainer.url.replace("https", "http") + "/api/v1/healthz", headers={"X-API-Key": KEY})
