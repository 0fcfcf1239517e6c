"""The environment service over real gRPC: sessions, autoreset, and bad input that harms nobody else."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.environment.service import EnvironmentServicer
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import environment_pb2_grpc, tensor_pb2


class Session:
    """A test client holding one bidi stream open."""

    def __init__(self, stub: environment_pb2_grpc.EnvironmentStub, num_instances: int, seed: int = 0) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = stub.Session(iter(self.requests.get, None))
        self.requests.put(pb.SessionRequest(open=pb.OpenSession(num_instances=num_instances, seed=seed)))
        self.opened = next(self.responses).opened
        self.id = self.opened.session_id

    def step(self, actions: np.ndarray | tensor_pb2.Tensor, session_id: str | None = None) -> pb.StepResult:
        message = actions if isinstance(actions, tensor_pb2.Tensor) else tensors.encode(actions)
        step = pb.StepRequest(session_id=self.id if session_id is None else session_id, actions=message)
        self.requests.put(pb.SessionRequest(step=step))
        return next(self.responses).step

    def close(self) -> None:
        self.requests.put(None)


def _server(env: dict, capacity: int) -> tuple[grpc.Server, environment_pb2_grpc.EnvironmentStub]:
    from concurrent import futures

    servicer = EnvironmentServicer(parse_config({"env": env}), capacity)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    environment_pb2_grpc.add_EnvironmentServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, environment_pb2_grpc.EnvironmentStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


@pytest.fixture
def pendulum() -> Iterator[environment_pb2_grpc.EnvironmentStub]:
    server, stub = _server({"id": "Pendulum-v1"}, capacity=4)
    yield stub
    server.stop(0).wait()


@pytest.fixture
def cartpole() -> Iterator[environment_pb2_grpc.EnvironmentStub]:
    server, stub = _server({"id": "CartPole-v1"}, capacity=2)
    yield stub
    server.stop(0).wait()


def test_describe_reports_spaces_and_capacity(pendulum) -> None:
    info = pendulum.Describe(pb.DescribeRequest())
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
    assert pendulum.Describe(pb.DescribeRequest()).free_instances == 0
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
    assert pendulum.Describe(pb.DescribeRequest()).free_instances == 2  # the offender's instances are back
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
    requests = [pb.SessionRequest(step=pb.StepRequest(session_id="x"))]
    _expect_invalid(lambda: next(pendulum.Session(iter(requests))), "must be 'open'")
    holder = Session(pendulum, 4)
    with pytest.raises(grpc.RpcError) as error:
        Session(pendulum, 1)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    holder.close()


def test_unknown_env_id_fails_at_config_time() -> None:
    with pytest.raises(ConfigError, match="env.id: unknown Gymnasium env id 'NoSuchEnv-v0'"):
        parse_config({"env": {"id": "NoSuchEnv-v0"}})
