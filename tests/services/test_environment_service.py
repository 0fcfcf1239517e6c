"""The environment service over its two carriers, real gRPC and the local Unix-socket fast path: sessions,
autoreset, and bad input that harms nobody else."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.environment.check import check_env
from tinker_atropos.environment.local_server import LocalSessionServer
from tinker_atropos.environment.service import EnvironmentServicer, add_to_server
from tinker_atropos.environment.streams import (
    GrpcSessionStream,
    LocalSessionStream,
    LocalStreamError,
    SessionStream,
    open_stream,
)
from tinker_atropos.protocol import local_stream, tensors
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import environment_pb2_grpc, tensor_pb2


@dataclass
class EnvUnderTest:
    """An env service in this process, reached over ``transport``."""

    stub: environment_pb2_grpc.EnvironmentStub
    local: LocalSessionServer
    transport: str

    def open(self) -> SessionStream:
        if self.transport == "grpc":
            return GrpcSessionStream(self.stub)
        return LocalSessionStream(self.local.address, threading.Event())

    def free_instances(self) -> int:
        return self.stub.Describe(pb.DescribeRequest()).free_instances


class Session:
    """A test client holding one session open."""

    def __init__(self, env: EnvUnderTest, num_instances: int, seed: int = 0) -> None:
        self.stream = env.open()
        self.stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=num_instances, seed=seed)))
        self.opened = self.stream.receive().opened
        self.id = self.opened.session_id

    def step(self, actions: np.ndarray | tensor_pb2.Tensor, session_id: str | None = None) -> pb.StepResult:
        message = actions if isinstance(actions, tensor_pb2.Tensor) else tensors.encode(actions)
        step = pb.StepRequest(session_id=self.id if session_id is None else session_id, actions=message)
        self.stream.send(pb.SessionRequest(step=step))
        return self.stream.receive().step

    def close(self) -> None:
        self.stream.close()


def _serve(env: dict, capacity: int, transport: str) -> Iterator[EnvUnderTest]:
    section = parse_config({"env": {**env, "instances": capacity}}).env
    servicer = EnvironmentServicer(section, check_env(section), takeover_after_s=3.0)
    local = LocalSessionServer(servicer.serve_stream, f"tinker-atropos-test/{uuid.uuid4().hex}")
    servicer.local_address = local.address
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    local.start()
    servicer.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield EnvUnderTest(environment_pb2_grpc.EnvironmentStub(channel), local, transport)
    servicer.close()
    local.stop()
    server.stop(0).wait()
    channel.close()


@pytest.fixture(params=["grpc", "local"])
def pendulum(request) -> Iterator[EnvUnderTest]:
    yield from _serve({"id": "Pendulum-v1"}, 4, request.param)


@pytest.fixture(params=["grpc", "local"])
def cartpole(request) -> Iterator[EnvUnderTest]:
    yield from _serve({"id": "CartPole-v1"}, 2, request.param)


def test_describe_reports_spaces_and_capacity(pendulum) -> None:
    info = pendulum.stub.Describe(pb.DescribeRequest())
    assert info.env_id == "Pendulum-v1"
    assert list(info.observation_space.box.shape) == [3]
    assert list(info.action_space.box.shape) == [1]
    np.testing.assert_allclose(tensors.decode(info.action_space.box.high), [2.0])
    assert (info.num_instances, info.free_instances) == (4, 4)


def test_session_steps_all_instances_in_one_message_and_seeds_reproducibly(pendulum) -> None:
    a, b = Session(pendulum, 2, seed=7), Session(pendulum, 2, seed=7)
    first = tensors.decode(a.opened.observations)
    assert first.shape == (2, 3) and first.dtype == np.float32
    np.testing.assert_array_equal(first, tensors.decode(b.opened.observations))
    assert not np.array_equal(first[0], first[1])  # instance i is seeded with seed + i
    result = a.step(np.zeros((2, 1), np.float32))
    assert tensors.decode(result.observations).shape == (2, 3)
    assert tensors.decode(result.rewards).dtype == np.float32
    assert pendulum.free_instances() == 0
    a.close()
    b.close()


def test_truncation_keeps_the_final_observation_apart_and_reports_the_episode(pendulum) -> None:
    session = Session(pendulum, 1)
    for _ in range(199):
        result = session.step(np.zeros((1, 1), np.float32))
        assert not tensors.decode(result.truncated)[0]
    result = session.step(np.zeros((1, 1), np.float32))  # Pendulum's time limit is 200 steps
    assert tensors.decode(result.truncated)[0] and not tensors.decode(result.terminated)[0]
    assert tensors.decode(result.final_indices).tolist() == [0]
    final, reset = tensors.decode(result.final_observations)[0], tensors.decode(result.observations)[0]
    assert not np.array_equal(final, reset)
    assert len(result.episodes) == 1 and result.episodes[0].length == 200
    assert result.episodes[0].episode_return < 0 and not result.episodes[0].terminated
    session.close()


def test_termination_is_reported_apart_from_truncation(cartpole) -> None:
    session = Session(cartpole, 1)
    for _ in range(100):  # always pushing right topples the pole within a few dozen steps
        result = session.step(np.ones(1, np.int64))
        if result.episodes:
            break
    assert tensors.decode(result.terminated)[0] and not tensors.decode(result.truncated)[0]
    assert result.episodes[0].terminated
    session.close()


def _expect_invalid(call, match: str) -> None:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in error.value.details()


@pytest.mark.parametrize(
    ("actions", "match"),
    [
        (np.zeros((3, 1), np.float32), "actions must have shape (2, 1), got (3, 1)"),
        (np.zeros((2, 1), np.int32), "Box actions must be float32 or float64, got int32"),
        (np.array([[0.0], [np.nan]], np.float32), "NaN or infinity (instances [1])"),
        (tensor_pb2.Tensor(dtype=1, shape=[2, 1], data=b"\0" * 3), "needs 8 bytes, got 3"),
    ],
    ids=["shape", "dtype", "nan", "bytes"],
)
def test_bad_actions_end_only_their_own_session(pendulum, actions, match: str) -> None:
    bystander, offender = Session(pendulum, 2), Session(pendulum, 2)
    _expect_invalid(lambda: offender.step(actions), match)
    for _ in range(3):  # the other session keeps being served
        bystander.step(np.zeros((2, 1), np.float32))
    assert pendulum.free_instances() == 2  # the offender's instances are back
    bystander.close()


def test_unknown_session_is_refused(pendulum) -> None:
    bystander, offender = Session(pendulum, 2), Session(pendulum, 2)
    _expect_invalid(
        lambda: offender.step(np.zeros((2, 1), np.float32), session_id="nope"), "unknown session 'nope'"
    )
    bystander.step(np.zeros((2, 1), np.float32))
    bystander.close()


def test_discrete_actions_out_of_range_are_refused(cartpole) -> None:
    session = Session(cartpole, 2)
    _expect_invalid(lambda: session.step(np.array([0, 2], np.int64)), "must lie in [0, 1]")


def test_first_request_must_open_and_capacity_is_enforced(pendulum) -> None:
    stream = pendulum.open()
    stream.send(pb.SessionRequest(step=pb.StepRequest(session_id="x")))
    _expect_invalid(stream.receive, "must be 'open'")
    holder = Session(pendulum, 4)
    with pytest.raises(grpc.RpcError) as error:
        Session(pendulum, 1)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    holder.close()


def test_unknown_env_id_fails_at_config_time() -> None:
    with pytest.raises(ConfigError, match="env.id: unknown Gymnasium env id 'NoSuchEnv-v0'"):
        parse_config({"env": {"id": "NoSuchEnv-v0"}})


def test_describe_advertises_the_local_path_and_auto_takes_it_when_reachable(pendulum) -> None:
    info = pendulum.stub.Describe(pb.DescribeRequest())
    assert info.local_address == pendulum.local.address
    stop = threading.Event()
    for transport, kind in [("auto", "local"), ("grpc", "grpc")]:
        stream = open_stream(pendulum.stub, info, transport, stop)
        assert stream.kind == kind
        stream.close()
    elsewhere = pb.EnvironmentInfo()  # an env service in another network namespace: nobody listens here
    elsewhere.CopyFrom(info)
    elsewhere.local_address = local_stream.local_address(f"tinker-atropos-test/{uuid.uuid4().hex}")
    stream = open_stream(pendulum.stub, elsewhere, "auto", stop)
    assert stream.kind == "grpc"
    stream.close()


def test_both_carriers_give_the_same_trajectory(pendulum) -> None:
    other = EnvUnderTest(pendulum.stub, pendulum.local, "grpc" if pendulum.transport == "local" else "local")
    a, b = Session(pendulum, 2, seed=3), Session(other, 2, seed=3)
    actions = np.random.default_rng(0).uniform(-2, 2, (20, 2, 1)).astype(np.float32)
    for step_actions in actions:
        ra, rb = a.step(step_actions), b.step(step_actions)
        assert ra.SerializeToString() == rb.SerializeToString()
    a.close()
    b.close()


def test_garbage_on_the_local_socket_ends_only_that_connection() -> None:
    for env in _serve({"id": "Pendulum-v1"}, 4, "local"):
        bystander = Session(env, 2)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(local_stream.socket_name(env.local.address))
            raw.sendall(local_stream.HEADER.pack(5) + b"\xff\xff\xff\xff\xff")
            frame = local_stream.receive(raw, pb.LocalFrame)
            assert frame.status.code == "INVALID_ARGUMENT" and "not a SessionRequest" in frame.status.message
            assert local_stream.receive(raw, pb.LocalFrame) is None  # then the server closes it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(local_stream.socket_name(env.local.address))
            raw.sendall(local_stream.HEADER.pack(local_stream.MAX_FRAME_BYTES + 1))
            assert "over the" in local_stream.receive(raw, pb.LocalFrame).status.message
        bystander.step(np.zeros((2, 1), np.float32))
        assert env.free_instances() == 2
        bystander.close()


def test_a_vanished_local_client_frees_its_instances_and_a_stopped_server_ends_its_sessions() -> None:
    for env in _serve({"id": "Pendulum-v1"}, 4, "local"):
        gone = Session(env, 4)
        gone.step(np.zeros((4, 1), np.float32))
        gone.stream.close()  # as when its process dies: the kernel closes the socket
        deadline = threading.Event()
        for _ in range(50):
            if env.free_instances() == 4:
                break
            deadline.wait(0.1)
        assert env.free_instances() == 4
        kept = Session(env, 2)
        env.local.stop()
        with pytest.raises(LocalStreamError) as error:
            kept.step(np.zeros((2, 1), np.float32))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        kept.close()


def test_a_failing_local_session_answers_unknown_and_the_server_keeps_serving() -> None:
    def broken(requests, abort):
        next(requests)
        raise RuntimeError("the simulator crashed")
        yield  # a generator, like the real session

    server = LocalSessionServer(broken, f"tinker-atropos-test/{uuid.uuid4().hex}")
    server.start()
    try:
        for _ in range(2):  # the second connection is served as the first was
            stream = LocalSessionStream(server.address, threading.Event())
            stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=1)))
            with pytest.raises(LocalStreamError) as error:
                stream.receive()
            assert error.value.code() == grpc.StatusCode.UNKNOWN
            assert error.value.details() == "RuntimeError: the simulator crashed"
            stream.close()
    finally:
        server.stop()


def test_the_local_socket_refuses_another_users_process_and_counts_it() -> None:
    """An abstract socket has no permissions: the kernel's peer credentials decide. Here the service pretends to
    run as another user, so this test's own connection is the foreign one."""

    def session(requests, abort):
        for _ in requests:
            yield pb.SessionResponse()

    server = LocalSessionServer(session, f"tinker-atropos-test/{uuid.uuid4().hex}")
    server.start()
    try:
        server.uid = os.getuid() + 1
        stream = LocalSessionStream(server.address, threading.Event())
        deadline = time.monotonic() + 10
        while server.peers_refused == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the service has written its reason and closed: our send breaks the pipe
        with pytest.raises(LocalStreamError) as error:
            stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=1)))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f"uid {os.getuid() + 1}" in error.value.details() and "over gRPC" in error.value.details()
        stream.close()
        assert server.peers_refused == 1

        server.uid = os.getuid()  # the service's own user is served
        stream = LocalSessionStream(server.address, threading.Event())
        stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=1)))
        assert stream.receive() == pb.SessionResponse()
        stream.close()
        assert server.peers_refused == 1
    finally:
        server.stop()
