"""A real multi-node run on one machine: a trainer node and 4 env nodes, each a network namespace with its own
address. Cutting one env node's link costs only its instances; restoring it brings the same incarnation back
without a restart. With a rollout node beside them, the two rollouts share the env nodes, and when one is killed
the other takes its share over. Needs root (CI runs as root); skipped, saying why, where namespaces cannot be
created."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.cluster import Cluster, start_cluster
from tests.support.netns import unavailable_reason
from tests.support.processes import wait_for
from tests.support.running import REPO
from tinker_atropos.config import load_config
from tinker_atropos.state.connection import connect
from tinker_atropos.state.registry import ServiceRecord, live_services

RUN = "multinode"
ENV_NODES = 4
INSTANCES = 4
# the servers' keepalive (a ping after 5 s, 5 s for its answer) frees a dead session in ~10 s; without it a
# session is freed only if gRPC's TCP user timeout (20 s) happens to apply, or never
RELEASE_WITHIN_S = 17.0


def run_cluster(tmp_path: Path, rollout_nodes: int = 0) -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"needs Linux network namespaces: {reason}")
    config = load_config(REPO / "configs/pendulum.yaml")
    config.run.name, config.env.instances = RUN, INSTANCES
    config_path = tmp_path / "config.yaml"
    config_path.write_text(config.to_yaml())
    cluster = start_cluster(config_path, tmp_path, ENV_NODES, INSTANCES, rollout_nodes)
    try:
        yield cluster
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.processes.values()), "a service outlived the test"
    assert cluster.network.leftovers() == [], "namespaces or links outlived the test"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from run_cluster(tmp_path)


@pytest.fixture
def two_rollout_cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from run_cluster(tmp_path, rollout_nodes=1)


def services(client: redis.Redis, kind: str) -> list[ServiceRecord]:
    return live_services(client, RUN, kind)


def rollout_figure(client: redis.Redis, name: str, at: str | None = None) -> int:
    """A figure of the only rollout (or the one at address ``at``); 0 while it is not registered."""
    rollouts = [r for r in services(client, "rollout") if at is None or r.address.startswith(f"{at}:")]
    return rollouts[0].figures.get(name, 0) if rollouts else 0


def trainer_version(client: redis.Redis) -> int:
    trainers = services(client, "trainer")
    return trainers[0].figures.get("policy_version", 0) if trainers else 0


def env_at(client: redis.Redis, address: str) -> ServiceRecord | None:
    return next((s for s in services(client, "env") if s.address.startswith(f"{address}:")), None)


def serving(client: redis.Redis, address: str) -> ServiceRecord | None:
    """The env service at ``address`` once it is registered with a session open on it."""
    record = env_at(client, address)
    return record if record is not None and record.figures["sessions"] >= 1 else None


def wait_for_progress(
    client: redis.Redis, what: str, timeout_s: float = 30, rollout: str | None = None
) -> None:
    """Env steps (of the only rollout, or the one at address ``rollout``) and the policy version both rise from
    where they are now."""
    steps, version = rollout_figure(client, "env_steps", rollout), trainer_version(client)
    wait_for(
        lambda: rollout_figure(client, "env_steps", rollout) > steps and trainer_version(client) > version,
        timeout_s,
        what,
        interval_s=0.25,
    )


def test_cut_env_node_costs_only_its_instances_and_comes_back(cluster: Cluster) -> None:
    client = connect(cluster.valkey.client_url)
    trainer_address, env_addresses = cluster.trainer_node.address, [n.address for n in cluster.env_nodes]

    # every service binds and advertises its node's address and is found through the registry
    wait_for(
        lambda: rollout_figure(client, "connected_sessions") == ENV_NODES, 60, "a session on every env node"
    )
    assert sorted(s.address.split(":")[0] for s in services(client, "env")) == sorted(env_addresses)
    for kind in ("trainer", "rollout"):
        assert [s.address.split(":")[0] for s in services(client, kind)] == [trainer_address]
    wait_for_progress(client, "training to proceed on 4 env nodes")
    for name in cluster.processes:  # over the network every link is secured as a deployment secures it
        assert "(TLS, token)" in cluster.log(name), name

    cut_node, others = cluster.env_nodes[0], env_addresses[1:]
    incarnation = env_at(client, cut_node.address).incarnation
    cut_log = f"env@{cut_node.name}"
    released_before = cluster.log(cut_log).count("instances released")
    cut_at = time.monotonic()
    cut_node.cut()
    wait_for_progress(client, "training to go on while the rollout has not noticed the cut yet")
    continued_s = time.monotonic() - cut_at
    wait_for(
        lambda: rollout_figure(client, "connected_sessions") == ENV_NODES - 1,
        20,
        "the rollout to drop the cut node's session",
    )
    dropped_s = time.monotonic() - cut_at
    other_steps = {a: env_at(client, a).figures["steps"] for a in others}
    wait_for_progress(client, "training to go on with 3 env nodes")
    # each env's figures refresh with its heartbeat, which may come after a fast update: wait for it
    wait_for(
        lambda: all(env_at(client, a).figures["steps"] > other_steps[a] for a in others),
        10,
        "every remaining env node to keep stepping",
    )
    wait_for(lambda: env_at(client, cut_node.address) is None, 15, "the cut node's registry entry to expire")
    expired_s = time.monotonic() - cut_at
    # its peer gone silent, the cut node must free the instances of the dead session by itself: the rollout's
    # closing of the stream never reaches it once its kernel gives up resending the FIN
    wait_for(
        lambda: cluster.log(cut_log).count("instances released") > released_before,
        max(1.0, RELEASE_WITHIN_S - (time.monotonic() - cut_at)),
        "the cut node to free the instances of its dead session",
    )
    released_s = time.monotonic() - cut_at
    assert cluster.processes[cut_log].poll() is None, "the cut node's service died"

    restored_at = time.monotonic()
    cut_node.restore()
    back = wait_for(
        lambda: serving(client, cut_node.address), 30, "the restored node to serve a session again"
    )
    assert back.incarnation == incarnation, "the restored node was restarted, not reconnected"
    wait_for(
        lambda: rollout_figure(client, "connected_sessions") == ENV_NODES,
        30,
        "the rollout's sessions on every env node again",
    )
    back_s = time.monotonic() - restored_at
    wait_for_progress(client, "training to proceed after the restore")
    print(
        f"\nnode cut: run went on by {continued_s:.1f}s, its session dropped after {dropped_s:.1f}s, "
        f"registry entry expired after {expired_s:.1f}s, dead session freed after {released_s:.1f}s; "
        f"link restored: instances back after {back_s:.1f}s"
    )


def test_two_rollouts_on_two_nodes_share_the_env_nodes_and_one_takes_over_when_the_other_dies(
    two_rollout_cluster: Cluster,
) -> None:
    cluster = two_rollout_cluster
    client = connect(cluster.valkey.client_url)
    here, there = cluster.trainer_node.address, cluster.rollout_nodes[0].address

    def rollout_at(address: str) -> ServiceRecord | None:
        return next((r for r in services(client, "rollout") if r.address.startswith(f"{address}:")), None)

    def holds(address: str, sessions: int) -> bool:
        record = rollout_at(address)
        return record is not None and record.figures["connected_sessions"] == sessions

    wait_for(
        lambda: holds(here, ENV_NODES // 2) and holds(there, ENV_NODES // 2), 90, "2 sessions per rollout"
    )
    held = {**rollout_at(here).figures["instances_by_env"], **rollout_at(there).figures["instances_by_env"]}
    assert len(held) == ENV_NODES and set(held.values()) == {INSTANCES}, (
        "every env node served, by one rollout"
    )
    steps = {a: rollout_at(a).figures["env_steps"] for a in (here, there)}
    wait_for(
        lambda: all(rollout_at(a).figures["env_steps"] > steps[a] for a in (here, there)),
        30,
        "both rollouts busy",
    )

    killed_at = time.monotonic()
    cluster.processes[f"rollout@{cluster.rollout_nodes[0].name}"].kill()
    wait_for(lambda: holds(here, ENV_NODES), 30, "the trainer node's rollout to take the killed one's share")
    taken_over_s = time.monotonic() - killed_at
    env_steps = {e.address: e.figures["steps"] for e in services(client, "env")}
    wait_for(
        lambda: all(e.figures["steps"] > env_steps.get(e.address, 0) for e in services(client, "env")),
        30,
        "every env node stepped by the rollout left",
    )
    wait_for_progress(client, "training to go on", rollout=here)
    print(f"\nrollout node killed: its 2 env nodes taken over by the other rollout after {taken_over_s:.1f}s")
