"""Rollouts share the env services, as real processes: a second rollout takes half of the session slots
from the first, both act for half of the env steps, and when one is SIGKILLed the other takes its share over;
no env service is ever asked for instances another rollout still steps. One that is SIGSTOPped loses its share
within the lease TTL too: its env service gives its idle session's instances to the rollout that took its leases
and once it resumes it rejoins."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import redis
import yaml

from tests.support.loops import initial_policy
from tests.support.processes import Processes, stop_process, wait_for
from tests.support.running import REPO
from tinker_atropos.config import parse_config
from tinker_atropos.state.embedded import EmbeddedValkey
from tinker_atropos.state.registry import ServiceRecord, live_services
from tinker_atropos.state.weights import publish_weights

pytestmark = pytest.mark.integration
RUN = "sharing"
ENV_SERVICES, INSTANCES = 4, 16
BALANCE_WINDOW_S = 8.0


class Watcher(threading.Thread):
    """Reads every env service's figures from the registry every 0.1 s: the most sessions one ever had open."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.client, self.stop, self.most_sessions = client, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            for env in live_services(self.client, RUN, "env"):
                self.most_sessions = max(self.most_sessions, env.figures.get("sessions", 0))


def rollouts(client: redis.Redis) -> dict[str, ServiceRecord]:
    return {r.name: r for r in live_services(client, RUN, "rollout")}


def holding(client: redis.Redis, instances: dict[str, int]) -> bool:
    """Each named rollout is registered, holding that many instances."""
    live = rollouts(client)
    return all(
        name in live and live[name].figures.get("instances_held") == n for name, n in instances.items()
    )


def start_env_services(
    tmp_path: Path, processes: Processes, valkey: EmbeddedValkey, services: int, rollout: dict
) -> tuple[redis.Redis, list[str]]:
    """``services`` CartPole env services of INSTANCES each, and weights to act with (no trainer: acting is all
    there is); the command-line arguments a rollout of this run starts with."""
    data = yaml.safe_load((REPO / "configs" / "cartpole.yaml").read_text())
    data["run"]["name"] = RUN
    data["env"]["instances"] = INSTANCES
    data["rollout"] |= {"flow_control": "drop", "chunk_length": 32, "max_queued_chunks": 8, **rollout}
    data["redis"] = {"heartbeat_interval_s": 0.5}
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    client = redis.Redis.from_url(valkey.url)
    client.flushall()
    publish_weights(client, RUN, 0, *initial_policy(parse_config(data)))
    common = ["--config", str(config_path), "--redis-url", valkey.url, "--port", "0"]
    for i in range(services):
        processes.start("env", *common, "--name", f"env-{i}", name=f"env-{i}")
    return client, common


