"""tinker_atropos.experience_source: a researcher's loop gets whole trajectories of the published policy's spaces off the
run's stream; what is not one is skipped and counted, never handed over."""

from __future__ import annotations

import pytest
import redis

from tests.support.records import serialized_chunk
from tinker_atropos.experience_source import ExperienceSource
from tinker_atropos.state import keys
from tinker_atropos.state.weights import publish_weights

RUN = "client"
SPEC = {"model": "mlp", "obs_shape": [3], "action": {"kind": "box", "shape": [1]}}


def _append(client: redis.Redis, record: bytes, field: bytes = b"record") -> None:
    client.xadd(keys.experience(RUN), {field: record})


def test_a_batch_holds_whole_trajectories_of_recent_policies_and_counts_what_it_skipped(
    redis_client: redis.Redis,
) -> None:
    publish_weights(redis_client, RUN, 3, b"blob", SPEC)
    source = ExperienceSource(redis_client, RUN)
    assert source.policy_version() == 3
    _append(redis_client, serialized_chunk(4, seed=1, version=1))  # older than asked: dropped
    _append(redis_client, b"\x00garbage")  # not a record
    _append(redis_client, serialized_chunk(4, seed=2, version=2, obs_dim=5))  # another env's observations
    _append(redis_client, b"x", field=b"chunk")  # the layout before schema 1
    for seed in (3, 4, 5):
        _append(redis_client, serialized_chunk(4, seed=seed, version=3))

    batch = source.batch(steps=50, min_policy_version=2, timeout_s=5)

    # 8 steps x 4 instances per trajectory: two hold 64 >= 50 steps; the third stays in the stream
    assert [t.policy_version for t in batch] == [3, 3]
    assert all(t.observations.shape == (8, 4, 3) and t.actions.shape == (8, 4, 1) for t in batch)
    assert source.stale == 1
    assert sum(source.skipped.values()) == 3 and {"undecodable", "schema_version"} <= source.skipped.keys()
    assert redis_client.xlen(keys.experience(RUN)) == 1


def test_without_a_published_policy_or_enough_experience_it_says_why(redis_client: redis.Redis) -> None:
    source = ExperienceSource(redis_client, RUN)
    with pytest.raises(RuntimeError, match="no published policy"):
        source.batch(steps=1)
    publish_weights(redis_client, RUN, 1, b"blob", SPEC)
    with pytest.raises(TimeoutError, match="are the env and rollout services running"):
        source.batch(steps=1, timeout_s=0.6)
