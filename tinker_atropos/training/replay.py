"""The replay buffer of an off-policy learner (SAC), held by the trainer: trajectory chunks in, uniformly sampled
transitions out.

A chunk's steps become transitions ``(obs, action, reward, next_obs, terminated)``. The next observation of a
step is the following step's observation, the chunk's bootstrap observation after its last step, and, where the
time limit cut the episode, the final observation the chunk carries (``truncated_observations``): the
environment has already reset that instance, so its following observation is the next episode's first, and
bootstrapping from it would teach the critic a value that does not follow. A terminated step is not bootstrapped.

Memory: ``capacity x (4 (2 obs_dim + action_dim + 1) + 1)`` bytes, allocated at once (float32 observations and
actions; ``nbytes``): 2.9 GB for a million Humanoid-v5 transitions (348 + 348 + 17 + 1 floats), 3.3 MB for 100,000 of Pendulum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinker_atropos.protocol.trajectory import Trajectory


@dataclass(frozen=True)
class Transitions:
    """A sampled batch, as tensors on the learner's device."""

    observations: torch.Tensor  # [B, *obs_shape]
    actions: torch.Tensor  # [B, *action_shape], as the env received them
    rewards: torch.Tensor  # [B]
    next_observations: torch.Tensor  # [B, *obs_shape]
    terminated: torch.Tensor  # [B] float, 1 where the episode ended for good (no bootstrap)


def next_observations(trajectory: Trajectory) -> np.ndarray:
    """[T, N, *obs_shape]: the observation each step led to, the final one where the time limit cut the episode."""
    following = np.concatenate([trajectory.observations[1:], trajectory.bootstrap_observations[None]])
    following[trajectory.truncated] = trajectory.truncated_observations  # both in time-major order
    return following


COLUMNS = ("observations", "next_observations", "actions", "rewards", "terminated")


class ReplayBuffer:
    """A ring of the latest ``capacity`` transitions."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], action_shape: tuple[int, ...]) -> None:
        self.capacity = capacity
        self.observations = np.zeros((capacity, *obs_shape), np.float32)
        self.next_observations = np.zeros((capacity, *obs_shape), np.float32)
        self.actions = np.zeros((capacity, *action_shape), np.float32)
        self.rewards = np.zeros(capacity, np.float32)
        self.terminated = np.zeros(capacity, bool)
        self.size = 0  # transitions held
        self.position = 0  # where the next one is written
        self.added = 0  # transitions ever written: the journal numbers the next one from here

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in COLUMNS)

    def __len__(self) -> int:
        return self.size

    def add(self, trajectory: Trajectory) -> int:
        """Append a chunk's transitions (the oldest are overwritten once full); how many were added."""
        steps = trajectory.num_steps

        def flat(array: np.ndarray) -> np.ndarray:
            return array.reshape(steps, *array.shape[2:])

        columns = {
            "observations": flat(trajectory.observations),
            "next_observations": flat(next_observations(trajectory)),
            "actions": flat(trajectory.actions),
            "rewards": flat(trajectory.rewards),
            "terminated": flat(trajectory.terminated),
        }
        if steps > self.capacity:  # only the latest fit
            columns = {name: rows[-self.capacity :] for name, rows in columns.items()}
        count = min(steps, self.capacity)
        where = (self.position + np.arange(count)) % self.capacity
        for name, rows in columns.items():
            getattr(self, name)[where] = rows
        self.position = (self.position + count) % self.capacity
        self.size = min(self.size + count, self.capacity)
        self.added += count
        return steps

    def sample(self, batch_size: int, generator: np.random.Generator, device: torch.device) -> Transitions:
        if self.size == 0:
            raise ValueError("sampling an empty replay buffer")
        index = generator.integers(0, self.size, batch_size)

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(array[index], device=device)

        return Transitions(
            tensor(self.observations),
            tensor(self.actions),
            tensor(self.rewards),
            tensor(self.next_observations),
            tensor(self.terminated).float(),
        )

    def since(self, start: int) -> dict[str, np.ndarray]:
        """Copies of the held transitions numbered ``start`` and after (see ``added``), oldest first."""
        count = max(self.added - max(start, self.added - self.size), 0)
        order = (self.position - count + np.arange(count)) % self.capacity
        return {name: getattr(self, name)[order] for name in COLUMNS}

    def refill(self, columns: dict[str, np.ndarray], added: int) -> None:
        """Hold ``columns`` (oldest first; the latest ``capacity`` of them) as the latest of ``added`` transitions
        ever written: a resumed buffer numbers what it takes in next as the checkpointed one would have."""
        count = min(len(columns["rewards"]), self.capacity)
        for name in COLUMNS:
            getattr(self, name)[:count] = columns[name][len(columns[name]) - count :]
        self.size, self.position, self.added = count, count % self.capacity, added
