"""Running services fed garbage on every port (gRPC, each unary method, the local socket) survive and go on serving
well-behaved clients."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2

from tests.support.fuzz import frames
from tests.support.processes import Processes, wait_for
from tests.support.raw_env import RUN, RawStream, start_env
from tests.support.running import config_file
from tinker_atropos.environment.client import EnvClient
from tinker_atropos.protocol import local_stream
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import services_pb2, services_pb2_grpc
from tinker_atropos.service_host import check_health
from tinker_atropos.state import registry


# -- running services fed garbage on every port --------------------------------------------------------------
@dataclass
class Running:
    env: registry.ServiceRecord
    trainer: registry.ServiceRecord
    processes: Processes
    client: redis.Redis


@pytest.fixture(scope="module")
def running(valkey, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A real env service and a real trainer as processes on free ports of 127.0.0.1, for the whole module."""
    directory = tmp_path_factory.mktemp("fuzz-services")
    processes = Processes(directory)
    client = redis.Redis.from_url(valkey.url)
    try:
        config = config_file(directory, run={"name": RUN}, env={"instances": 4})  # what start_env writes too
        processes.start(
            "trainer",
            "--config",
            str(config),
            "--redis-url",
            valkey.url,
            "--port",
            "0",
            "--run-dir",
            str(directory / "run"),
            name="trainer",
        )
        env = start_env(directory, processes, valkey.url, client)
        trainer = wait_for(
            lambda: next(iter(registry.live_services(client, RUN, "trainer")), None), 60, "the trainer"
        )
        yield Running(env, trainer, processes, client)
    finally:
        processes.stop_all()
        client.close()


def status_of(address: str) -> services_pb2.ServiceStatus:
    with grpc.insecure_channel(address) as channel:
        return services_pb2_grpc.StatusStub(channel).GetStatus(services_pb2.StatusRequest(), timeout=5)


def assert_still_serving(running: Running) -> None:
    """Both processes alive, health SERVING, GetStatus answered, and an env client opens a session and steps over
    the local socket and over gRPC, getting every instance back."""
    for process in running.processes.started:
        assert process.poll() is None, running.processes.log("env") + running.processes.log("trainer")
    for name in ("env", "trainer"):  # grpcio logs one traceback per request it cannot parse; no other
        log = running.processes.log(name)
        assert log.count("Traceback") == log.count("ERROR grpc._common: Exception deserializing message!"), (
            log
        )
    for service, kind in ((running.env, "environment"), (running.trainer, "trainer")):
        assert check_health(service.address, timeout_s=5), service
        assert status_of(service.address).WhichOneof("kind") == kind
    for transport, carrier in (("auto", "local"), ("grpc", "grpc")):
        with EnvClient(running.env.address, transport) as client:
            wait_for(lambda c=client: c.describe().free_instances == 4, 10, "every instance free")
            session = client.open(4, seed=1)
            assert session.carrier == carrier and session.observations.shape == (4, 3)
            assert session.step(np.zeros((4, 1), np.float32)).rewards.shape == (4,)
            session.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def http2_frame(rng: random.Random) -> bytes:
    """A frame header of any type, flags and stream, whose length may not match its payload."""
    payload = rng.randbytes(rng.choice([0, 1, 8, 64, 300]))
    length = len(payload) if rng.random() < 0.6 else rng.choice([0, 9, 2**14, 2**24 - 1])
    kind = rng.choice([0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8, 0x9, rng.randrange(256)])
    stream = rng.choice([0, 1, 3, 2**31 - 1, rng.randrange(2**32)])
    return length.to_bytes(3, "big") + bytes([kind, rng.randrange(256)]) + stream.to_bytes(4, "big") + payload


