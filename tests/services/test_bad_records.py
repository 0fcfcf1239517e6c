"""Every record read from the experience stream is checked: bad ones are skipped and counted by reason, and
the run goes on learning. Unit tests of each reason, then the whole system under a stream of bad records and
forged weights: written by a careless holder of the run's token (counted by what is wrong with them) and by a
process that reaches Redis without the token (refused for their signature)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.support.records import serialized_chunk
from tests.support.running import Sidecar, assert_learned, cli, config_file, report_rows, run_up_with
from tinker_atropos.protocol.trajectory import (
    RecordError,
    Trajectory,
    TrajectorySpec,
    decode_trajectory,
    encode_trajectory,
)
from tinker_atropos.protocol.v1 import experience_pb2
from tinker_atropos.security import derive_key, signature
from tinker_atropos.state import keys
from tinker_atropos.state.experience import ExperienceWriter, add_stats, queued_chunks, read_stats
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

PENDULUM = TrajectorySpec(obs_shape=(3,), action_shape=(1,), discrete=None)


def wrong_schema() -> bytes:
    chunk = experience_pb2.ExperienceRecord.FromString(serialized_chunk(2, 0)).trajectory_chunk
    return experience_pb2.ExperienceRecord(schema_version=7, trajectory_chunk=chunk).SerializeToString()


def without_actions() -> bytes:
    record = experience_pb2.ExperienceRecord.FromString(serialized_chunk(2, 0))
    record.trajectory_chunk.ClearField("actions")
    return record.SerializeToString()


# What a careless or hostile writer puts in the stream: (entry fields, the reason it is counted under).
BAD_ENTRIES = {
    "garbage bytes": ({"record": b"\xff\xfe not protobuf \x00\x01"}, "undecodable"),
    "another schema": ({"record": wrong_schema()}, "schema_version"),
    "the layout before envelopes": ({"chunk": serialized_chunk(2, 0)}, "schema_version"),
    "an entry without its field": ({"payload": b"x"}, "missing_field"),
    "a chunk without actions": ({"record": without_actions()}, "missing_field"),
    "observations of another env": ({"record": serialized_chunk(2, 0, obs_dim=5)}, "spec_mismatch"),
    "a version from the future": ({"record": serialized_chunk(2, 0, version=2**62)}, "impossible_version"),
    "a NaN observation": ({"record": serialized_chunk(2, 0, observation_fill=float("nan"))}, "non_finite"),
}


@pytest.mark.parametrize(
    ("record", "reason", "message"),
    [
        (b"\xff\xfe", "undecodable", "not an ExperienceRecord"),
        (wrong_schema(), "schema_version", "schema version 7; this trainer reads 3"),
        (without_actions(), "missing_field", "a chunk without actions"),
        (serialized_chunk(2, 0, obs_dim=5), "spec_mismatch", "observations of shape (8, 2, 5)"),
        (
            serialized_chunk(2, 0, observation_fill=float("inf")),
            "non_finite",
            "NaN or infinity in observations",
        ),
    ],
    ids=["undecodable", "schema", "missing", "shape", "infinity"],
)
def test_decode_trajectory_names_the_reason(record: bytes, reason: str, message: str) -> None:
    with pytest.raises(RecordError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        decode_trajectory(record, PENDULUM)
    assert error.value.reason == reason


def test_a_sound_record_decodes_to_its_arrays() -> None:
    chunk = decode_trajectory(serialized_chunk(2, 0, version=3), PENDULUM)
    assert chunk.policy_version == 3 and chunk.observations.shape == (8, 2, 3) and chunk.num_steps == 16
    assert np.isfinite(chunk.rewards).all()


def test_discrete_actions_outside_the_space_are_a_spec_mismatch() -> None:
    zeros = np.zeros((2, 1), np.float32)
    record = encode_trajectory(
        Trajectory(
            policy_version=0,
            observations=np.zeros((2, 1, 4), np.float32),
            actions=np.array([[1], [2]]),
            rollout_incarnation="r",
            sequence=1,
            log_probs=zeros,
            rewards=zeros,
            terminated=zeros.astype(bool),
            truncated=zeros.astype(bool),
            bootstrap_observations=np.zeros((1, 4), np.float32),
            truncated_observations=np.zeros((0, 4), np.float32),
        )
    )  # CartPole acts 0 or 1
    with pytest.raises(RecordError, match=r"Discrete actions outside \[0, 1\]: 1..2") as error:
        decode_trajectory(record, TrajectorySpec(obs_shape=(4,), action_shape=(), discrete=(0, 1)))
    assert error.value.reason == "spec_mismatch"


def test_a_trajectory_without_a_critic_travels_without_values_and_half_of_them_is_refused() -> None:
    chunk = decode_trajectory(serialized_chunk(2, 0), PENDULUM)
    bare = encode_trajectory(replace(chunk, values=None, truncation_values=None, bootstrap_values=None))
    assert not decode_trajectory(bare, PENDULUM).has_values
    half = encode_trajectory(replace(chunk, truncation_values=None))
    with pytest.raises(RecordError, match="a chunk without truncation_values") as error:
        decode_trajectory(half, PENDULUM)
    assert error.value.reason == "missing_field"


def test_a_counter_overwritten_with_garbage_is_repaired_not_a_wedge(redis_client: redis.Redis) -> None:
    """HINCRBY on a field that is not an integer fails; every chunk's append would fail with it."""
    redis_client.hset(keys.stats("garbled"), mapping={"env_steps": "lots", "chunks_rejected_stale": "x"})
    writer = ExperienceWriter(redis_client, "garbled", max_queued_chunks=8)
    writer.append(serialized_chunk(2, 0), env_steps=16, episodes=[{"return": 1.0, "length": 3}])
    add_stats(redis_client, "garbled", chunks_rejected_stale=2)
    stats = read_stats(redis_client, "garbled")
    assert (stats["env_steps"], stats["chunks_rejected_stale"], stats["episodes"]) == (16, 2, 1)
    assert stats["counters_repaired"] == 2 and queued_chunks(redis_client, "garbled") == 1


