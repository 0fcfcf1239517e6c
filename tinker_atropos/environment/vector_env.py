"""``RemoteVectorEnv``: running env services as one Gymnasium ``VectorEnv``, for code that was not written for
tinker-atropos (a CleanRL loop, Gymnasium's vector wrappers, Stable-Baselines3 through ``environment.sb3``).

It holds one session per env service and steps them all at once (actions sent to every service before any answer
is read), over the local fast path or gRPC like the rollout. The env services reset an ended episode within the
same step, so the autoreset mode is ``SAME_STEP``: ``infos["final_obs"]`` holds the last observation of each ended
episode, and ``infos["episode"]`` its return and length as the env service counted them (the statistics
``gymnasium.wrappers.vector.RecordEpisodeStatistics`` would add; ``stats_key=None`` leaves them out so that
wrapper can be used instead).

A lost env service raises ``EnvServiceLost`` within seconds (gRPC keepalive; the local path sees the socket
close, and gives a stopped service ``answer_timeout_s``); ``reset()`` reconnects, finding the run's env services
in the registry again when built from a run name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from tinker_atropos.config import Transport
from tinker_atropos.environment.client import EnvClient, EnvDescription, EnvSession
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.state.connection import connect_fast
from tinker_atropos.state.registry import live_services

REOPEN_WAIT_S = 5.0


class EnvServiceLost(RuntimeError):
    """An env service stopped answering or ended the session; ``reset()`` opens new sessions."""


class RemoteVectorEnv(gym.vector.VectorEnv):
    """Every instance of the env services at ``addresses`` (or of run ``run``'s, found in Redis at
    ``redis_url``), ``instances_per_service`` from each (0: all free ones), as one vector env."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        run: str | None = None,
        redis_url: str = "redis://127.0.0.1:6379/0",
        instances_per_service: int = 0,
        transport: Transport = "auto",
        stats_key: str | None = "episode",
        seed: int | None = None,
        answer_timeout_s: float = 30.0,
    ) -> None:
        if bool(addresses) == (run is not None):
            raise ValueError("give either the env services' addresses or the run whose registry lists them")
        self._addresses, self._run, self._redis_url = list(addresses), run, redis_url
        self._instances, self._transport, self.stats_key = instances_per_service, transport, stats_key
        self._answer_timeout_s = answer_timeout_s  # a stopped env service on this host: an error, not a hang
        self._stop = threading.Event()  # ends a local session's waits on close
        self._clients: list[EnvClient] = []
        self._sessions: list[EnvSession] = []
        self._held: dict[str, int] = {}  # instances each env service gave: asked for again on reset
        self._seeds = np.random.default_rng(seed)  # the seeds of resets without one
        self.description = self._connect()
        self._open(self._next_seed(seed))
        self.num_envs = sum(session.num_instances for session in self._sessions)
        layout = self.description.observation_layout
        self.single_observation_space = layout if layout is not None else self.description.observation_space
        self.single_action_space = self.description.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._opened_with = self.num_envs

    # -- sessions ------------------------------------------------------------------------------------
    def _connect(self) -> EnvDescription:
        """A client per env service, all serving the same spaces; their common description."""
        addresses = self._addresses
        if self._run is not None:
            addresses = sorted(
                r.address for r in live_services(connect_fast(self._redis_url), self._run, "env")
            )
            if not addresses:
                raise EnvServiceLost(f"run {self._run!r} has no live env service in {self._redis_url}")
        self._clients = [EnvClient(a, self._transport, self._stop, self._answer_timeout_s) for a in addresses]
        try:
            described = [client.describe() for client in self._clients]
        except grpc.RpcError as error:
            self._close_clients()
            raise EnvServiceLost(f"cannot describe the env services {addresses}: {_reason(error)}") from None
        first = described[0]

        def kind(env: EnvDescription) -> tuple[str, str, str]:
            return env.env_id, str(env.observation_space), str(env.action_space)

        for address, other in zip(addresses[1:], described[1:], strict=True):
            if kind(other) != kind(first):
                self._close_clients()
                raise ValueError(
                    f"env service {address} serves {other.env_id} {other.observation_space} -> "
                    f"{other.action_space}, {addresses[0]} {first.env_id} {first.observation_space} "
                    f"-> {first.action_space}: one vector env steps one kind of env"
                )
        return first

    def _open(self, seed: int) -> None:
        """A session on each env service; instance i of the whole vector env is reset with ``seed + i``.

        Reopened (``reset``), a service is asked for as many instances as it gave the first time, waiting up to
        ``REOPEN_WAIT_S`` for it to free those of the session just closed: it notices the close a moment later."""
        offset = 0
        for client in self._clients:
            held = self._held.get(client.address)
            deadline = time.monotonic() + (REOPEN_WAIT_S if held else 0.0)
            while True:
                try:
                    session = client.open(held or self._instances, seed + offset)
                    break
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        self._close_sessions()
                        raise EnvServiceLost(
                            f"cannot open a session on {client.address}: {_reason(error)}"
                        ) from None
                    time.sleep(0.02)
            self._held[client.address] = session.num_instances
            self._sessions.append(session)
            offset += session.num_instances
        self._bounds = np.cumsum([session.num_instances for session in self._sessions])[:-1]
        self._observations = np.concatenate([session.observations for session in self._sessions])
        self._episode_start = np.full(offset, time.perf_counter())

    def _next_seed(self, seed: int | None) -> int:
        if seed is not None:
            self._seeds = np.random.default_rng(seed)
            return seed
        return int(self._seeds.integers(2**31 - 1 - 2**16))

    # -- the Gymnasium API ---------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """New sessions, instance i reset with ``seed + i`` (a seed drawn from the last one given, if none)."""
        super().reset(seed=seed)
        self._close_sessions()
        if self._run is not None or not self._clients:  # the run's env services may have moved
            self._close_clients()
            self._connect()
        self._open(self._next_seed(seed))
        if len(self._observations) != self._opened_with:
            opened = len(self._observations)
            self._close_sessions()
            raise EnvServiceLost(
                f"the env services now offer {opened} instances, not the {self._opened_with} "
                "this vector env was made with"
            )
        return self._observation(self._observations), {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if not self._sessions:
            raise EnvServiceLost("the sessions are closed: call reset() to open new ones")
        actions = np.asarray(actions, dtype=self.description.action_dtype)
        if actions.shape != self.action_space.shape:
            raise ValueError(f"actions must have shape {self.action_space.shape}, got {actions.shape}")
        try:
            for session, part in zip(self._sessions, np.split(actions, self._bounds), strict=True):
                session.send_step(part)
            batches = [session.receive_step() for session in self._sessions]
        except grpc.RpcError as error:
            self._close_sessions()
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the env service refused the actions: {error.details()}") from None
            raise EnvServiceLost(
                f"an env service was lost ({_reason(error)}); reset() opens new sessions"
            ) from None
        return self._merge(batches)

    def close_extras(self, **kwargs: Any) -> None:
        """Free the instances: every session ends, every channel closes."""
        self._stop.set()
        self._close_sessions()
        self._close_clients()

    # -- helpers -------------------------------------------------------------------------------------
    def _merge(
        self, batches: list[StepBatch]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """One step of every session as one step of the vector env, with Gymnasium's SAME_STEP infos."""
        observations = np.concatenate([b.observations for b in batches])
        rewards = np.concatenate([b.rewards for b in batches]).astype(np.float64)
        terminated = np.concatenate([b.terminated for b in batches])
        truncated = np.concatenate([b.truncated for b in batches])
        infos: dict[str, Any] = {}
        offsets = [0, *self._bounds]
        ended = np.concatenate([b.final_indices + offset for b, offset in zip(batches, offsets, strict=True)])
        if ended.size:
            mask = np.zeros(self.num_envs, dtype=bool)
            mask[ended] = True
            final_obs = np.full(self.num_envs, None, dtype=object)
            for i, row in zip(ended, np.concatenate([b.final_observations for b in batches]), strict=True):
                final_obs[i] = self._observation(row)
            infos.update(final_obs=final_obs, _final_obs=mask, final_info={}, _final_info=mask.copy())
            if self.stats_key is not None:
                infos.update(self._episode_stats(batches, offsets))
            self._episode_start[ended] = time.perf_counter()
        self._observations = observations
        return self._observation(observations), rewards, terminated, truncated, infos

    def _episode_stats(self, batches: list[StepBatch], offsets: list[int]) -> dict[str, Any]:
        """The layout RecordEpisodeStatistics gives: {"r", "l", "t"} arrays, zero where no episode ended."""
        stats = {
            "r": np.zeros(self.num_envs),
            "l": np.zeros(self.num_envs, dtype=np.int64),
            "t": np.zeros(self.num_envs),
        }
        mask = np.zeros(self.num_envs, dtype=bool)
        now = time.perf_counter()
        for batch, offset in zip(batches, offsets, strict=True):
            for episode in batch.episodes:
                i = offset + episode.instance
                stats["r"][i], stats["l"][i] = episode.episode_return, episode.length
                stats["t"][i], mask[i] = round(now - self._episode_start[i], 6), True
        return {self.stats_key: stats, f"_{self.stats_key}": mask}

    def _observation(self, flat: np.ndarray) -> Any:
        """Observations as the env observes them: a Dict env's entries back from the flat rows they travel in."""
        layout = self.description.observation_layout
        if layout is None:
            return flat
        entries, start = {}, 0
        for key, space in layout.spaces.items():
            size = int(np.prod(space.shape))
            entry = flat[..., start : start + size].reshape(*flat.shape[:-1], *space.shape)
            entries[key] = entry.astype(space.dtype, copy=False)
            start += size
        return entries

    def _close_sessions(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions = []

    def _close_clients(self) -> None:
        for client in self._clients:
            client.close()
        self._clients = []


def _reason(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {error.details()}"
