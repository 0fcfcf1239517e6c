"""The conformance kit's clauses of what the server refuses and frees (``conformance.py``): the statuses of bad
requests, each of which must end only its own stream, capacity, and the instances a closed session gives back."""

from __future__ import annotations

import grpc
import gymnasium as gym
import numpy as np

from tinker_atropos.environment.client import EnvSession
from tinker_atropos.environment.probe import Probe, expect
from tinker_atropos.environment.streams import GrpcSessionStream
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2 as pb


class RefusalClauses:
    """What a bad or excessive request must get back, and what closing gives back; each check says what it saw,
    or raises a Violation."""

    CLAUSES: tuple[tuple[str, str], ...] = (
        ("bad_actions", "bad actions: INVALID_ARGUMENT, that session only"),
        ("unknown_session", "a step of another session: INVALID_ARGUMENT"),
        ("open_first", "a stream that does not open first: INVALID_ARGUMENT"),
        ("capacity", "more instances than free: RESOURCE_EXHAUSTED"),
        ("close", "closing a session frees its instances"),
    )

    def __init__(self, probe: Probe) -> None:
        self.probe, self.client = probe, probe.client

    def check_bad_actions(self) -> str:
        bystander = self.client.open(1, self.probe.seed) if self.probe.free() >= 2 else None
        try:
            space, shown = self.probe.info.action_space, []
            bad = {"a batch of the wrong size": np.zeros((2, *space.shape), self.probe.info.action_dtype)}
            if isinstance(space, gym.spaces.Box):
                bad["a NaN"] = np.full((1, *space.shape), np.nan, np.float32)
            else:
                bad["an action outside the space"] = np.array([space.start + space.n], np.int64)
            for what, actions in bad.items():
                session = self.client.open(1, self.probe.seed)
                try:
                    shown.append(
                        self.probe.expect_status(
                            lambda s=session, a=actions: s.step(a), grpc.StatusCode.INVALID_ARGUMENT, what
                        )
                    )
                finally:
                    session.close()
                if bystander is not None:
                    bystander.step(self.probe.actions(1))  # still served
        finally:
            if bystander is not None:
                bystander.close()
        return "; ".join(shown) + (
            "" if bystander else " (no second instance: the bystander was not checked)"
        )

    def check_unknown_session(self) -> str:
        stream = GrpcSessionStream(self.probe.stub)
        try:
            stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=1, seed=self.probe.seed)))
            opened = stream.receive().opened
            request = pb.StepRequest(
                session_id=opened.session_id + "-not", actions=tensors.encode(self.probe.actions(1))
            )
            stream.send(pb.SessionRequest(step=request))
            return self.probe.expect_status(
                stream.receive, grpc.StatusCode.INVALID_ARGUMENT, "a step of another session"
            )
        finally:
            stream.close()

    def check_open_first(self) -> str:
        stream = GrpcSessionStream(self.probe.stub)
        try:
            stream.send(
                pb.SessionRequest(
                    step=pb.StepRequest(session_id="x", actions=tensors.encode(self.probe.actions(1)))
                )
            )
            return self.probe.expect_status(
                stream.receive, grpc.StatusCode.INVALID_ARGUMENT, "a step before open"
            )
        finally:
            stream.close()

    def check_capacity(self) -> str:
        free = self.probe.free()
        return self.probe.expect_status(
            lambda: self.client.open(free + 1, self.probe.seed).close(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{free + 1} instances of {free} free",
        )

    def check_close(self) -> str:
        before = self.probe.free()
        sessions: list[EnvSession] = [self.client.open(before, self.probe.seed)]
        expect(self.probe.free() == 0, f"{self.probe.free()} free while all {before} are held")
        sessions[0].close()
        expect(
            self.probe.wait_free(before),
            f"{self.probe.free()} of {before} free {self.probe.free_timeout_s:g} s after the close",
        )
        return f"{before} instances back"
