"""The conformance kit's hold on the server under test (``conformance.py``): one connection (the client and a raw
stub, for what the client would never send), and what every clause's check asks of it."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import numpy as np

from tinker_atropos.environment.client import CHANNEL_OPTIONS, EnvClient, EnvDescription
from tinker_atropos.protocol.v1 import environment_pb2_grpc
from tinker_atropos.security import open_channel


class Violation(AssertionError):
    """A clause of the contract the server broke; the message says how."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Violation(message)


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
        self.stub = environment_pb2_grpc.EnvironmentStub(self._channel)
        self.described: EnvDescription | None = None  # the latest Describe's answer
        self._rng = np.random.default_rng(seed)

    def close(self) -> None:
        self.client.close()
        self._channel.close()

    @property
    def info(self) -> EnvDescription:
        """The server's description, asked once (the Describe check asks again)."""
        if self.described is None:
            self.described = self.client.describe()
        return self.described

    def free(self) -> int:
        return self.client.describe().free_instances

    def actions(self, n: int) -> np.ndarray:
        """``n`` random actions of the action space, drawn from the probe's seed."""
        space = self.info.action_space
        space.seed(int(self._rng.integers(2**31)))
        return np.stack([space.sample() for _ in range(n)]).astype(self.info.action_dtype)

    def instances(self) -> int:
        """How many instances a check opens: 2, or 1 where only one is free; a Violation where none is."""
        free = self.free()
        expect(free >= 1, "no free instance to check with: stop what holds them")
        return min(2, free)

    def expect_status(self, call: Callable[[], object], code: grpc.StatusCode, what: str) -> str:
        """``call`` failed with ``code`` (what it said), or a Violation."""
        try:
            call()
        except grpc.RpcError as error:
            expect(error.code() == code, f"{what}: {error.code().name} ({error.details()}), not {code.name}")
            return f"{code.name}: {error.details()}"
        raise Violation(f"{what}: accepted, not {code.name}")

    def wait_free(self, expected: int) -> bool:
        """Whether ``expected`` instances are free within ``free_timeout_s`` (a close frees them soon after)."""
        deadline = time.monotonic() + self.free_timeout_s
        while time.monotonic() < deadline:
            if self.free() == expected:
                return True
            time.sleep(0.05)
        return False
