"""A signature proves origin, not freshness: a signed experience record copied back into the stream is refused as
replayed, after a trainer restart too, and an older signed weights record written back over the current one is
refused by the rollouts. Unit tests of the window each writer's numbers are checked
against, of a trainer's memory across a restart, then the whole system as a holder of the Redis password (not
of the token) attacks it. A Redis that stalls while chunks are appended is no attacker: the appends the client
resends are appended once, and only a copy from outside is counted as replayed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from tests.support.envs import pendulum_env
from tests.support.loops import started_loop
from tests.support.processes import Processes, stop_process, wait_for
from tests.support.records import serialized_chunk
from tests.support.running import REPO, Sidecar, cli, config_file, report_rows, run_up_with
from tinker_atropos.config import parse_config
from tinker_atropos.protocol.freshness import MAX_WRITERS, WINDOW, Freshness
from tinker_atropos.protocol.trajectory import RecordError
from tinker_atropos.state import keys
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.experience import read_stats
from tinker_atropos.state.registry import Registration, live_services
from tinker_atropos.state.weights import published_version
from tinker_atropos.trainer.experience_loop import ExperienceLoop


def refused(freshness: Freshness, writer: str, sequence: int, version: int = 0) -> str:
    with pytest.raises(RecordError) as error:
        freshness.take(writer, sequence, version)
    return error.value.reason


def test_each_number_of_a_writer_is_taken_once_in_any_order_within_its_window() -> None:
    freshness = Freshness()
    for sequence in (1, 3, 2, 5, 4):  # a rollout's sessions append concurrently: neighbours arrive swapped
        freshness.take("a", sequence, 0)
    assert [refused(freshness, "a", s) for s in (1, 5, 3)] == ["replayed"] * 3
    freshness.take("b", 1, 0)  # another incarnation numbers its own records
    freshness.take("a", 5 + WINDOW, 0)
    freshness.take("a", 6, 0)  # the oldest number the window still tells apart
    assert refused(freshness, "a", 6) == "replayed"
    assert refused(freshness, "a", 5) == "out_of_order"  # below the window: cannot tell, refused
    assert refused(Freshness(freshness.state_dict()), "a", 6) == "replayed"  # as a checkpoint restores it


def test_a_forgotten_writer_raises_a_floor_that_its_records_stay_under() -> None:
    freshness = Freshness()
    freshness.take("old", 1, 7)
    for writer in range(MAX_WRITERS):  # rollouts started since: "old" is the least recent, forgotten
        freshness.take(f"new-{writer}", 1, 8)
    assert len(freshness.state_dict()["writers"]) == MAX_WRITERS
    assert refused(freshness, "old", 1, 7) == "out_of_order"  # would be taken again if unknown alone
    freshness.take("newest", 1, 8)  # a rollout started now acts with recent weights
    freshness.restarted_at(9)
    assert refused(freshness, "newest", 2, 8) == "before_restart"
    freshness.take("newest", 2, 9)


def test_a_restarted_trainer_refuses_what_it_learned_before_and_what_its_newer_weights_hold(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    config = parse_config({"run": {"name": "replay"}, "trainer": {"tensorboard": False}})
    first, checkpointer = started_loop(config, redis_client, tmp_path)
    taken = serialized_chunk(2, 0, 0)
    assert first.batcher.accept(taken) is not None
    assert first.batcher.accept(taken) is None and first.batcher.rejected.totals == {"replayed": 1}
    checkpointer.save(force=True)

    second, _ = started_loop(config, redis_client, tmp_path)  # resumed from that checkpoint
    assert second.batcher.accept(taken) is None and second.batcher.rejected.totals == {"replayed": 1}
    second.learner.core.version = 1  # it learned on, past its checkpoint,
    learned_past_the_checkpoint = serialized_chunk(2, 1, 1)
    assert second.batcher.accept(learned_past_the_checkpoint) is not None
    # from this chunk too, published version 2, and was killed before its next checkpoint
    second.learner.core.version = 2
    second.publish()

    third, _ = started_loop(config, redis_client, tmp_path)
    assert third.version == 2  # continues from the newer weights, which learned from that chunk
    assert third.batcher.accept(learned_past_the_checkpoint) is None
    assert third.batcher.rejected.totals == {"before_restart": 1}
    assert third.batcher.accept(serialized_chunk(2, 2, 2)) is not None


def test_a_trainer_behind_the_rollouts_continues_above_the_version_they_hold(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """Redis lost its data while the trainer restarted from a checkpoint older than the weights a rollout still
    acts with: the rollout refuses every lower version, so the trainer must publish above it."""
    config = parse_config({"run": {"name": "behind"}})
    loop = ExperienceLoop(config, redis_client, tmp_path)
    loop.setup(pendulum_env())
    assert loop.version == 0
    careless = serialized_chunk(2, 0, version=2**62)  # a holder of the token writes any version
    assert loop.batcher.accept(careless) is None
    loop._last_sync = 0.0
    loop.sync_redis()
    assert loop.version == 0  # no rollout holds it: not followed

    Registration(
        redis_client,
        "behind",
        "rollout",
        "127.0.0.1:1",
        "r",
        lambda: {"policy_version": 9},
        interval_s=1.0,
        ttl_s=30.0,
    ).beat()
    assert loop.batcher.accept(serialized_chunk(2, 1, 9)) is None  # acted by the weights Redis lost
    assert loop.batcher.rejected.totals == {"impossible_version": 2}
    loop._last_sync = 0.0
    loop.sync_redis()
    assert loop.version == 10 and published_version(redis_client, "behind") == 10


class Attacker(Sidecar):
    """Holds the Redis password, not the token. Copies one signed chunk back into the stream ``copies`` times once
    the trainer has taken it, and writes an older signed weights record back over the current one until the
    rollout has refused one; watches the version the rollout acts with meanwhile. Once the services report both
    refused, it scrapes their Prometheus metrics, SIGKILLs the trainer and, when its successor serves, copies the
    chunk ``copies`` times again; done when that one has refused them too."""

    def __init__(self, client: redis.Redis, run: str, run_dir: Path, copies: int) -> None:
        super().__init__(interval_s=0.05)
        self.client, self.run_name, self.run_dir, self.copies = client, run, run_dir, copies
        self.stream, self.weights = keys.experience(run), keys.weights(run)
        self.captured, self.captured_id = None, None  # the chunk's fields, and its stream id
        self.copied, self.old_weights, self.rollbacks, self.ticks = 0, None, 0, 0
        self.acting: list[int] = []  # the rollout's version, as often as it is read
        self.scraped: dict[str, str] = {}
        self.killed: str | None = None  # the incarnation of the trainer killed
        self.refused_after_restart: dict[str, int] = {}

    def work(self) -> None:
        self.ticks += 1
        services = {s.kind: s for s in live_services(self.client, self.run_name)}
        if "rollout" in services:
            self.acting.append(int(services["rollout"].figures["policy_version"]))
        if "rollout" not in services or "trainer" not in services or self.done.is_set():
            return
        rollout, trainer = services["rollout"].figures, services["trainer"]
        if self.killed is None:
            self.before_the_restart(rollout, trainer.figures, services)
        elif trainer.incarnation != self.killed:
            self.replay_a_chunk(limit=2 * self.copies)
            rejected = trainer.figures.get("records_rejected", {})
            self.refused_after_restart = {
                k: rejected[k] for k in ("replayed", "before_restart") if k in rejected
            }
            if sum(self.refused_after_restart.values()) >= self.copies:
                self.done.set()

    def before_the_restart(self, rollout: dict, trainer: dict, services: dict) -> None:
        self.replay_a_chunk(limit=self.copies)
        if self.copied < self.copies:
            return
        if rollout.get("weights_refused", {}).get("rolled_back", 0) < 1:
            self.roll_back_weights(int(rollout["policy_version"]))
        elif trainer.get("records_rejected", {}).get("replayed", 0) >= self.copies:
            for kind in ("rollout", "trainer"):
                with urllib.request.urlopen(
                    f"http://{services[kind].figures['metrics_address']}/metrics"
                ) as page:
                    self.scraped[kind] = page.read().decode()
            found = subprocess.run(
                ["pgrep", "-f", f"tinker_atropos trainer --config {self.run_dir}"],
                capture_output=True,
                text=True,
            )
            self.killed = services["trainer"].incarnation
            os.kill(int(found.stdout.split()[0]), signal.SIGKILL)

    def replay_a_chunk(self, limit: int) -> None:
        if self.captured is None:
            entries = self.client.xrange(self.stream, count=1)
            if entries:
                self.captured_id, self.captured = entries[0]
        elif self.client.xrange(self.stream, self.captured_id, self.captured_id):
            return  # not taken yet
        elif self.copied < limit:
            self.client.xadd(self.stream, self.captured)
            self.copied += 1

    def roll_back_weights(self, acting: int) -> None:
        """Capture the trainer's record, then write it back, every 5th tick, once the rollout acts with a newer
        one (the trainer publishes over it within a second: the rollout may not read every one)."""
        if self.old_weights is None:
            self.old_weights = self.client.hgetall(self.weights) or None
        elif acting > int(self.old_weights[b"version"]) + 2 and self.ticks % 5 == 0 and self.rollbacks < 100:
            with self.client.pipeline() as back:  # one transaction: no field of the current record stays
                back.delete(self.weights).hset(self.weights, mapping=self.old_weights).execute()
            self.rollbacks += 1


@pytest.mark.integration
def test_a_replayed_chunk_and_rolled_back_weights_are_refused_and_counted(
    tmp_path: Path, valkey, redis_client: redis.Redis
) -> None:
    """SAC learns from chunks of any age: before, 40 copies of one chunk were learned 40 times, and the
    rollout went back from version 66 to 57. Set with --set and --seed over the shipped config."""
    run_dir, run = tmp_path / "run", "replayed"
    options = (
        "--redis-url",
        valkey.url,
        "--metrics",
        "--set",
        f"run.name={run}",
        "--seed",
        "5",
        "--set",
        "trainer.sac.learning_starts=100000",
    )  # a replay buffer, no gradient steps
    attacker = Attacker(redis_client, run, run_dir, copies=40)
    run_up_with(
        attacker, REPO / "configs" / "pendulum-sac.yaml", run_dir, *options, timeout=300, until_done=True
    )
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (resolved["run"]["name"], resolved["run"]["seed"]) == (run, 5)

    counters = report_rows(run_dir)[-1]["counters"]
    # 40 copies before the restart, 40 after (refused with chunks that were queued when the trainer was killed,
    # which its successor cannot tell from those it learned from after its checkpoint)
    assert attacker.copied == 80 and sum(attacker.refused_after_restart.values()) >= 40
    refused = counters.get("records_rejected_replayed", 0) + counters.get(
        "records_rejected_before_restart", 0
    )
    assert refused >= 80, counters
    learned = sum(n for name, n in counters.items() if name.startswith("chunks_lag_"))
    assert learned <= counters["chunks_written"], counters
    assert attacker.rollbacks >= 1 and counters.get("weights_refused_rolled_back", 0) >= 1, counters
    assert attacker.acting == sorted(attacker.acting), attacker.acting  # never back to older weights
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    loaded = [int(v) for v in re.findall(r"loaded policy version (\d+)", rollout_log)]
    assert loaded == sorted(loaded) and len(loaded) > 3, loaded
    assert "(WeightsRecordError: a weights record of version" in rollout_log
    assert re.search(
        r'records_rejected_total\{[^}]*reason="replayed"[^}]*\} 40\.0', attacker.scraped["trainer"]
    )
    assert re.search(
        r'weights_refused_total\{[^}]*reason="rolled_back"[^}]*\} [1-9]', attacker.scraped["rollout"]
    )
    shown = cli("status", "--redis-url", valkey.url, "--run", run).stdout
    assert "records_rejected_replayed=" in shown and "weights_refused_rolled_back=" in shown, shown


STALL_S = 7.0  # past redis-py's socket timeout (5 s): the commands in flight are resent on a new connection
STALLS = 4


@pytest.mark.integration
def test_appends_resent_over_a_stalled_valkey_are_no_replay_and_a_copy_from_outside_is(
    tmp_path: Path, processes: Processes
) -> None:
    """Before: a 20 s stall of Valkey with no attacker left records_rejected_replayed at 1, the append the
    rollout's client resent after Valkey had taken it."""
    run = "stalled"
    server = EmbeddedValkey(tmp_path / "valkey")
    client = redis.Redis.from_url(server.url)
    stream = keys.experience(run)
    # 'drop': the rollout appends flat out, so its appends are in flight when Valkey stops; the stream's bound is
    # out of reach, so a copy of an append is read by the trainer, not trimmed unread
    config = config_file(
        tmp_path,
        "cartpole.yaml",
        run={"name": run},
        trainer={"tensorboard": False},
        rollout={"flow_control": "drop", "chunk_length": 16, "max_queued_chunks": 100_000},
    )
    common = ["--config", str(config), "--redis-url", server.url, "--port", "0"]

    def trainer() -> dict:
        return next((s.figures for s in live_services(client, run, "trainer")), {})

    def consumed_all_written_by_now() -> None:
        written = read_stats(client, run)["chunks_written"]
        wait_for(lambda: trainer().get("chunks_consumed", 0) >= written, 60, f"the trainer to take {written}")

    def stall() -> None:
        try:
            stop_process(server.process.pid)
            time.sleep(STALL_S)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        written = read_stats(client, run).get("chunks_written", 0)
        wait_for(lambda: read_stats(client, run).get("chunks_written", 0) > written, 30, "the run going on")
        time.sleep(1.0)  # the resent appends land
        consumed_all_written_by_now()

    try:
        processes.start("env", *common, name="env")
        processes.start("rollout", *common, name="rollout")
        processes.start("trainer", *common, "--run-dir", str(tmp_path / "run"), name="trainer")
        wait_for(lambda: trainer().get("updates", 0) >= 2, 120, "two updates")
        # the rollout resends only an append in flight when Valkey stops; it may be on another command (its weights
        # check) then, so the stall is repeated until one append was resent, with no replay after any of them
        for _ in range(STALLS):
            stall()
            stats = read_stats(client, run)
            assert "replayed" not in trainer().get("records_rejected", {}), (trainer(), stats)
            if stats.get("chunks_duplicate_retried", 0) >= 1:
                break
        assert stats.get("chunks_duplicate_retried", 0) >= 1, stats  # a stall did make the client resend

        # a signed chunk, copied once the trainer took it
        entry_id, fields = client.xrange(stream, count=1)[0]
        wait_for(lambda: not client.xrange(stream, entry_id, entry_id), 30, "the trainer to take the chunk")
        client.xadd(stream, fields)
        consumed_all_written_by_now()
        wait_for(lambda: trainer().get("records_rejected", {}).get("replayed") == 1, 10, "the copy refused")
        assert "Traceback" not in "".join(processes.log(kind) for kind in ("env", "rollout", "trainer"))
    finally:
        processes.stop_all()
        client.close()
        server.stop()
