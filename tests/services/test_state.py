"""Redis state on a real Valkey server: registry TTLs, the bounded experience stream, weights, checkpoints."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import torch

from tests.support.envs import pendulum_env
from tests.support.processes import wait_for
from tinker_atropos.config import parse_config
from tinker_atropos.models.mlp import ActorCritic, mlp_spec
from tinker_atropos.models.weight_bytes import weights_to_bytes
from tinker_atropos.rollout.policy import PolicySource
from tinker_atropos.state import keys
from tinker_atropos.state.checkpoint_files import load_latest_checkpoint, save_checkpoint
from tinker_atropos.state.experience import ExperienceReader, ExperienceWriter, read_stats, recent_episodes
from tinker_atropos.state.registry import Registration, live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, published_version


def test_registry_entry_expires_without_heartbeats_and_is_removed_on_close(redis_client) -> None:
    reg = Registration(redis_client, "r", "env", "127.0.0.1:1", "abc", lambda: {"steps": 3}, 0.1, 0.5).start()
    [record] = live_services(redis_client, "r", "env")
    assert (record.address, record.incarnation, record.figures) == ("127.0.0.1:1", "abc", {"steps": 3})
    time.sleep(1.0)  # heartbeats keep it alive past its TTL
    assert live_services(redis_client, "r", "env")
    reg.close()
    assert live_services(redis_client, "r") == []

    silent = Registration(redis_client, "r", "rollout", "h:2", "def", dict, 10.0, 0.3)
    silent.beat()  # registered once, never refreshed
    assert [s.kind for s in live_services(redis_client, "r")] == ["rollout"]
    wait_for(lambda: not live_services(redis_client, "r"), 3.0, "the silent entry to expire")


def test_runs_are_namespaced(redis_client) -> None:
    Registration(redis_client, "a", "env", "h:1", "x", dict, 1, 5).beat()
    assert live_services(redis_client, "b") == []


def test_experience_stream_is_bounded_and_counts_what_it_drops(redis_client) -> None:
    writer = ExperienceWriter(redis_client, "r", max_queued_chunks=3)
    for i in range(5):
        writer.append(f"chunk{i}".encode(), env_steps=10, episodes=[{"return": float(i), "length": 1}])
    assert writer.queued() == 3
    stats = read_stats(redis_client, "r")
    assert stats == {"chunks_written": 5, "env_steps": 50, "chunks_dropped_backpressure": 2, "episodes": 5}
    assert [e["return"] for e in recent_episodes(redis_client, "r", 2)] == [4.0, 3.0]

    reader = ExperienceReader(redis_client, "r")
    assert reader.take(count=2, block_ms=10) == [b"chunk2", b"chunk3"]  # oldest surviving first
    assert reader.take(count=5, block_ms=10) == [b"chunk4"]
    assert reader.take(count=5, block_ms=10) == []
    writer.append(b"again", env_steps=1)
    assert read_stats(redis_client, "r")["chunks_dropped_backpressure"] == 2  # consumed chunks free the bound


def test_weights_are_versioned_and_read_whole(redis_client) -> None:
    assert published_version(redis_client, "r") is None and fetch_weights(redis_client, "r") is None
    publish_weights(redis_client, "r", 3, b"\x00blob", {"obs_shape": [3]})
    publish_weights(redis_client, "r", 4, b"\x01blob", {"obs_shape": [3]})
    weights = fetch_weights(redis_client, "r")
    assert (weights.version, weights.blob, weights.spec) == (4, b"\x01blob", {"obs_shape": [3]})
    assert published_version(redis_client, "r") == 4


def test_a_lower_version_is_published_above_the_one_held_and_the_same_one_only_for_the_same_weights(
    redis_client,
) -> None:
    assert publish_weights(redis_client, "r", 5, b"a", {}) == 5
    # published again (Redis missed it): unchanged
    assert publish_weights(redis_client, "r", 5, b"a", {}) == 5
    assert publish_weights(redis_client, "r", 5, b"b", {}) == 6  # other weights never share a number
    assert publish_weights(redis_client, "r", 2, b"c", {}) == 7
    assert (fetch_weights(redis_client, "r").version, fetch_weights(redis_client, "r").blob) == (7, b"c")


def test_two_drivers_publishing_interleaved_raise_the_version_each_time_and_no_rollout_refuses_any(
    redis_client: redis.Redis,
) -> None:
    """The experience loop publishes its own numbers and goes on from what was published; a Tinker-driven policy
    asks for any version. Side by side, each publication is announced above the last and rollouts take them all."""
    env = pendulum_env()
    spec = mlp_spec(env.observation_space, env.action_space, parse_config({}).trainer.model, True, True)
    blobs = [weights_to_bytes(ActorCritic(spec)) for _ in range(4)]
    announced = redis_client.pubsub()
    announced.subscribe(keys.weights_channel("both"))
    assert announced.get_message(timeout=5)["type"] == "subscribe"
    policies = PolicySource(redis_client, "both", torch.device("cpu"))
    rounds = 40

    def experience_loop() -> list[int]:
        version, published = 0, []
        for i in range(rounds):
            version = publish_weights(redis_client, "both", version, blobs[i % 2], spec)
            published.append(version)
            policies.refresh()
            version += 1
        return published

    def tinker_policy() -> list[int]:
        return [publish_weights(redis_client, "both", 1, blobs[2 + i % 2], spec) for i in range(rounds)]

    with ThreadPoolExecutor(2) as pool:
        loop, tinker = pool.submit(experience_loop), pool.submit(tinker_policy)
        loop_versions, tinker_versions = loop.result(60), tinker.result(60)
    order = []
    while (message := announced.get_message(timeout=1)) is not None:
        order.append(int(message["data"]))
    announced.close()
    assert order == sorted(set(order)) and len(order) == 2 * rounds, order
    assert sorted(loop_versions + tinker_versions) == order
    assert policies.refresh().version == order[-1] and policies.rejected == 0, policies.refused


def test_checkpoints_are_atomic_retained_and_corrupt_ones_skipped(tmp_path: Path, caplog) -> None:
    for version in (1, 2, 3, 4):
        save_checkpoint(tmp_path, version, {"version": version, "t": torch.arange(version)}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-0000000002.pt",
        "checkpoint-0000000003.pt",
        "checkpoint-0000000004.pt",
    ]
    path, state = load_latest_checkpoint(tmp_path)
    assert state["version"] == 4 and torch.equal(state["t"], torch.arange(4))

    newest = tmp_path / "checkpoint-0000000004.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash or a full disk
    path, state = load_latest_checkpoint(tmp_path)
    assert state["version"] == 3
    assert "unreadable" in caplog.text
    assert load_latest_checkpoint(tmp_path / "empty") is None


@pytest.mark.parametrize("kind", ["env", "trainer"])
def test_live_services_filters_by_kind(redis_client, kind: str) -> None:
    Registration(redis_client, "r", "env", "h:1", "a", dict, 1, 5).beat()
    Registration(redis_client, "r", "trainer", "h:2", "b", dict, 1, 5).beat()
    assert [s.kind for s in live_services(redis_client, "r", kind)] == [kind]
