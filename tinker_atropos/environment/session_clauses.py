"""The conformance kit's clauses of a session as served (``conformance.py``): Describe's spaces and capacity,
opening a session and its seeded reset, one step's shapes and types for every instance, and the autoreset rule
with its episode reports."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from tinker_atropos.environment.probe import Probe, Violation, expect


class SessionClauses:
    """What a well-formed session must get back; each check says what it saw, or raises a Violation."""

    CLAUSES: tuple[tuple[str, str], ...] = (
        ("describe", "Describe: spaces, capacity"),
        ("open", "open: n instances, reset observations, instances held"),
        ("seeded_reset", "open's seed: instance i reset with seed + i, reproducibly"),
        ("step", "step: one answer for all instances, shapes and dtypes"),
        ("episodes", "autoreset and episode reports"),
    )

    def __init__(self, probe: Probe) -> None:
        self.probe, self.client = probe, probe.client

    def check_describe(self) -> str:
        info = self.client.describe()
        self.probe.described = info
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
        n, before = self.probe.instances(), self.probe.free()
        session = self.client.open(n, self.probe.seed)
        try:
            obs = session.observations
            expect(session.num_instances == n, f"asked {n} instances, opened {session.num_instances}")
            shape = (n, *self.probe.info.observation_space.shape)
            expect(
                obs.shape == shape and obs.dtype == np.float32,
                f"reset observations {obs.dtype} {obs.shape}, not float32 {shape}",
            )
            expect(bool(np.isfinite(obs).all()), "a NaN or infinity in the reset observations")
            expect(
                self.probe.free() == before - n,
                f"free_instances {self.probe.free()} while {n} of {before} are held",
            )
        finally:
            session.close()
        return f"{n} instances, observations {obs.shape}"

    def check_seeded_reset(self) -> str:
        n = self.probe.instances()
        first = self._opened(n, self.probe.seed)
        again = self._opened(n, self.probe.seed)
        expect(np.array_equal(first, again), "the same seed gave other reset observations")
        shifted = self._opened(1, self.probe.seed + n - 1)
        expect(
            np.array_equal(first[n - 1], shifted[0]),
            f"instance {n - 1} of seed s is not instance 0 of s + {n - 1}",
        )
        return f"seed {self.probe.seed} twice, and seed + i"

    def _opened(self, n: int, seed: int) -> np.ndarray:
        before = self.probe.free()
        session = self.client.open(n, seed)
        session.close()
        self.probe.wait_free(before)
        return session.observations

    def check_step(self) -> str:
        n = self.probe.instances()
        session = self.client.open(n, self.probe.seed)
        try:
            step = session.step(self.probe.actions(n))
            shape = (n, *self.probe.info.observation_space.shape)
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
        n = self.probe.instances()
        session = self.client.open(n, self.probe.seed)
        returns, lengths, ended = np.zeros(n), np.zeros(n, dtype=np.int64), 0
        try:
            for _ in range(self.probe.max_steps):
                step = session.step(self.probe.actions(n))
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
        raise Violation(f"no episode ended in {self.probe.max_steps} steps of random actions: cannot check")
