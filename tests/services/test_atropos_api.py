"""The Atropos trajectory API against atroposlib 0.4.0's own server: the packing maths on random queues, and the
same scripted conversation (a trainer, three environments with weights, a minimum allocation, odd-sized groups,
gzip posts) sent to both servers, answer for answer. Then what the reference loses and ours keeps: a SIGKILLed
API service comes back with its queue and registrations, retried posts are not queued twice, a full queue refuses
with 503 and keeps its memory bounded."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from atroposlib.api.utils import (
    find_groups_summing_to_target,
    grab_batch_with_minimum_allocations,
    grab_exact_from_heterogeneous_queue,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.atropos import (
    HEADERS,
    KEY,
    TOKEN,
    Poller,
    chunked,
    env_registration,
    memory_kb,
    registration,
    reset_peak,
    scored_group,
)
from tests.support.processes import wait_for
from tests.support.running import REPO
from tinker_atropos.frontends.atropos.packing import EnvEntry, Queued, next_batch, summing_to
from tinker_atropos.processes import child_preexec, free_port
from tinker_atropos.state.registry import live_services

# ---------------------------------------------------------------------------------------------- the maths

SIZES = st.sampled_from([1, 2, 4, 8])
QUEUES = st.lists(st.tuples(SIZES, st.sampled_from([0, 1, 2, None])), max_size=40)


def _envs(allocations: list[float | None], connected: list[bool]) -> list[EnvEntry]:
    return [
        EnvEntry(512, 1.0, f"e{i}", f"e{i}_0", i, 0.0, c, a, 4)
        for i, (a, c) in enumerate(zip(allocations, connected, strict=True))
    ]


def _reference_batches(queue: list[dict[str, Any]], batch_size: int, envs: list[EnvEntry]) -> list[list[int]]:
    """Every batch the reference forms from ``queue`` at one /batch call, as indices into the original queue."""
    configs = [vars(e) for e in envs]
    allocating = any(e.min_batch_allocation is not None for e in envs)
    batches, rest = [], list(queue)
    while True:
        if allocating:
            batch, rest = grab_batch_with_minimum_allocations(rest, batch_size, configs)
        else:
            batch, rest = grab_exact_from_heterogeneous_queue(rest, batch_size)
        if batch is None:
            return batches
        batches.append([g["index"] for g in batch])


def _our_batches(
    queue: list[tuple[int, int | None]], batch_size: int, envs: list[EnvEntry]
) -> list[list[int]]:
    batches, rest = [], list(enumerate(queue))
    while (chosen := next_batch([Queued(s, e) for _, (s, e) in rest], batch_size, envs)) is not None:
        batches.append([rest[i][0] for i in chosen])
        rest = [item for i, item in enumerate(rest) if i not in set(chosen)]
    return batches


@settings(max_examples=300, deadline=None)
@given(
    queue=QUEUES,
    batch_size=st.sampled_from([4, 8, 16]),
    allocations=st.lists(st.sampled_from([None, None, 0.25, 0.5, 0.75]), min_size=3, max_size=3),
    connected=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_batches_are_the_references_on_random_queues(
    queue: list[tuple[int, int | None]],
    batch_size: int,
    allocations: list[float | None],
    connected: list[bool],
) -> None:
    envs = _envs(allocations, connected)
    reference_queue = [{"tokens": [[0]] * s, "env_id": e, "index": i} for i, (s, e) in enumerate(queue)]
    assert _our_batches(queue, batch_size, envs) == _reference_batches(reference_queue, batch_size, envs)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), max_size=12), target=st.integers(1, 16))
def test_odd_sized_groups_combine_as_the_references(sizes: list[int], target: int) -> None:
    assert summing_to(sizes, target) == find_groups_summing_to_target(
        [{"tokens": [[0]] * s} for s in sizes], target
    )


# ------------------------------------------------------------------------------------- the two servers


def _wait_up(url: str, process: subprocess.Popen, log: Path) -> None:
    def answers() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(url + "/", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, 60, f"the API at {url}")


def _start(command: list[str], log: Path, **environment: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child_preexec,
            cwd=REPO,
            env={**os.environ, **environment},
        )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _config(tmp_path: Path, port: int, **atropos: Any) -> Path:  # the run "atropos-test"
    path = tmp_path / "atropos.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "atropos-test"}, "atropos": {"port": port, **atropos}}))
    return path


def start_ours(
    tmp_path: Path, redis_url: str, port: int, name: str = "ours", *flags: str, **atropos: Any
) -> subprocess.Popen:
    """Our API service, with the run token ``TOKEN``: it asks the key derived from it (``HEADERS``)."""
    config = _config(tmp_path, port, **atropos)
    command = [sys.executable, "-m", "tinker_atropos", "atropos-api", "--config", str(config)]
    command += ["--redis-url", redis_url, "--port", "0", *flags]
    process = _start(command, tmp_path / f"{name}.log", TA_TOKEN=TOKEN)
    _wait_up(f"http://127.0.0.1:{port}", process, tmp_path / f"{name}.log")
    return process


class Conversation:
    """Sends each request to every server and keeps their answers side by side."""

    def __init__(self, urls: dict[str, str]) -> None:
        # every request with our key: the reference ignores it
        self.clients = {
            name: httpx.Client(base_url=url, timeout=30, headers=HEADERS) for name, url in urls.items()
        }
        self.answers: list[tuple[str, dict[str, Any]]] = []

    def send(
        self, method: str, path: str, body: Any = None, gzipped: bool = False, compare: bool = True
    ) -> Any:
        answers = {}
        for name, client in self.clients.items():
            if gzipped:
                data = gzip.compress(json.dumps(body).encode())
                headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
                response = client.request(method, path, content=data, headers=headers)
            else:
                response = client.request(method, path, json=body)
            assert response.status_code == 200, (name, path, response.text)
            answers[name] = response.json() if "json" in response.headers["content-type"] else response.text
        if compare:
            self.answers.append((f"{method} {path}", answers))
        return answers

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def script(c: Conversation) -> None:
    """Registrations, odd and even groups, weights, a minimum allocation, gzip, batches and statuses."""
    c.send("GET", "/info")
    c.send("GET", "/wandb_info")
    c.send("GET", "/status")
    c.send("GET", "/batch")  # before any trainer registered
    c.send(
        "POST",
        "/register",
        {
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": 16,
            "max_token_len": 512,
            "checkpoint_dir": "/ckpt",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": 100,
        },
        compare=False,
    )  # (a random id)
    c.send(
        "POST",
        "/register-env",
        {"max_token_length": 512, "desired_name": "math", "weight": 1.0, "group_size": 4},
    )
    c.send("GET", "/batch")  # the trainer starts
    c.send("GET", "/info")
    c.send("GET", "/wandb_info")
    for env in (
        {"max_token_length": 512, "desired_name": "math", "weight": 1.0, "group_size": 4},
        {"max_token_length": 1024, "desired_name": "code", "weight": 2.0, "group_size": 2},
        {"max_token_length": 256, "desired_name": "math", "weight": 0.5, "group_size": 8},
    ):
        c.send("POST", "/register-env", env)
    seed = 0

    def post(env_id: int | None, size: int, **extra: Any) -> None:
        nonlocal seed
        seed += 1
        c.send("POST", "/scored_data", scored_group(env_id, size, seed, **extra), gzipped=seed % 3 == 0)

    for env_id, size in ((0, 4), (1, 2), (0, 4), (2, 8), (1, 2), (1, 2), (0, 3), (0, 1), (2, 4), (0, 4)):
        post(env_id, size)
    for env_id in (0, 1, 2):
        c.send("GET", "/status-env", {"env_id": env_id})
    c.send("GET", "/status")
    c.send("GET", "/latest_example")
    for _ in range(3):
        c.send("GET", "/batch")
    c.send("GET", "/status")
    seed += 1
    c.send(
        "POST",
        "/scored_data_list",
        [
            scored_group(1, 2, seed),
            scored_group(0, 2, seed + 1),
            scored_group(0, 2, seed + 2),
            scored_group(2, 8, seed + 3),
            scored_group(None, 4, seed + 4),
        ],
        gzipped=True,
    )
    seed += 5
    for env_id in (0, 1, 2):
        c.send("GET", "/status-env", {"env_id": env_id})
    c.send("GET", "/batch")
    c.send("POST", "/disconnect-env", {"env_id": 2})
    c.send("POST", "/disconnect-env", {"env_id": 9})
    # an env owed a quarter of every batch: the allocating packer from now on
    c.send(
        "POST",
        "/register-env",
        {
            "max_token_length": 512,
            "desired_name": "code",
            "weight": 1.0,
            "group_size": 2,
            "min_batch_allocation": 0.25,
        },
    )
    for env_id, size in ((0, 4), (0, 4), (3, 2), (1, 2), (3, 2), (0, 4), (3, 2), (0, 4), (1, 2), (3, 2)):
        post(env_id, size)
    for env_id in (0, 1, 3):
        c.send("GET", "/status-env", {"env_id": env_id})
    for _ in range(3):
        c.send("GET", "/batch")
    c.send("GET", "/status")
    c.send("GET", "/latest_example")
    post(0, 4, overrides=[{"set_advantage_to_zero": True}] * 4, group_overrides={"group_size": 4})
    c.send("GET", "/batch")
    c.send("GET", "/status")


@pytest.mark.integration
def test_our_answers_equal_the_reference_servers_request_for_request(
    tmp_path: Path, valkey, redis_client
) -> None:
    reference_port, our_port = free_port(), free_port()
    reference = _start(
        [
            sys.executable,
            "-m",
            "atroposlib.cli.run_api",
            "--host",
            "127.0.0.1",
            "--port",
            str(reference_port),
        ],
        tmp_path / "reference.log",
    )
    ours = None
    try:
        _wait_up(f"http://127.0.0.1:{reference_port}", reference, tmp_path / "reference.log")
        ours = start_ours(tmp_path, valkey.url, our_port)
        conversation = Conversation(
            {"reference": f"http://127.0.0.1:{reference_port}", "ours": f"http://127.0.0.1:{our_port}"}
        )
        try:
            script(conversation)
        finally:
            conversation.close()
    finally:
        _stop(reference)
        if ours is not None:
            _stop(ours)
    served = [
        a for request, a in conversation.answers if request == "GET /batch" and a["reference"].get("batch")
    ]
    assert len(served) >= 4, "the script must make batches"
    assert all(sum(len(g["tokens"]) for g in a["reference"]["batch"]) == 16 for a in served)
    posts = [a["reference"] for request, a in conversation.answers if request == "POST /scored_data"]
    assert {"status": "buffered", "buffer_size": 0} in posts and {
        "status": "buffered",
        "buffer_size": 4,
    } in posts
    for request, answers in conversation.answers:
        assert answers["ours"] == answers["reference"], request


# ------------------------------------------------------------------------------ what the reference loses


def _seeds(batch: list[dict[str, Any]]) -> list[int]:
    return [g["tokens"][0][0] for g in batch]


@pytest.mark.integration
def test_a_killed_api_service_comes_back_with_its_queue_registrations_and_formed_batches(
    tmp_path: Path, valkey, redis_client
) -> None:
    """Every group posted is served exactly once across a SIGKILL, retried posts included."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = start_ours(tmp_path, valkey.url, port)
    served: list[int] = []
    try:
        with httpx.Client(base_url=url, timeout=30, headers=HEADERS) as api:
            api.post("/register", json=registration(8))
            assert api.get("/batch").json() == {"batch": None}
            env = api.post("/register-env", json=env_registration(4)).json()
            assert env["env_id"] == 0
            for seed in range(1, 6):
                assert api.post("/scored_data", json=scored_group(0, 4, seed)).json() == {
                    "status": "received"
                }
            served += _seeds(api.get("/batch").json()["batch"])  # two batches formed, the second served first
            assert api.get("/status").json() == {"current_step": 2, "queue_size": 1}

            ours.send_signal(signal.SIGKILL)
            ours.wait()
            ours = start_ours(tmp_path, valkey.url, port, name="ours-again")

            assert api.get("/status").json() == {"current_step": 2, "queue_size": 1}
            assert api.get("/info").json() == {"batch_size": 8, "max_token_len": 64}
            assert api.request("GET", "/status-env", json={"env_id": 0}).json()["queue_size"] == 1  # no 500
            short = {**scored_group(0, 4, 99), "masks": [[-100]] * 4}  # masks shorter than their tokens
            refused = api.post("/scored_data", json=short)
            assert refused.status_code == 422 and "masks[0] has 1 entries for 5 tokens" in refused.text
            assert api.get("/status").json() == {"current_step": 2, "queue_size": 1}  # nothing queued
            # an env retrying a post the dead server had taken: answered, not queued again
            for seed in (
                5,
                2,
            ):
                assert api.post("/scored_data", json=scored_group(0, 4, seed)).json() == {
                    "status": "received"
                }
            served += _seeds(api.get("/batch").json()["batch"])  # the batch formed before the kill
            for seed in (6, 7, 8):
                api.post("/scored_data", json=scored_group(0, 4, seed))
            served += _seeds(api.get("/batch").json()["batch"])
            served += _seeds(api.get("/batch").json()["batch"])
            assert api.get("/batch").json() == {"batch": None}
            figures = api.get("/healthz").json()
    finally:
        _stop(ours)
    assert sorted(served) == list(range(1, 9)), served
    assert (
        figures["groups_duplicate"] == 2
        and figures["groups_received"] == 8
        and figures["batches_served"] == 4
    )


