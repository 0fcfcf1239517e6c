"""One step of a ``RemoteVectorEnv`` (``vector_env.py``) out of its sessions' step batches, as Gymnasium's vector
envs answer in the ``SAME_STEP`` autoreset mode (the env services reset an ended episode within the step):
``infos["final_obs"]`` holds the last observation of each ended episode, and ``infos[stats_key]`` its return and
length as the env service counted them, laid out as ``gymnasium.wrappers.vector.RecordEpisodeStatistics`` adds
them. Observations come back in the env's own layout: a Dict env's entries from the flat rows they travel in."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

from tinker_atropos.protocol.steps import StepBatch


class SameStep:
    """The vector env's steps, and when each instance's episode started (the statistics' time)."""

    def __init__(self, num_envs: int, layout: gym.spaces.Dict | None) -> None:
        self.num_envs, self.layout = num_envs, layout
        self.episode_start = np.full(num_envs, time.perf_counter())

    def restart(self) -> None:
        """Every instance was just reset: its episode starts now."""
        self.episode_start = np.full(self.num_envs, time.perf_counter())

    def merge(
        self, batches: list[StepBatch], bounds: np.ndarray, stats_key: str | None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """One step of every session (the first instance of each at ``[0, *bounds]``) as one step of the vector
        env, with Gymnasium's SAME_STEP infos; episode statistics under ``stats_key``, unless None."""
        observations = np.concatenate([b.observations for b in batches])
        rewards = np.concatenate([b.rewards for b in batches]).astype(np.float64)
        terminated = np.concatenate([b.terminated for b in batches])
        truncated = np.concatenate([b.truncated for b in batches])
        infos: dict[str, Any] = {}
        offsets = [0, *bounds]
        ended = np.concatenate([b.final_indices + offset for b, offset in zip(batches, offsets, strict=True)])
        if ended.size:
            mask = np.zeros(self.num_envs, dtype=bool)
            mask[ended] = True
            final_obs = np.full(self.num_envs, None, dtype=object)
            for i, row in zip(ended, np.concatenate([b.final_observations for b in batches]), strict=True):
                final_obs[i] = self.observation(row)
            infos.update(final_obs=final_obs, _final_obs=mask, final_info={}, _final_info=mask.copy())
            if stats_key is not None:
                infos.update(self._episode_stats(batches, offsets, stats_key))
            self.episode_start[ended] = time.perf_counter()
        return self.observation(observations), rewards, terminated, truncated, infos

    def _episode_stats(self, batches: list[StepBatch], offsets: list[int], stats_key: str) -> dict[str, Any]:
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
                stats["t"][i], mask[i] = round(now - self.episode_start[i], 6), True
        return {stats_key: stats, f"_{stats_key}": mask}

    def observation(self, flat: np.ndarray) -> Any:
        """Observations as the env observes them: a Dict env's entries back from the flat rows they travel in."""
        if self.layout is None:
            return flat
        entries, start = {}, 0
        for key, space in self.layout.spaces.items():
            size = int(np.prod(space.shape))
            entry = flat[..., start : start + size].reshape(*flat.shape[:-1], *space.shape)
            entries[key] = entry.astype(space.dtype, copy=False)
            start += size
        return entries
