"""A third party's env service, written from ``environment.proto`` alone (none of tinker_atropos's service code):
a counter env whose observation is ``[steps, seed]``, reward the action, truncated after 5 steps; with one
deliberate defect, chosen by name, for the conformance kit's tests. Tensors are encoded by hand, as another
implementation would: dtype, shape and little-endian bytes."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np

from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import environment_pb2_grpc, tensor_pb2

DEFECTS = ("none", "episode_length", "no_autoreset", "accepts_bad_actions")
EPISODE_STEPS, CAPACITY = 5, 4
DTYPES = {np.dtype(np.float32): 1, np.dtype(np.int32): 6, np.dtype(np.bool_): 9}


def tensor(array: np.ndarray) -> tensor_pb2.Tensor:
    array = np.ascontiguousarray(array)
    return tensor_pb2.Tensor(dtype=DTYPES[array.dtype], shape=list(array.shape), data=array.tobytes())


def box(low: float, high: float, shape: tuple[int, ...]) -> pb.Space:
    bounds = np.full(shape, low, np.float32), np.full(shape, high, np.float32)
    return pb.Space(box=pb.Box(shape=list(shape), dtype=1, low=tensor(bounds[0]), high=tensor(bounds[1])))


class CounterEnv(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, defect: str = "none") -> None:
        assert defect in DEFECTS, defect
        self.defect, self.free, self.lock = defect, CAPACITY, threading.Lock()

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.EnvironmentInfo:  # noqa: N802
        return pb.EnvironmentInfo(
            env_id="Counter-v0",
            observation_space=box(-1e6, 1e6, (2,)),
            action_space=box(-1.0, 1.0, (1,)),
            num_instances=CAPACITY,
            free_instances=self.free,
            incarnation="toy",
            backend="toy",
        )

    def Session(
        self, requests: Iterator[pb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:  # noqa: N802
        first = next(requests, None)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must be 'open'")
        with self.lock:
            n = first.open.num_instances or self.free
            if n > self.free:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{n} instances asked, {self.free} free")
            self.free -= n
        try:
            yield from self._serve(requests, context, n, first.open.seed)
        finally:
            with self.lock:
                self.free += n

    def _serve(
        self, requests: Iterator[pb.SessionRequest], context: grpc.ServicerContext, n: int, seed: int
    ) -> Iterator[pb.SessionResponse]:
        seeds, steps, returns = (seed + np.arange(n)).astype(np.float32), np.zeros(n, np.float32), np.zeros(n)
        session = uuid.uuid4().hex
        observe = lambda: np.stack([steps, seeds], axis=1)  # noqa: E731
        yield pb.SessionResponse(
            opened=pb.SessionOpened(
                session_id=session, incarnation="toy", num_instances=n, observations=tensor(observe())
            )
        )
        for request in requests:
            if request.step.session_id != session:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"unknown session {request.step.session_id!r}"
                )
            raw = request.step.actions
            actions = (
                np.frombuffer(raw.data, np.float32).reshape(tuple(raw.shape)) if raw.dtype == 1 else None
            )
            if self.defect != "accepts_bad_actions" and (
                actions is None or actions.shape != (n, 1) or not np.isfinite(actions).all()
            ):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"actions must be float32 of shape ({n}, 1), finite"
                )
            rewards = np.zeros(n, np.float32)
            if actions is not None and actions.shape == (n, 1):
                rewards = np.nan_to_num(actions[:, 0]).astype(np.float32)
            steps += 1
            returns += rewards
            ended = np.flatnonzero(steps >= EPISODE_STEPS).astype(np.int32)
            finals = observe()[ended]
            extra = 1 if self.defect == "episode_length" else 0
            episodes = [
                pb.EpisodeEnd(instance=int(i), episode_return=float(returns[i]), length=int(steps[i]) + extra)
                for i in ended
            ]
            if self.defect != "no_autoreset":
                steps[ended], returns[ended] = 0, 0.0
            truncated = np.zeros(n, np.bool_)
            truncated[ended] = True
            yield pb.SessionResponse(
                step=pb.StepResult(
                    observations=tensor(observe()),
                    rewards=tensor(rewards),
                    terminated=tensor(np.zeros(n, np.bool_)),
                    truncated=tensor(truncated),
                    final_observations=tensor(finals.reshape(-1, 2)),
                    final_indices=tensor(ended),
                    episodes=episodes,
                )
            )


def serve(defect: str) -> tuple[grpc.Server, str]:
    """The toy service on a free port of 127.0.0.1; (server, address)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    environment_pb2_grpc.add_EnvironmentServicer_to_server(CounterEnv(defect), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