def _rss_kb(pid: int) -> int:
    return int(
        next(
            line.split()[1]
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
    )


@pytest.mark.integration
def test_a_stalled_trainer_fills_the_bounded_queue_and_the_excess_is_refused_and_counted(
    tmp_path: Path, valkey, redis_client
) -> None:
    port = free_port()
    ours = start_ours(tmp_path, valkey.url, port, max_queue_sequences=64)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=HEADERS) as api:
            api.post("/register", json=registration(8))
            api.get("/batch")
            api.post("/register-env", json=env_registration(4))
            codes = [
                api.post("/scored_data", json=scored_group(0, 4, seed)).status_code for seed in range(1, 17)
            ]
            assert codes == [200] * 16  # 64 sequences: the bound
            rss_full = _rss_kb(ours.pid)
            refused = [api.post("/scored_data", json=scored_group(0, 4, seed)) for seed in range(100, 1600)]
            assert {r.status_code for r in refused} == {503}
            assert refused[0].headers["Retry-After"] == "1"
            assert "atropos.max_queue_sequences" in refused[0].json()["detail"]
            growth_kb = _rss_kb(ours.pid) - rss_full
            figures = api.get("/healthz").json()
            assert figures["groups_refused_full"] == 1500 and figures["queue_sequences"] == 64
            # the trainer comes back: one batch served frees its 8 sequences; formed batches still count
            batch = api.get("/batch").json()["batch"]
            assert len(batch) == 2 and api.get("/status").json() == {"current_step": 8, "queue_size": 0}
            codes = [
                api.post("/scored_data", json=scored_group(0, 4, seed)).status_code
                for seed in (2000, 2001, 2002)
            ]
            assert codes == [200, 200, 503]
    finally:
        _stop(ours)
    # 1,500 refused posts of ~250 bytes held would be ~0.4 MB; allow the allocator its noise, not a queue
    assert growth_kb < 4096, growth_kb


