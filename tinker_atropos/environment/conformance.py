"""``tinker-atropos conformance ADDR``: does the server at ADDR keep the environment contract
(``protocol/v1/environment.proto``)? For ours, or a third party's in any language, before a rollout depends on it.

Each row is one clause of the contract, checked over gRPC with sessions of its own (the service must have free
instances): Describe, opening a session and its seeded reset, a batched step's shapes and types, the autoreset
rule, the episode reports, the statuses of bad requests (which must end only their own stream), capacity, and
instances freed on close. A row that fails says what was expected and what came.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import gymnasium as gym
import numpy as np

from tinker_atropos.environment.client import CHANNEL_OPTIONS, EnvClient, EnvDescription, EnvSession
from tinker_atropos.environment.streams import GrpcSessionStream
from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import environment_pb2_grpc
from tinker_atropos.security import open_channel


class Violation(AssertionError):
    """A clause of the contract the server broke; the message says how."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Violation(message)


@dataclass(frozen=True)
class Row:
    name: str  # the check: describe, open, seeded_reset, step, episodes, bad_actions, …
    clause: str
    passed: bool
    detail: str


class Probe:
    """A connection to the server under test, and what every check asks of it: its description, its free
    instances, random valid actions, a call expected to fail with a status."""

    def __init__(
        self, address: str, seed: int = 0, max_steps: int = 5000, free_timeout_s: float = 5.0
    ) -> None:
        self.address, self.seed = address, seed
        self.max_steps, self.free_timeout_s = max_steps, free_timeout_s
        self.client = EnvClient(address, "grpc")
        self._channel = open_channel(address, CHANNEL_OPTIONS)
        self._stub = environment_pb2_grpc.EnvironmentStub(self._channel)
        self.info: EnvDescription | None = None
        self._rng = np.random.default_rng(seed)

    def close(self) -> None:
        self.client.close()
        self._channel.close()

    @property
    def _info(self) -> EnvDescription:
        if self.info is None:
            self.info = self.client.describe()
        return self.info

    def _free(self) -> int:
        return self.client.describe().free_instances

    def _actions(self, n: int) -> np.ndarray:
        space = self._info.action_space
        space.seed(int(self._rng.integers(2**31)))
        return np.stack([space.sample() for _ in range(n)]).astype(self._info.action_dtype)

    def _n(self) -> int:
        free = self._free()
        expect(free >= 1, "no free instance to check with: stop what holds them")
        return min(2, free)

    def _expect_status(self, call: Callable[[], object], code: grpc.StatusCode, what: str) -> str:
        try:
            call()
        except grpc.RpcError as error:
            expect(error.code() == code, f"{what}: {error.code().name} ({error.details()}), not {code.name}")
            return f"{code.name}: {error.details()}"
        raise Violation(f"{what}: accepted, not {code.name}")

    def _wait_free(self, expected: int) -> bool:
        deadline = time.monotonic() + self.free_timeout_s
        while time.monotonic() < deadline:
            if self._free() == expected:
                return True
            time.sleep(0.05)
        return False


