"""How a rollout session turns env answers into chunk rows: time-limit bootstraps and their zeros elsewhere."""

from __future__ import annotations

import numpy as np

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.steps import StepBatch
from tinker_atropos.protocol.v1 import environment_pb2
from tinker_atropos.rollout.collector import truncation_values
from tinker_atropos.rollout.trajectory_builder import TrajectoryBuilder

N, OBS = 4, 3


class SumPolicy:
    """A critic whose value is the sum of the observation: easy to check by hand."""

    has_critic = True

    def value(self, obs: np.ndarray) -> np.ndarray:
        return obs.sum(axis=1).astype(np.float32)


def step_result(terminated: list[bool], truncated: list[bool], final_indices: list[int]) -> StepBatch:
    """A step as the env service answers it, decoded as the rollout's client decodes it."""
    finals = np.arange(len(final_indices) * OBS, dtype=np.float32).reshape(-1, OBS) + 1.0
    return StepBatch.decode(
        environment_pb2.StepResult(
            observations=tensors.encode(np.zeros((N, OBS), np.float32)),
            rewards=tensors.encode(np.ones(N, np.float32)),
            terminated=tensors.encode(np.array(terminated)),
            truncated=tensors.encode(np.array(truncated)),
            final_observations=tensors.encode(finals),
            final_indices=tensors.encode(np.array(final_indices, np.int32)),
        )
    )


def test_no_bootstrap_is_computed_when_no_episode_ended_or_none_was_cut_by_the_time_limit() -> None:
    running = step_result([False] * N, [False] * N, [])
    terminated_only = step_result([False, True, False, False], [False] * N, [1])

    assert truncation_values(running, SumPolicy(), N) is None
    assert truncation_values(terminated_only, SumPolicy(), N) is None


def test_a_truncated_episode_is_bootstrapped_from_its_final_observation_and_a_terminated_one_is_not() -> None:
    # instance 1 terminated (final obs 1,2,3), instance 3 hit the time limit (final obs 4,5,6)
    result = step_result([False, True, False, False], [False, False, False, True], [1, 3])

    values = truncation_values(result, SumPolicy(), N)

    np.testing.assert_array_equal(values, [0.0, 0.0, 0.0, 15.0])


def test_a_row_without_bootstrap_values_records_zeros_even_after_a_chunk_that_had_some() -> None:
    builder = TrajectoryBuilder(2, N, (OBS,), (1,), np.float32)
    zeros = np.zeros(N, np.float32)
    result = step_result([False] * N, [False] * N, [])
    obs, actions = np.zeros((N, OBS), np.float32), np.zeros((N, 1), np.float32)
    for _ in range(2):
        builder.add(obs, actions, zeros, zeros, result, np.full(N, 7.0, np.float32))
    builder.finish(obs, zeros, 0, "rollout", 1, "env", "session")

    builder.add(obs, actions, zeros, zeros, result, None)

    np.testing.assert_array_equal(builder.truncation_values[0], zeros)
    np.testing.assert_array_equal(builder.rewards[0], np.ones(N))
