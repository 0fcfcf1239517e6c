"""The minimal Redis ACL of ``deploy/redis-acl.conf``, tried on a training run: a private valkey-server loads the
file (with test passwords put where it says, the default user off), the env, rollout and trainer services each
connect as their own user and train (the Tinker API of the trainer included), ``status`` reads the run as the
read-only observer, Valkey's ACL log stays empty, and a user reaching past its rows is refused (NOPERM)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tinker
import yaml
from tinker import types

from tests.support.acl_valkey import ACL_FILE, USERS, AclValkey
from tests.support.atropos import HEADERS, TOKEN, env_registration, registration, scored_group
from tests.support.processes import Processes, wait_for
from tests.support.running import cli, config_file
from tests.support.tinker_server import KEY
from tinker_atropos.models.tiny_lm import ByteTokenizer
from tinker_atropos.processes import free_port
from tinker_atropos.state import keys
from tinker_atropos.state.experience import read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

pytestmark = pytest.mark.integration

RUN = "acl"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AclValkey]:
    valkey = AclValkey(tmp_path / "valkey")
    yield valkey
    valkey.stop()


def _running(server: AclValkey, processes: Processes, names: tuple[str, ...]) -> None:
    """Fail at once when a service died or a user was refused something (a service may retry it for ever)."""
    for name, process in zip(names, processes.started, strict=True):
        if process.poll() is not None:
            pytest.fail(f"{name} exited ({process.returncode}):\n{processes.log(name)[-3000:]}")
    if denied := server.denials():
        pytest.fail("refused by the ACL:\n" + "\n".join(denied))


def _tinker_session(url: str) -> None:
    """The Tinker API's Redis traffic: a session, a model, a training step, a sampler, a sample, the close."""
    tok = ByteTokenizer()
    ids = tok.encode("acl", add_bos=True) + [tok.eos_id]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], np.int64),
            "weights": np.ones(len(ids) - 1, np.float32),
        },
    )
    with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        model = service.create_lora_training_client(base_model="tiny-byte-lm", rank=4).result(timeout=60)
        backward = model.forward_backward([datum], "cross_entropy")
        model.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert np.isfinite(backward.result(timeout=60).metrics["loss:sum"])
        sampler = model.save_weights_and_get_sampling_client().result(timeout=60)
        prompt = types.ModelInput.from_ints(ids[:2])
        sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=1)).result(timeout=60)
        assert 1 <= len(sample.sequences[0].tokens) <= 4