class Conformance(Probe):
    """The checks, in order; ``run`` gives one row each."""

    CLAUSES: tuple[tuple[str, str], ...] = (
        ("describe", "Describe: spaces, capacity"),
        ("open", "open: n instances, reset observations, instances held"),
        ("seeded_reset", "open's seed: instance i reset with seed + i, reproducibly"),
        ("step", "step: one answer for all instances, shapes and dtypes"),
        ("episodes", "autoreset and episode reports"),
        ("bad_actions", "bad actions: INVALID_ARGUMENT, that session only"),
        ("unknown_session", "a step of another session: INVALID_ARGUMENT"),
        ("open_first", "a stream that does not open first: INVALID_ARGUMENT"),
        ("capacity", "more instances than free: RESOURCE_EXHAUSTED"),
        ("close", "closing a session frees its instances"),
    )

    def run(self) -> list[Row]:
        rows = []
        for name, clause in self.CLAUSES:
            check: Callable[[], str] = getattr(self, f"check_{name}")
            try:
                rows.append(Row(name, clause, True, check()))
            except Violation as error:
                rows.append(Row(name, clause, False, str(error)))
            except grpc.RpcError as error:
                rows.append(Row(name, clause, False, f"unexpected {error.code().name}: {error.details()}"))
            except Exception as error:  # a reply that does not decode, a space we cannot read
                rows.append(Row(name, clause, False, f"{type(error).__name__}: {error}"))
        return rows

    def check_describe(self) -> str:
        info = self.client.describe()
        self.info = info
        expect(info.num_instances >= 1, f"num_instances {info.num_instances}")
        expect(
            0 <= info.free_instances <= info.num_instances,
            f"free_instances {info.free_instances} of {info.num_instances}",
        )
        expect(
            isinstance(info.observation_space, gym.spaces.Box), f"observation space {info.observation_space}"
        )
        expect(
            isinstance(info.action_space, gym.spaces.Box | gym.spaces.Discrete),
            f"action space {info.action_space}",
        )
        return (
            f"{info.env_id}: {info.observation_space} -> {info.action_space}, "
            f"{info.free_instances}/{info.num_instances} free"
        )

    def check_open(self) -> str:
        n, before = self._n(), self._free()
        session = self.client.open(n, self.seed)
        try:
            obs = session.observations
            expect(session.num_instances == n, f"asked {n} instances, opened {session.num_instances}")
            shape = (n, *self._info.observation_space.shape)
            expect(
                obs.shape == shape and obs.dtype == np.float32,
                f"reset observations {obs.dtype} {obs.shape}, not float32 {shape}",
            )
            expect(bool(np.isfinite(obs).all()), "a NaN or infinity in the reset observations")
            expect(
                self._free() == before - n, f"free_instances {self._free()} while {n} of {before} are held"
            )
        finally:
            session.close()
        return f"{n} instances, observations {obs.shape}"

    def check_seeded_reset(self) -> str:
        n = self._n()
        first = self._opened(n, self.seed)
        again = self._opened(n, self.seed)
        expect(np.array_equal(first, again), "the same seed gave other reset observations")
        shifted = self._opened(1, self.seed + n - 1)
        expect(
            np.array_equal(first[n - 1], shifted[0]),
            f"instance {n - 1} of seed s is not instance 0 of s + {n - 1}",
        )
        return f"seed {self.seed} twice, and seed + i"

    def _opened(self, n: int, seed: int) -> np.ndarray:
        before = self._free()
        session = self.client.open(n, seed)
        session.close()
        self._wait_free(before)
        return session.observations

    def check_step(self) -> str:
        n = self._n()
        session = self.client.open(n, self.seed)
        try:
            step = session.step(self._actions(n))
            shape = (n, *self._info.observation_space.shape)
            expect(
                step.observations.shape == shape and step.observations.dtype == np.float32,
                f"observations {step.observations.dtype} {step.observations.shape}, not float32 {shape}",
            )
            for name in ("rewards", "terminated", "truncated"):
                array, dtype = getattr(step, name), np.float32 if name == "rewards" else np.bool_
                expect(
                    array.shape == (n,) and array.dtype == dtype,
                    f"{name} {array.dtype} {array.shape}, not {np.dtype(dtype)} ({n},)",
                )
            k = len(step.final_indices)
            expect(
                step.final_observations.shape == (k, *shape[1:]),
                f"final_observations {step.final_observations.shape} for {k} final_indices",
            )
        finally:
            session.close()
        return f"{n} instances in one message"

    def check_episodes(self) -> str:
        n = self._n()
        session = self.client.open(n, self.seed)
        returns, lengths, ended = np.zeros(n), np.zeros(n, dtype=np.int64), 0
        try:
            for _ in range(self.max_steps):
                step = session.step(self._actions(n))
                returns += step.rewards
                lengths += 1
                done = np.flatnonzero(step.terminated | step.truncated)
                expect(
                    np.array_equal(np.sort(step.final_indices), done),
                    f"final_indices {step.final_indices.tolist()} for ended instances {done.tolist()}",
                )
                reports = {int(e.instance): e for e in step.episodes}
                expect(
                    sorted(reports) == done.tolist(),
                    f"episode reports for {sorted(reports)}, ended {done.tolist()}",
                )
                for row, i in enumerate(step.final_indices):
                    report = reports[int(i)]
                    expect(
                        report.length == lengths[i],
                        f"instance {i}: reported length {report.length}, stepped {lengths[i]}",
                    )
                    expect(
                        bool(np.isclose(report.episode_return, returns[i], rtol=1e-4, atol=1e-4)),
                        f"instance {i}: reported return {report.episode_return:.4f}, "
                        f"rewards sum to {returns[i]:.4f}",
                    )
                    expect(
                        report.terminated == bool(step.terminated[i]),
                        f"instance {i}: report says terminated={report.terminated}, "
                        f"the step {bool(step.terminated[i])}",
                    )
                    expect(
                        not np.array_equal(step.final_observations[row], step.observations[i]),
                        f"instance {i}: the observation after its end is its final one: "
                        "no reset in the same step",
                    )
                    returns[i], lengths[i] = 0.0, 0
                ended += len(done)
                if ended >= 2 or (ended and n == 1):
                    return f"{ended} episodes ended within the step, reported and reset"
        finally:
            session.close()
        raise Violation(f"no episode ended in {self.max_steps} steps of random actions: cannot check")

    def check_bad_actions(self) -> str:
        bystander = self.client.open(1, self.seed) if self._free() >= 2 else None
        try:
            space, shown = self._info.action_space, []
            bad = {"a batch of the wrong size": np.zeros((2, *space.shape), self._info.action_dtype)}
            if isinstance(space, gym.spaces.Box):
                bad["a NaN"] = np.full((1, *space.shape), np.nan, np.float32)
            else:
                bad["an action outside the space"] = np.array([space.start + space.n], np.int64)
            for what, actions in bad.items():
                session = self.client.open(1, self.seed)
                try:
                    shown.append(
                        self._expect_status(
                            lambda s=session, a=actions: s.step(a), grpc.StatusCode.INVALID_ARGUMENT, what
                        )
                    )
                finally:
                    session.close()
                if bystander is not None:
                    bystander.step(self._actions(1))  # still served
        finally:
            if bystander is not None:
                bystander.close()
        return "; ".join(shown) + (
            "" if bystander else " (no second instance: the bystander was not checked)"
        )

    def check_unknown_session(self) -> str:
        stream = GrpcSessionStream(self._stub)
        try:
            stream.send(pb.SessionRequest(open=pb.OpenSession(num_instances=1, seed=self.seed)))
            opened = stream.receive().opened
            request = pb.StepRequest(
                session_id=opened.session_id + "-not", actions=tensors.encode(self._actions(1))
            )
            stream.send(pb.SessionRequest(step=request))
            return self._expect_status(
                stream.receive, grpc.StatusCode.INVALID_ARGUMENT, "a step of another session"
            )
        finally:
            stream.close()

    def check_open_first(self) -> str:
        stream = GrpcSessionStream(self._stub)
        try:
            stream.send(
                pb.SessionRequest(
                    step=pb.StepRequest(session_id="x", actions=tensors.encode(self._actions(1)))
                )
            )
            return self._expect_status(stream.receive, grpc.StatusCode.INVALID_ARGUMENT, "a step before open")
        finally:
            stream.close()

    def check_capacity(self) -> str:
        free = self._free()
        return self._expect_status(
            lambda: self.client.open(free + 1, self.seed).close(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{free + 1} instances of {free} free",
        )

    def check_close(self) -> str:
        before = self._free()
        sessions: list[EnvSession] = [self.client.open(before, self.seed)]
        expect(self._free() == 0, f"{self._free()} free while all {before} are held")
        sessions[0].close()
        expect(
            self._wait_free(before),
            f"{self._free()} of {before} free {self.free_timeout_s:g} s after the close",
        )
        return f"{before} instances back"