def test_malformed_state_in_redis_is_skipped_and_counted_and_the_rest_is_served(redis_client) -> None:
    """Whoever reaches Redis may write anything under the API's keys: a restart skips what it cannot read."""
    from tinker_atropos.frontends.atropos.store import TrajectoryStore

    store = TrajectoryStore(redis_client, "bad", max_queue_sequences=1000, dedup_window=100)
    store.register(registration(8))
    store.batch()
    store.register_env(env_registration(4))
    store.post([scored_group(0, 4, seed) for seed in (1, 2, 3)])
    prefix = "ta:bad:atropos"
    redis_client.rpush(f"{prefix}:queue", b"\xff not json", b"[1, 2]", b'{"gid": 1}')
    redis_client.rpush(f"{prefix}:envs", b"[]")
    redis_client.rpush(f"{prefix}:pending", b"[[1, 2]]")
    redis_client.hset(f"{prefix}:meta", "groups_received", "many")
    again = TrajectoryStore(redis_client, "bad", max_queue_sequences=1000, dedup_window=100)
    figures = again.figures()
    assert (
        figures["records_skipped"] == 5 and figures["queue_groups"] == 3 and figures["envs_registered"] == 2
    )
    assert again.status_env(0)["queue_size"] == 3
    assert [g["tokens"][0][0] for g in again.batch()["batch"]] == [1, 2]
    redis_client.hset(f"{prefix}:meta", "registration", "[1]")  # the trainer's registration unreadable
    third = TrajectoryStore(redis_client, "bad", max_queue_sequences=1000, dedup_window=100)
    assert third.info() == {"batch_size": -1, "max_token_len": -1} and third.figures()["records_skipped"] == 6
    third.register(registration(8))  # the trainer registers again, as it does at every start
    assert third.info() == {"batch_size": 8, "max_token_len": 64}