def test_each_service_trains_as_its_own_acl_user_and_nothing_more(
    tmp_path: Path, server: AclValkey, processes: Processes
) -> None:
    tinker_port = free_port()
    (tmp_path / "keys").write_text(KEY + "\n")
    config = config_file(
        tmp_path,
        run={"name": RUN},
        env={"instances": 4},
        trainer={
            "samples_per_update": 512,  # 1 chunk of 4 instances x 128 steps
            "ppo": {"update_epochs": 2},
            "tinker": {"enabled": True, "port": tinker_port, "api_keys_file": str(tmp_path / "keys")},
        },
    )
    names = ("env", "trainer", "rollout")
    for name in names:
        extra = ("--run-dir", str(tmp_path / "run")) if name == "trainer" else ()
        processes.start(
            name, "--config", str(config), "--redis-url", server.url(name), "--port", "0", *extra, name=name
        )
    admin = server.admin

    def healthz() -> bool:
        _running(server, processes, names)
        try:
            response = httpx.get(f"http://127.0.0.1:{tinker_port}/api/v1/healthz", headers={"X-API-Key": KEY})
            return response.status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthz, 60, "the trainer's Tinker API", interval_s=0.2)
    failures: list[BaseException] = []

    def session() -> None:
        try:
            _tinker_session(f"http://127.0.0.1:{tinker_port}")
        except BaseException as error:  # handed to the test's thread
            failures.append(error)

    sdk = threading.Thread(target=session, daemon=True)  # the SDK retries a refused request for ever
    sdk.start()

    def finished() -> bool:
        _running(server, processes, names)
        return not sdk.is_alive()

    wait_for(finished, 90, "the Tinker session", interval_s=0.2)
    if failures:
        raise failures[0]

    def trained() -> bool:
        _running(server, processes, names)
        trainers = live_services(admin, RUN, "trainer")  # its figures lag a heartbeat behind
        consumed = trainers[0].figures.get("chunks_consumed", 0) if trainers else 0
        return (published_version(admin, RUN) or 0) >= 3 and consumed >= 3

    wait_for(trained, 90, "policy version 3", interval_s=0.2)
    stats = read_stats(admin, RUN)
    assert stats["env_steps"] > 0 and stats["episodes"] > 0 and stats["chunks_written"] >= 3, stats
    services = {s.kind: s for s in live_services(admin, RUN)}
    assert set(services) == {"env", "rollout", "trainer"}
    assert admin.smembers(f"ta:{RUN}:tinker:models") == set()  # the closed session's model is unloaded

    shown = cli("status", "--redis-url", server.url("observer"), timeout=60)  # every run: SCAN, then reads
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"run '{RUN}'" in shown.stdout and "chunks_written=" in shown.stdout
    for service in services.values():
        assert service.incarnation in shown.stdout
    assert server.denials() == []

    for name in ("rollout", "env", "trainer"):  # drained, each deregistering as itself
        processes.started[names.index(name)].send_signal(signal.SIGTERM)
        assert processes.started[names.index(name)].wait(timeout=15) == 0, processes.log(name)[-3000:]
    assert live_services(admin, RUN) == []
    for name in names:
        log = processes.log(name)
        assert "NOPERM" not in log and "Traceback" not in log, f"{name}:\n{log[-3000:]}"
    assert server.denials() == []

    # Past its rows, each user is refused: the rollout writing the weights the rollouts act with, the env
    # reading the experience, the observer writing anything.
    refusals = {
        "rollout": [
            lambda c: c.hset(keys.weights(RUN), "version", 99),
            lambda c: c.publish(keys.weights_channel(RUN), 99),
            lambda c: c.xread({keys.experience(RUN): "0-0"}, count=1),
        ],
        "env": [
            lambda c: c.xread({keys.experience(RUN): "0-0"}, count=1),
            lambda c: c.xlen(keys.experience(RUN)),
            lambda c: c.hget(keys.weights(RUN), "version"),
        ],
        "observer": [
            lambda c: c.hset(keys.stats(RUN), "env_steps", 0),
            lambda c: c.delete(keys.weights(RUN)),
            lambda c: c.hget(keys.weights(RUN) + "x", "version"),
        ],
        "trainer": [
            lambda c: c.hset(keys.service(RUN, "env", "forged"), "address", "x"),
            lambda c: c.get("not-a-run-key"),
        ],
    }
    for user, attempts in refusals.items():
        client = server.client(user)
        for attempt in attempts:
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt(client)
        client.close()
    assert published_version(admin, RUN) >= 3  # untouched

    # Narrowed to the run as the README says (ta:*: -> ta:RUN:): its own keys still, another run's no more.
    for line in ACL_FILE.read_text().replace("ta:*:", f"ta:{RUN}:").splitlines():
        if line.startswith("user ") and (name := line.split()[1]) in USERS:
            admin.execute_command("ACL", "SETUSER", f"{name}-{RUN}", *line.split()[2:], f">{name}")
    shown = cli(
        "status",
        "--redis-url",
        f"redis://observer-{RUN}:observer@127.0.0.1:{server.port}/0",
        "--run",
        RUN,
        timeout=60,
    )
    assert shown.returncode == 0 and f"run '{RUN}'" in shown.stdout, shown.stdout + shown.stderr
    admin.hset(keys.service("another", "env", "x"), "kind", "env")  # a run whose keys it may not read
    shown = cli(
        "status", "--redis-url", f"redis://observer-{RUN}:observer@127.0.0.1:{server.port}/0", timeout=60
    )
    assert shown.returncode == 1 and "needs --run RUN" in shown.stdout, shown.stdout + shown.stderr
    shown = cli("status", "--redis-url", f"redis://observer:wrong@127.0.0.1:{server.port}/0", timeout=60)
    assert shown.returncode == 1 and "refused the password in the URL" in shown.stdout, (
        shown.stdout + shown.stderr
    )
    narrowed = redis.Redis(port=server.port, username=f"trainer-{RUN}", password="trainer", socket_timeout=5)
    assert int(narrowed.hget(keys.weights(RUN), "version")) >= 3
    with pytest.raises(redis.exceptions.NoPermissionError):
        narrowed.hget(keys.weights("another"), "version")
    with pytest.raises(redis.exceptions.NoPermissionError):
        narrowed.publish(keys.weights_channel("another"), 1)
    narrowed.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port, socket_timeout=5).ping()  # the default user is off
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(server.url("env").replace(server.passwords["env"], "wrong")).ping()


def test_the_atropos_api_keeps_its_state_as_its_own_acl_user_and_nothing_more(
    tmp_path: Path, server: AclValkey, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("TA_TOKEN", TOKEN)  # the run's token: the API's key is derived from it
    config = tmp_path / "atropos.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": RUN}, "atropos": {"port": port}}))
    api_process = processes.start(
        "atropos-api",
        "--config",
        str(config),
        "--redis-url",
        server.url("atropos_api"),
        "--port",
        "0",
        name="atropos-api",
    )

    def answers() -> bool:
        _running(server, processes, ("atropos-api",))
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(answers, 60, "the trajectory API", interval_s=0.2)
    # every write, read
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=HEADERS) as api:
        api.post("/register", json=registration(4))
        assert api.get("/batch").json() == {"batch": None}
        assert api.post("/register-env", json=env_registration(2)).json()["env_id"] == 0
        for seed, size in ((1, 2), (2, 1), (3, 1), (4, 2), (4, 2)):
            assert api.post("/scored_data", json=scored_group(0, size, seed)).status_code == 200
        assert api.request("GET", "/status-env", json={"env_id": 0}).json()["queue_size"] == 3
        assert [len(g["tokens"]) for g in api.get("/batch").json()["batch"]] == [2, 1, 1]
        assert api.get("/latest_example").json()["tokens"][0][0] == 4
        assert api.post("/disconnect-env", json={"env_id": 0}).json() == {"status": "success"}
        shown = cli("status", "--redis-url", server.url("observer"), "--run", RUN, timeout=60)
        assert shown.returncode == 0 and "atropos_api" in shown.stdout, shown.stdout + shown.stderr
        assert api.get("/reset_data").text == "Reset successful"
        assert api.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    api_process.send_signal(signal.SIGTERM)
    assert api_process.wait(timeout=15) == 0, processes.log("atropos-api")[-3000:]
    log = processes.log("atropos-api")
    assert "NOPERM" not in log and "Traceback" not in log, log[-3000:]
    assert server.denials() == []
    client = server.client("atropos_api")
    for attempt in (
        lambda: client.hget(keys.weights(RUN), "version"),
        lambda: client.xread({keys.experience(RUN): "0-0"}, count=1),
        lambda: client.hset(keys.service(RUN, "trainer", "forged"), "address", "x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    client.close()