def garbage_connection(port: int, rng: random.Random) -> socket.socket:
    """A connection that sent garbage: random bytes, or the HTTP/2 preface and garbage frames, maybe cut off
    in the middle of one. Returned open: the caller closes it, abruptly or not."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
    kind = rng.choice(["bytes", "frames", "frames", "cut"])
    if kind == "bytes":
        data = rng.randbytes(rng.randrange(1, 2000))
    else:
        data = PREFACE + b"".join(http2_frame(rng) for _ in range(rng.randrange(1, 6)))
        if kind == "cut":
            data = data[: rng.randrange(len(PREFACE), len(data) + 1)]
    with contextlib.suppress(OSError):  # the server already hung up on what it read: what it should do
        sock.sendall(data)
    return sock


def close(sock: socket.socket, rng: random.Random) -> None:
    if rng.random() < 0.5:  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


@pytest.mark.integration
def test_garbage_on_the_grpc_ports_leaves_both_services_serving(running: Running) -> None:
    """Raw TCP garbage and half-open connections on the env service's and the trainer's gRPC port: each connection
    harms only itself, also while 30 half-sent ones are held open."""
    rng = random.Random(7)
    for service in (running.env, running.trainer):
        port = int(service.address.rsplit(":", 1)[1])
        for _ in range(60):
            close(garbage_connection(port, rng), rng)
        held = [garbage_connection(port, rng) for _ in range(30)]
        assert check_health(service.address, timeout_s=5)
        for sock in held:
            close(sock, rng)
    assert_still_serving(running)


OK_OR_REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,  # grpcio's answer to a request its deserializer cannot parse
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,  # a health check of a service name that is not served
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a health watch, which streams until its deadline
}
UNARY_METHODS = [
    "/tinker_atropos.v1.Environment/Describe",
    "/tinker_atropos.v1.Status/GetStatus",
    "/grpc.health.v1.Health/Check",
    "/tinker_atropos.v1.Environment/Nothing",
    "/no.such.Service/Method",
]


def garbage_request(rng: random.Random) -> bytes:
    valid = rng.choice(
        [
            pb.DescribeRequest(),
            services_pb2.StatusRequest(),
            health_pb2.HealthCheckRequest(service="x"),
            pb.SessionRequest(open=pb.OpenSession(num_instances=1)),
        ]
    ).SerializeToString()
    data = bytearray(valid + rng.randbytes(rng.randrange(0, 12)))
    for _ in range(rng.randrange(0, 4)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data) if rng.random() < 0.8 else rng.randbytes(rng.randrange(0, 64))


@pytest.mark.integration
def test_garbage_requests_to_every_method_are_answered_or_refused_with_a_status(running: Running) -> None:
    """Raw request bytes to each method of both services (and to methods they do not have), through identity
    serializers: an answer or a status that says the request was refused, never UNKNOWN or UNAVAILABLE."""
    rng = random.Random(11)
    for service in (running.env, running.trainer):
        with grpc.insecure_channel(service.address) as channel:
            for method in UNARY_METHODS:
                call = channel.unary_unary(method)
                for _ in range(15):
                    try:
                        assert isinstance(call(garbage_request(rng), timeout=5), bytes)
                    except grpc.RpcError as error:
                        assert error.code() in OK_OR_REFUSED, (method, error)
            watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
            for _ in range(5):
                with pytest.raises(grpc.RpcError) as ended:
                    list(watch(garbage_request(rng), timeout=0.3))
                assert ended.value.code() in OK_OR_REFUSED
    invalid = 0
    # the session stream: garbage after any first frame
    with grpc.insecure_channel(running.env.address) as channel:
        for _ in range(25):
            stream = RawStream(channel)
            first = pb.SessionRequest(open=pb.OpenSession(num_instances=rng.randrange(0, 6)))
            stream.send(first.SerializeToString() if rng.random() < 0.5 else garbage_request(rng))
            for _ in range(rng.randrange(0, 3)):
                stream.send(garbage_request(rng))
            stream.send(b"\xff\xff")  # never a SessionRequest: every stream ends, with a status
            wait_for(lambda s=stream: s.ended is not None, 10, "the stream to end")
            assert stream.ended.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
            invalid += stream.ended.code() == grpc.StatusCode.INVALID_ARGUMENT
            stream.close()
    assert invalid and status_of(running.env.address).environment.bad_requests >= invalid
    assert_still_serving(running)


def local_garbage(rng: random.Random) -> bytes:
    """Bytes for the local socket: random, a header claiming anything, a valid open then garbage, cut frames."""
    open_frame = frames(pb.SessionRequest(open=pb.OpenSession(num_instances=rng.randrange(0, 6))))
    kind = rng.choice(["bytes", "header", "open then bytes", "cut", "huge"])
    if kind == "bytes":
        return rng.randbytes(rng.randrange(1, 200))
    if kind == "header":
        return local_stream.HEADER.pack(rng.randrange(0, 64)) + rng.randbytes(rng.randrange(0, 64))
    if kind == "open then bytes":
        return open_frame + local_stream.HEADER.pack(8) + rng.randbytes(8)
    if kind == "cut":
        return open_frame[: rng.randrange(1, len(open_frame))]
    return local_stream.HEADER.pack(rng.choice([local_stream.MAX_FRAME_BYTES, 2**32 - 1])) + b"x"


def vm_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.integration
def test_garbage_on_the_local_socket_ends_only_its_connection(running: Running) -> None:
    """The env service's local fast path: each garbage connection gets a status frame or is closed, responses are
    real frames, and headers claiming 256 MiB commit no memory."""
    with EnvClient(running.env.address, "grpc") as client:
        address = client.describe().local_address
    rng = random.Random(13)
    statuses = set()
    for _ in range(40):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(local_stream.socket_name(address))
            sock.sendall(local_garbage(rng))
            sock.shutdown(socket.SHUT_WR)
            # responses, then a status or the end; past a status the socket may read as reset (the service
            # closed it with our garbage unread), so a status is the last thing read
            while (frame := local_stream.receive(sock, pb.LocalFrame)) is not None:
                if frame.WhichOneof("kind") == "status":
                    statuses.add(frame.status.code)
                    break
                assert frame.WhichOneof("kind") == "response"
    assert statuses and statuses <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, statuses
    env_pid = running.processes.started[1].pid  # started after the trainer
    before = vm_rss_mib(env_pid)
    held = []
    for _ in range(4):  # every stream the env admits, each waiting for a 256 MiB frame
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(local_stream.socket_name(address))
        sock.sendall(local_stream.HEADER.pack(local_stream.MAX_FRAME_BYTES) + b"x")
        held.append(sock)
    time.sleep(0.5)
    grown = vm_rss_mib(env_pid) - before
    for sock in held:
        sock.close()
    assert grown < 128, f"the env service grew by {grown:.0f} MiB for four frame headers"
    assert_still_serving(running)