@pytest.mark.integration
def test_over_https_the_trainer_finds_the_api_in_the_registry_and_checks_its_certificate_by_the_service_name(
    tmp_path: Path, valkey, redis_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a cluster: the API advertises an address its certificate does not list (a pod IP there, 127.0.0.2
    here), and the run's clients check the services' name instead, as their gRPC channels do."""
    import threading

    import torch

    from tinker_atropos.config import parse_config
    from tinker_atropos.frontends.http import service_client
    from tinker_atropos.launcher.secrets import SERVICE_NAME, write_secrets
    from tinker_atropos.trainer.atropos_loop import AtroposLoop

    secrets = tmp_path / "secrets"
    write_secrets(secrets)
    for variable, file in (("TA_TLS_CERT", "tls.crt"), ("TA_TLS_KEY", "tls.key"), ("TA_TLS_CA", "ca.crt")):
        monkeypatch.setenv(variable, str(secrets / file))
    monkeypatch.setenv("TA_TOKEN", TOKEN)  # the API's and the trainer's: the keys are derived from it
    port = free_port("127.0.0.2")
    config = _config(tmp_path, port, host="127.0.0.2")
    ours = _start(
        [
            sys.executable,
            "-m",
            "tinker_atropos",
            "atropos-api",
            "--config",
            str(config),
            "--redis-url",
            valkey.url,
            "--port",
            "0",
        ],
        tmp_path / "ours.log",
    )
    try:
        url = wait_for(
            lambda: next(
                (s.figures.get("url") for s in live_services(redis_client, "atropos-test", "atropos_api")),
                None,
            ),
            60,
            "the API in the registry",
        )
        assert url == f"https://127.0.0.2:{port}"
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED|IP address mismatch"):
            httpx.get(f"{url}/info", verify=str(secrets / "ca.crt"))  # by its address: not in the certificate
        monkeypatch.setenv("TA_TLS_SERVER_NAME", SERVICE_NAME)
        with service_client(url, key=KEY) as client:
            assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
        trainer_config = parse_config(
            {
                "run": {"name": "atropos-test"},
                "trainer": {
                    "experience_loop": False,
                    "atropos": {"enabled": True, "batch_size": 8, "inference_port": 0},
                },
            }
        )
        loop = AtroposLoop(trainer_config, redis_client, tmp_path / "run", torch.device("cpu"))
        stop = threading.Event()
        learner = threading.Thread(target=loop.run, args=(stop,), daemon=True)
        learner.start()
        with service_client(url, key=KEY) as client:
            wait_for(lambda: client.get("/info").json()["batch_size"] == 8, 30, "the trainer's registration")
        stop.set()
        learner.join(timeout=30)
        assert loop.api_url == url and loop.inference.url.startswith("https://")
    finally:
        _stop(ours)


# ------------------------------------------------------------------------------ keys and bad groups


@pytest.mark.integration
def test_keys_by_default_and_groups_no_trainer_could_learn_from_refused_with_422_and_counted(
    tmp_path: Path, valkey, redis_client
) -> None:
    """No route but ``/`` and ``/healthz`` without the run's key (the reset that emptied a run, the forged group);
    the key as atroposlib's environments can send it, a URL's password; and a NaN score, a token id below 0 or a
    sequence past the trainer's ``max_token_len``: 422 naming it, counted, nothing queued."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = start_ours(tmp_path, valkey.url, port)
    try:
        with httpx.Client(base_url=url, timeout=30) as anyone:
            for method, path, body in (
                ("GET", "/reset_data", None),
                ("POST", "/scored_data", scored_group(0, 4, 1)),
                ("GET", "/batch", None),
                ("POST", "/register", registration(8)),
            ):
                for headers in ({}, {"X-API-Key": "not-the-key"}, {"Authorization": "Bearer not-the-key"}):
                    refused = anyone.request(method, path, json=body, headers=headers)
                    assert refused.status_code == 401, (path, headers, refused.text)
            assert anyone.get("/").status_code == 200 and anyone.get("/healthz").status_code == 200
        with httpx.Client(base_url=f"http://atropos:{KEY}@127.0.0.1:{port}", timeout=30) as api:  # Basic auth
            api.post("/register", json=registration(8, max_token_len=16)).raise_for_status()
            api.get("/batch").raise_for_status()
            api.post("/register-env", json=env_registration(4)).raise_for_status()
            sound = scored_group(0, 4, 1)
            bad = {
                "score": {**sound, "scores": [float("nan"), 0.0, 1.0, 2.0]},
                "token": {**sound, "tokens": [[-1, *t[1:]] for t in sound["tokens"]]},
                "length": {
                    **sound,
                    "tokens": [t + [0] * 16 for t in sound["tokens"]],
                    "masks": [m + [0] * 16 for m in sound["masks"]],
                },
            }
            for name, group in bad.items():
                answer = api.post(
                    "/scored_data", content=json.dumps(group), headers={"Content-Type": "application/json"}
                )
                assert answer.status_code == 422, (name, answer.text)
            assert "max_token_len 16" in answer.json()["detail"]
            listed = api.post(
                "/scored_data_list",
                content=json.dumps([sound, bad["length"]]),
                headers={"Content-Type": "application/json"},
            )
            assert listed.status_code == 422 and "body[1].tokens[0]" in listed.json()["detail"]
            assert api.post("/scored_data", json=sound).json() == {"status": "received"}
            figures = api.get("/healthz").json()
            assert figures["groups_refused_invalid"] == 5 and figures["groups_received"] == 1
            assert figures["queue_sequences"] == 4
        printed = subprocess.run(
            [sys.executable, "-m", "tinker_atropos", "api-keys"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TA_TOKEN": TOKEN},
        )
        # for environments elsewhere
        assert f"atropos-api  {KEY}" in printed.stdout, printed.stdout + printed.stderr
    finally:
        _stop(ours)


@pytest.mark.integration
def test_without_a_token_or_keys_file_the_api_starts_only_when_told_insecure(tmp_path: Path, valkey) -> None:
    config = str(_config(tmp_path, free_port()))
    command = [
        sys.executable,
        "-m",
        "tinker_atropos",
        "atropos-api",
        "--config",
        config,
        "--redis-url",
        valkey.url,
        "--port",
        "0",
    ]
    environment = {
        k: v for k, v in os.environ.items() if k not in ("TA_TOKEN", "TA_TOKEN_FILE", "TA_INSECURE")
    }
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)
    assert (
        refused.returncode == 2
        and "--insecure" in refused.stderr
        and "atropos.api_keys_file" in refused.stderr
    )
    port = free_port()
    open_command = [*command, "--insecure"]
    open_command[open_command.index(config)] = str(_config(tmp_path, port))
    ours = subprocess.Popen(
        open_command,
        stdout=open(tmp_path / "open.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=environment,
        preexec_fn=child_preexec,
    )
    try:
        _wait_up(f"http://127.0.0.1:{port}", ours, tmp_path / "open.log")
        assert httpx.get(f"http://127.0.0.1:{port}/info").status_code == 200  # no key asked
        assert "takes no API key (--insecure)" in (tmp_path / "open.log").read_text()
    finally:
        _stop(ours)


# ------------------------------------------------------------------------------ bodies bounded by what they build

MAX_MB = 16  # atropos.max_request_mb of the hostile test: the figures of the default 64 scale with it


def _gzipped_json(body: Any) -> bytes:
    return gzip.compress(json.dumps(body, separators=(",", ":")).encode(), compresslevel=9)


@pytest.mark.integration
def test_hostile_bodies_are_refused_within_ten_times_their_size_while_status_answers_within_a_second(
    tmp_path: Path, valkey, redis_client
) -> None:
    """Keyed, at the size bound: gzip posts inflating to 15 MiB of misaligned groups (three at once), a chunked
    post past the bound, a million bad ids, a body of empty lists, and a sound 12 MiB group. Each is answered with
    its reason, the process's peak memory grows by less than ten times one body and returns, and ``/status``
    answers within a second throughout (the old API held its event loop for seconds parsing each)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = start_ours(tmp_path, valkey.url, port, max_request_mb=MAX_MB)
    n = 1_500_000  # "1000," is 5 bytes: two rows of n are 15 MiB of JSON, 15 kB gzipped
    misaligned = _gzipped_json({"tokens": [[1000] * n], "masks": [[1000] * (n - 1)], "scores": [0.0]})
    sound = {
        "tokens": [[1000 + k] * 300_000 for k in range(4)],
        "masks": [[1000 + k] * 300_000 for k in range(4)],
        "scores": [0.0, 1.0, 0.0, 1.0],
        "env_id": 0,
    }
    gzip_headers = {**HEADERS, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    try:
        with httpx.Client(base_url=url, timeout=60, headers=HEADERS) as api:
            api.post("/register", json=registration(8, max_token_len=10**6)).raise_for_status()
            api.get("/batch")
            api.post("/register-env", json=env_registration(4)).raise_for_status()
            rss_before = memory_kb(ours.pid, "VmRSS")

            def post(
                content: Any, headers: dict[str, str] | None = None, path: str = "/scored_data"
            ) -> httpx.Response:
                with httpx.Client(base_url=url, timeout=60) as client:
                    return client.post(
                        path,
                        content=content,
                        headers=headers or {**HEADERS, "Content-Type": "application/json"},
                    )

            with Poller(f"{url}/status", HEADERS) as poller:
                one = post(misaligned, gzip_headers)
                peaks = {"one bomb": memory_kb(ours.pid, "VmHWM")}
                with ThreadPoolExecutor(3) as pool:
                    bombs = [one, *pool.map(lambda _: post(misaligned, gzip_headers), range(3))]
                peaks["three bombs"] = memory_kb(ours.pid, "VmHWM")
                over = post(chunked(MAX_MB + 1))
                bad_ids = post(
                    json.dumps({"tokens": [["x"] * 1_000_000], "masks": [[0] * 1_000_000], "scores": [0.0]})
                )
                empties = post(json.dumps({"tokens": [[]] * 4_000_000, "masks": [], "scores": []}))
                peaks["the rest"] = memory_kb(ours.pid, "VmHWM")
                accepted = post(_gzipped_json(sound), gzip_headers)
            peak = memory_kb(ours.pid, "VmHWM")
            rss_after = memory_kb(ours.pid, "VmRSS")
            figures = api.get("/healthz").json()
    finally:
        _stop(ours)
    for bomb in bombs:
        assert bomb.status_code == 422 and "masks[0] has 1499999 entries for 1500000 tokens" in bomb.text, (
            bomb.text
        )
    assert over.status_code == 413 and "atropos.max_request_mb" in over.text, over.text
    assert bad_ids.status_code == 422 and len(bad_ids.json()["detail"]) <= 6, bad_ids.text[:2000]
    assert empties.status_code == 413 and "arrays and objects" in empties.text, empties.text
    assert accepted.json() == {"status": "received"} and figures["groups_received"] == 1
    assert figures["groups_refused_invalid"] == 5  # the four bombs and the bad ids
    growth_mb = {
        what: (kb - rss_before) >> 10 for what, kb in {**peaks, "all": peak, "after": rss_after}.items()
    }
    print(f"memory growth (MiB): {growth_mb}; slowest /status {poller.slowest:.2f} s of {poller.answers}")
    assert poller.slowest < 1.0 and poller.answers > 20, (poller.slowest, poller.answers)
    assert growth_mb["one bomb"] < 10 * MAX_MB, growth_mb  # one body at the bound: under ten times its size
    # three at once are parsed one after the other: the two others are inflated meanwhile and held while they
    # wait, not parsed; all three cost under ten times their summed size (about 6 x here), not three parses
    assert growth_mb["all"] < 20 * MAX_MB, growth_mb
    assert growth_mb["after"] < 6 * MAX_MB, growth_mb  # most of what the bodies took is handed back


@pytest.mark.integration
def test_a_gzip_post_at_the_bound_costs_under_ten_times_its_inflated_size(tmp_path: Path, valkey) -> None:
    """Gzip posts inflating to the size bound, the bomb of misaligned rows (refused) and sound
    groups of ids, masks and log-probs (stored): the process's peak memory (VmHWM, reset before each post) grows by
    under ten times the inflated body. At c22db17 the bomb cost 11 times (each id a Python int of 36 bytes) and a
    sound group 14 (its rows as Python objects, then its JSON copied whole for Redis, twice)."""
    port = free_port()
    ours = start_ours(tmp_path, valkey.url, port, max_request_mb=MAX_MB)
    n = (MAX_MB << 20) // 10 - 100  # "1000," is 5 bytes: two rows of n fill the bound
    m = (MAX_MB << 20) // 80  # four sequences of ids, masks, log-probs: "1000, -100, -0.25, " in each
    sound = {
        "tokens": [[1000 + k] * m for k in range(4)],
        "masks": [[-100] * m] * 4,
        "scores": [0.0, 1.0, 0.0, 1.0],
        "inference_logprobs": [[-0.25] * m] * 4,
    }
    posts = {
        "bomb": {"tokens": [[1000] * n], "masks": [[1000] * (n - 1)], "scores": [0.0]},
        "sound": sound,
        "sound, spaced": {**sound, "scores": [1.0, 0.0, 1.0, 0.0]},  # as atroposlib's environments write it
    }
    answers, growth = {}, {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=HEADERS) as api:
            api.post("/register", json=registration(8, max_token_len=10**7)).raise_for_status()
            api.get("/batch")
            for name, group in posts.items():
                spaces = (", ", ": ") if "spaced" in name else (",", ":")
                inflated = json.dumps(group, separators=spaces).encode()
                assert len(inflated) <= MAX_MB << 20
                content = gzip.compress(inflated, compresslevel=6)
                rss = memory_kb(ours.pid, "VmRSS")
                reset_peak(ours.pid)
                answers[name] = api.post(
                    "/scored_data",
                    content=content,
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                )
                growth[name] = (memory_kb(ours.pid, "VmHWM") - rss) * 1024 / len(inflated)
    finally:
        _stop(ours)
    print(f"peak growth over the inflated body: {growth}")
    assert answers["bomb"].status_code == 422 and f"masks[0] has {n - 1} entries" in answers["bomb"].text
    assert all(answers[name].json() == {"status": "received"} for name in ("sound", "sound, spaced")), answers
    assert all(times < 10 for times in growth.values()), growth