def test_rollouts_split_the_env_services_and_take_over_a_killed_ones_share(
    tmp_path: Path, processes: Processes, valkey: EmbeddedValkey
) -> None:
    client, common = start_env_services(tmp_path, processes, valkey, ENV_SERVICES, {})
    watcher = Watcher(client)
    watcher.start()
    try:
        processes.start("rollout", *common, "--name", "rollout-0", name="rollout-0")
        wait_for(
            lambda: holding(client, {"rollout-0": ENV_SERVICES * INSTANCES}), 60, "rollout-0 on every env"
        )

        joined_at = time.monotonic()
        second = processes.start("rollout", *common, "--name", "rollout-1", name="rollout-1")
        half = ENV_SERVICES * INSTANCES // 2
        wait_for(
            lambda: holding(client, {"rollout-0": half, "rollout-1": half}), 60, "the slots split in two"
        )
        join_s = time.monotonic() - joined_at
        # rollout-0 counts a hand-over once it deleted the lease, which rollout-1 then takes: its next heartbeat
        # (0.5 s) may come after rollout-1's, so the count is waited for, not read at once
        wait_for(
            lambda: rollouts(client)["rollout-0"].figures["units_handed_over"] == 2, 5, "2 slots handed over"
        )
        live = rollouts(client)
        assert {
            **live["rollout-0"].figures["instances_by_env"],
            **live["rollout-1"].figures["instances_by_env"],
        } == {f"env-{i}": INSTANCES for i in range(ENV_SERVICES)}, "each env service acted by one rollout"

        start = {name: r.figures["env_steps"] for name, r in rollouts(client).items()}
        time.sleep(BALANCE_WINDOW_S)
        done = {name: r.figures["env_steps"] - start[name] for name, r in rollouts(client).items()}
        shares = {name: steps / sum(done.values()) for name, steps in done.items()}
        # the slots split exactly (above); the steps they make follow the cores two processes get on a loaded
        # 2-core machine: neither rollout does more than twice the other's work
        assert all(1 / 3 <= share <= 2 / 3 for share in shares.values()), shares

        steps_before = rollouts(client)["rollout-0"].figures["env_steps"]
        killed_at = time.monotonic()
        second.send_signal(signal.SIGKILL)
        wait_for(
            lambda: holding(client, {"rollout-0": 2 * half}), 30, "rollout-0 to take the killed one's share"
        )
        takeover_s = time.monotonic() - killed_at
        assert rollouts(client)["rollout-0"].figures["env_steps"] > steps_before, "it kept stepping meanwhile"
    finally:
        watcher.stop.set()
        watcher.join()

    envs = live_services(client, RUN, "env")
    assert [e.figures["sessions_refused_busy"] for e in envs] == [0] * ENV_SERVICES, (
        "a rollout asked for instances another one held: the leases let two rollouts onto one slot"
    )
    assert watcher.most_sessions == 1, "an env service had two sessions open at once"
    print(
        f"\njoin: slots split after {join_s:.1f}s; shares {shares}; SIGKILL: share taken over after {takeover_s:.1f}s"
    )


def test_a_stopped_rollouts_instances_go_to_the_one_that_took_its_leases_and_it_rejoins_when_resumed(
    tmp_path: Path, processes: Processes, valkey: EmbeddedValkey
) -> None:
    ttl_s = 1.0
    client, common = start_env_services(tmp_path, processes, valkey, 2, {"lease_ttl_s": ttl_s})
    processes.start("rollout", *common, "--name", "rollout-0", name="rollout-0")
    wait_for(lambda: holding(client, {"rollout-0": 2 * INSTANCES}), 60, "rollout-0 on both env services")
    stopped = processes.start("rollout", *common, "--name", "rollout-1", name="rollout-1")
    wait_for(lambda: holding(client, {"rollout-0": INSTANCES, "rollout-1": INSTANCES}), 60, "one env each")
    its_env = next(iter(rollouts(client)["rollout-1"].figures["instances_by_env"]))

    stop_process(stopped.pid)
    stopped_at = time.monotonic()
    try:
        # its lease lapses within the TTL; its env service then waits on it for one TTL more before taking its
        # session over; the figures come with the next heartbeat (0.5 s)
        wait_for(
            lambda: holding(client, {"rollout-0": 2 * INSTANCES}), 2 * ttl_s + 3, "rollout-0 on both again"
        )
        taken_over_s = time.monotonic() - stopped_at
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    envs = wait_for(
        lambda: {
            e.name: e.figures for e in live_services(client, RUN, "env") if e.figures["sessions_taken_over"]
        },
        5,
        "the take-over in the figures",
    )
    assert list(envs) == [its_env] and envs[its_env]["sessions_taken_over"] == 1, envs
    assert "taken over from" in processes.log(its_env)

    # resumed: it finds its stream ended and its lease taken, rejoins and gets its share back by hand-over
    wait_for(
        lambda: rollouts(client)["rollout-1"].figures["leases_lost"] == 1, 10, "it to see its lease taken"
    )
    wait_for(lambda: holding(client, {"rollout-0": INSTANCES, "rollout-1": INSTANCES}), 30, "the share back")
    assert stopped.poll() is None
    steps = rollouts(client)["rollout-1"].figures["env_steps"]
    wait_for(lambda: rollouts(client)["rollout-1"].figures["env_steps"] > steps, 10, "rollout-1 to act again")
    assert "Traceback" not in processes.log("rollout-1") + processes.log(its_env)
    print(f"\nSIGSTOP: the stopped rollout's instances acted on by the other after {taken_over_s:.1f}s")