class Injector(Sidecar):
    """Once a second (a round of 20 ticks): every kind of bad entry signed with the run's key, a sound chunk
    unsigned and one signed with another token (as a process without the token would write). Each round also
    forges weights of a version far ahead, unsigned on even rounds and signed but garbage on odd ones, forged
    again on every tick the trainer has published over them (SAC publishes many times a second, and a forgery
    counts only once a rollout has read it) once rollouts act: before, that would keep the trainer's first
    policy from ever reaching them."""

    FORGED = 10**6  # forged versions are its multiples
    TICKS = 20

    def __init__(self, client: redis.Redis, run: str, run_dir: Path) -> None:
        super().__init__(interval_s=1.0 / self.TICKS)
        self.client, self.run_name, self.stream = client, run, keys.experience(run)
        self.token_file, self.ticks, self.rounds = run_dir / "token", 0, 0
        self.forgeries, self.forged_version, self.weights_rejected = 0, 0, 0

    def work(self) -> None:
        if not self.token_file.exists():  # up writes it before it starts any service
            return
        rollouts = [r.figures for r in live_services(self.client, self.run_name, "rollout")]
        self.weights_rejected = max(
            [self.weights_rejected, *(int(r.get("weights_rejected", 0)) for r in rollouts)]
        )
        acting = any(int(r.get("env_steps", 0)) > 0 for r in rollouts)
        signed = (self.ticks // self.TICKS) % 2 == 1
        if self.ticks % self.TICKS == 0:
            self.inject_entries()
            self.forge_weights(signed)
            self.rounds += 1
        elif acting and published_version(self.client, self.run_name) != self.forged_version:
            self.forge_weights(signed)
        self.ticks += 1

    def inject_entries(self) -> None:
        key = derive_key(self.token_file.read_text().strip(), "experience")
        for fields, _ in BAD_ENTRIES.values():
            record = fields.get("record", b"")
            self.client.xadd(self.stream, {**fields, "sig": signature(key, record)} if record else fields)
        sound = serialized_chunk(2, 0)
        self.client.xadd(self.stream, {"record": sound})
        self.client.xadd(
            self.stream, {"record": sound, "sig": signature(derive_key("other", "experience"), sound)}
        )

    def forge_weights(self, signed: bool) -> None:
        blob, spec = b"not weights at all", json.dumps({"obs_shape": [3]})
        # ahead of a trainer that continued above one
        self.forged_version = self.FORGED * (self.forgeries + 1)
        version, digest = str(self.forged_version), hashlib.sha256(blob).hexdigest()
        fields = {"version": version, "blob": blob, "spec": spec, "digest": digest}
        if signed:
            key = derive_key(self.token_file.read_text().strip(), "weights")
            fields["sig"] = signature(key, version.encode(), spec.encode(), digest.encode())
        with self.client.pipeline() as forged:  # one transaction: no signature of the trainer's stays
            forged.delete(keys.weights(self.run_name)).hset(
                keys.weights(self.run_name), mapping=fields
            ).execute()
        self.forgeries += 1


@pytest.mark.integration
def test_bad_records_are_counted_by_reason_while_pendulum_learns(
    tmp_path: Path, valkey, redis_client: redis.Redis
) -> None:
    run_dir = tmp_path / "run"
    config = config_file(tmp_path, "pendulum-sac.yaml", run={"name": "poisoned-stream"})
    injector = Injector(redis_client, "poisoned-stream", run_dir)
    # learning shown past -700 (random play: about -1,200); what is asserted is that it goes on under the attack
    options = ("--redis-url", valkey.url, "--total-steps", "200000", "--target-return", "-700")
    output = run_up_with(injector, config, run_dir, *options)
    assert "exited with code" not in output and "restarts     none" in output, output[-3000:]  # no crash
    assert re.search(r"[█░]{20} +\d+% ETA (\d+m\d\ds|\?)", output), output[-3000:]  # towards --total-steps
    assert injector.rounds >= 10

    assert_learned(report_rows(run_dir), random_below=-900.0, target=-700.0, budget=200_000)
    counters = report_rows(run_dir)[-1]["counters"]
    for reason in {reason for _, reason in BAD_ENTRIES.values()} | {"unsigned", "bad_signature"}:
        assert counters.get(f"records_rejected_{reason}", 0) >= 5, (reason, counters)
    # forged weights refused, unsigned and signed but garbage alike, and counted; the trainer's own won
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert injector.weights_rejected >= 2
    problems = next(line for line in output.splitlines() if line.startswith("  problems     "))
    refused = {name: n for name, n in counters.items() if name.startswith("weights_refused_")}
    assert sum(refused.values()) >= 2, counters
    assert all(f"{name} {n:,}" in problems for name, n in refused.items()), problems
    for reason in {reason for _, reason in BAD_ENTRIES.values()} | {"unsigned", "bad_signature"}:
        assert f"records_rejected_{reason} {counters[f'records_rejected_{reason}']:,}" in problems, problems
    assert "(WeightsRecordError: a weights record without the run's signature)" in rollout_log
    assert "(ValueError: weights that do not " in rollout_log  # signed, then checked: load, or fit their spec
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "skipped" in trainer_log and "(spec_mismatch)" in trainer_log and "Traceback" not in trainer_log
    shown = cli("status", "--redis-url", valkey.url, "--run", "poisoned-stream")
    assert "records_rejected_undecodable=" in shown.stdout, shown.stdout
