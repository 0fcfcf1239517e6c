"""The env services behind a ``RemoteVectorEnv`` (``vector_env.py``): a client and a session on each, all serving
one kind of env, opened with consecutive seeds and stepped together (actions sent to every service before any
answer is read), over the local fast path or gRPC like the rollout. What fails on the way is an
``EnvServiceLost``: ``reset()`` opens new sessions, finding the run's env services in the registry again."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from tinker_atropos.config import Transport
from tinker_atropos.environment.client import EnvClient, EnvDescription, EnvSession
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.state.connection import connect_fast
from tinker_atropos.state.registry import live_services

REOPEN_WAIT_S = 5.0


class EnvServiceLost(RuntimeError):
    """An env service stopped answering or ended the session; ``reset()`` opens new sessions."""


class ServiceSessions:
    """A session on each env service at ``addresses`` (or of run ``run``'s, found in Redis at ``redis_url``),
    ``instances`` from each (0: all free ones); instance i of them all is the vector env's instance i."""

    def __init__(
        self,
        addresses: Sequence[str],
        run: str | None,
        redis_url: str,
        instances: int,
        transport: Transport,
        answer_timeout_s: float,
    ) -> None:
        self.addresses, self.run, self.redis_url = list(addresses), run, redis_url
        self.instances, self.transport = instances, transport
        self.answer_timeout_s = answer_timeout_s  # a stopped env service on this host: an error, not a hang
        self.stop = threading.Event()  # ends a local session's waits on close
        self.clients: list[EnvClient] = []
        self.sessions: list[EnvSession] = []
        self.held: dict[str, int] = {}  # instances each env service gave: asked for again on reset
        self.bounds = np.zeros(0, dtype=np.int64)  # the first instance of each session but the first

    def connect(self) -> EnvDescription:
        """A client per env service, all serving the same spaces; their common description."""
        addresses = self.addresses
        if self.run is not None:
            addresses = sorted(
                r.address for r in live_services(connect_fast(self.redis_url), self.run, "env")
            )
            if not addresses:
                raise EnvServiceLost(f"run {self.run!r} has no live env service in {self.redis_url}")
        self.clients = [EnvClient(a, self.transport, self.stop, self.answer_timeout_s) for a in addresses]
        try:
            described = [client.describe() for client in self.clients]
        except grpc.RpcError as error:
            self.close_clients()
            raise EnvServiceLost(f"cannot describe the env services {addresses}: {_reason(error)}") from None
        first = described[0]

        def kind(env: EnvDescription) -> tuple[str, str, str]:
            return env.env_id, str(env.observation_space), str(env.action_space)

        for address, other in zip(addresses[1:], described[1:], strict=True):
            if kind(other) != kind(first):
                self.close_clients()
                raise ValueError(
                    f"env service {address} serves {other.env_id} {other.observation_space} -> "
                    f"{other.action_space}, {addresses[0]} {first.env_id} {first.observation_space} "
                    f"-> {first.action_space}: one vector env steps one kind of env"
                )
        return first

    def open(self, seed: int) -> np.ndarray:
        """A session on each env service, instance i of them all reset with ``seed + i``; the reset
        observations of them all.

        Reopened (``reset``), a service is asked for as many instances as it gave the first time, waiting up to
        ``REOPEN_WAIT_S`` for it to free those of the session just closed: it notices the close a moment later."""
        offset = 0
        for client in self.clients:
            held = self.held.get(client.address)
            deadline = time.monotonic() + (REOPEN_WAIT_S if held else 0.0)
            while True:
                try:
                    session = client.open(held or self.instances, seed + offset)
                    break
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        self.close_sessions()
                        raise EnvServiceLost(
                            f"cannot open a session on {client.address}: {_reason(error)}"
                        ) from None
                    time.sleep(0.02)
            self.held[client.address] = session.num_instances
            self.sessions.append(session)
            offset += session.num_instances
        self.bounds = np.cumsum([session.num_instances for session in self.sessions])[:-1]
        return np.concatenate([session.observations for session in self.sessions])

    def reopen(self, seed: int) -> np.ndarray:
        """New sessions (``open``), after a new look in the registry for a run's env services, which may have
        moved."""
        self.close_sessions()
        if self.run is not None or not self.clients:
            self.close_clients()
            self.connect()
        return self.open(seed)

    def step(self, actions: np.ndarray) -> list[StepBatch]:
        """Each open session's step of its part of ``actions``, all sent before any answer is read. ValueError
        for actions a service refused, EnvServiceLost for a service lost; either closes the sessions."""
        try:
            for session, part in zip(self.sessions, np.split(actions, self.bounds), strict=True):
                session.send_step(part)
            return [session.receive_step() for session in self.sessions]
        except grpc.RpcError as error:
            self.close_sessions()
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the env service refused the actions: {error.details()}") from None
            raise EnvServiceLost(
                f"an env service was lost ({_reason(error)}); reset() opens new sessions"
            ) from None

    def close(self) -> None:
        """Free the instances: every session ends, every channel closes."""
        self.stop.set()
        self.close_sessions()
        self.close_clients()

    def close_sessions(self) -> None:
        for session in self.sessions:
            session.close()
        self.sessions = []

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []


def _reason(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {error.details()}"
