"""How rollouts divide the env services' session slots (rollout/assignment.py) and the leases that make it hold
(state/leases.py): balanced to one unit, the same answer from every rollout, only the share that changes moves,
local units preferred, and every bad record skipped and counted."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
import redis

from tinker_atropos.rollout.assignment import Unit, assign, rendezvous, units_of
from tinker_atropos.state import keys
from tinker_atropos.state.leases import Leases, Member

RUN = "leases"


def envs(count: int, instances: int = 8, slots: int = 1, host: str = "h") -> list[Unit]:
    return [
        u for i in range(count) for u in units_of(f"env{i}", f"env-{i}", f"a:{i}", host, instances, slots)
    ]


def rollouts(count: int, host: str = "h", prefix: str = "r") -> list[Member]:
    return [Member(f"{prefix}{i}", host) for i in range(count)]


def loads(assignment: dict[str, str], units: list[Unit]) -> Counter[str]:
    weight = {u.key: u.instances for u in units}
    return Counter({member: 0 for member in assignment.values()}) + Counter(
        {m: sum(weight[k] for k, o in assignment.items() if o == m) for m in set(assignment.values())}
    )


def moved(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {key for key in before.keys() & after.keys() if before[key] != after[key]}


def test_units_split_an_env_services_instances_among_its_slots() -> None:
    units = units_of("e", "env-0", "a:1", "h", 10, 3)
    assert [(u.key, u.instances) for u in units] == [("e:0", 4), ("e:1", 3), ("e:2", 3)]
    # empty slots are no units
    assert [u.instances for u in units_of("e", "env-0", "a:1", "h", 2, 4)] == [
        1,
        1,
    ]


def test_four_env_services_over_two_rollouts_give_each_two_whatever_the_names() -> None:
    """Rendezvous hashing alone leaves one rollout 3 or 4 of the 4 in most draws; the assignment never does."""
    rng = random.Random(0)
    for _ in range(200):
        tag = rng.getrandbits(32)
        units = [u for i in range(4) for u in units_of(f"{tag}e{i}", f"env-{i}", f"a:{i}", "h", 16, 1)]
        members = [Member(f"{tag}r{i}", "h") for i in range(2)]
        assert sorted(loads(assign(units, members, {}), units).values()) == [32, 32]
    unbalanced = sum(
        max(Counter(max("ab", key=lambda m: rendezvous(f"{t}e{i}", m)) for i in range(4)).values()) > 2
        for t in range(200)
    )
    assert unbalanced > 100  # what plain rendezvous hashing does with the same 4 units


@pytest.mark.parametrize("seed", range(30))
def test_balanced_to_one_unit_and_the_same_from_every_rollout_for_any_view(seed: int) -> None:
    rng = random.Random(seed)
    units = [
        u
        for i in range(rng.randint(1, 12))
        for u in units_of(
            f"e{i}", f"env-{i}", f"a:{i}", f"h{i % 3}", rng.choice([4, 8, 16]), rng.randint(1, 3)
        )
    ]
    members = [Member(f"r{i}", f"h{i % 3}") for i in range(rng.randint(1, 5))]
    held = {
        u.key: rng.choice([m.incarnation for m in members] + ["dead"]) for u in units if rng.random() < 0.5
    }

    result = assign(units, members, held)

    assert set(result) == {u.key for u in units}
    assert set(result.values()) <= {m.incarnation for m in members}
    load = Counter({m.incarnation: 0 for m in members}) + loads(result, units)
    assert max(load.values()) - min(load.values()) <= max(u.instances for u in units)
    shuffled_units, shuffled_members = units[:], members[:]
    rng.shuffle(shuffled_units)
    rng.shuffle(shuffled_members)
    assert assign(shuffled_units, shuffled_members, dict(reversed(held.items()))) == result
    assert assign(units, members, result) == result, "acting on the answer must not move anything again"


def test_equal_units_differ_by_at_most_one_per_rollout() -> None:
    for n_units in range(1, 13):
        for n_members in range(1, 6):
            units, members = envs(n_units), rollouts(n_members)
            counts = Counter({m.incarnation: 0 for m in members}) + Counter(
                assign(units, members, {}).values()
            )
            assert max(counts.values()) - min(counts.values()) <= 1, (n_units, n_members, counts)


@pytest.mark.parametrize("seed", range(10))
def test_a_death_moves_only_the_dead_rollouts_units_and_a_join_only_the_newcomers_share(seed: int) -> None:
    rng = random.Random(seed)
    n_units, n_members = rng.randint(4, 16), rng.randint(2, 5)
    units = [u for i in range(n_units) for u in units_of(f"{seed}e{i}", f"env-{i}", f"a:{i}", "h", 8, 1)]
    members = [Member(f"{seed}r{i}", "h") for i in range(n_members)]
    before = assign(units, members, {})
    dead = rng.choice(members)

    after_death = assign(units, [m for m in members if m != dead], before)
    assert moved(before, after_death) == {k for k, m in before.items() if m == dead.incarnation}
    counts = Counter(after_death.values())
    assert max(counts.values()) - min(counts.values()) <= 1

    newcomer = Member(f"{seed}new", "h")
    joined = assign(units, [*members, newcomer], before)
    assert {joined[k] for k in moved(before, joined)} <= {newcomer.incarnation}
    assert len(moved(before, joined)) == n_units // (n_members + 1), "the newcomer takes its share, no more"


def test_a_lease_of_a_dead_or_unknown_rollout_holds_nothing() -> None:
    units, members = envs(4), rollouts(2)
    result = assign(units, members, dict.fromkeys((u.key for u in units), "gone"))
    assert sorted(Counter(result.values()).values()) == [2, 2]


def test_local_units_are_preferred_while_balance_allows() -> None:
    """Two hosts, each with two env services and one rollout: whoever held what, each rollout ends with the two
    env services it steps over its local socket; with a third rollout on a host of no env service, balance wins."""
    units = envs(2, host="east") + [
        u for i in (2, 3) for u in units_of(f"env{i}", f"env-{i}", f"a:{i}", "west", 8, 1)
    ]
    east, west = Member("r-east", "east"), Member("r-west", "west")

    for held in (
        {},
        dict.fromkeys((u.key for u in units), "r-east"),
        {"env0:0": "r-west", "env2:0": "r-east"},
    ):
        result = assign(units, [east, west], held)
        assert {k for k, m in result.items() if m == "r-east"} == {"env0:0", "env1:0"}, held

    third = assign(units, [east, west, Member("r-north", "north")], {})
    assert sorted(Counter(third.values()).values()) == [1, 1, 2]


def test_no_rollouts_no_assignment() -> None:
    assert assign(envs(3), [], {}) == {}


# the leases, on a real Valkey


@pytest.fixture
def leases(redis_client: redis.Redis) -> tuple[Leases, Leases]:
    return (Leases(redis_client, RUN, "ra", "h", ttl_s=0.3), Leases(redis_client, RUN, "rb", "h", ttl_s=0.3))


def test_a_lease_has_one_holder_is_refreshed_by_it_and_expires_without_it(leases, redis_client) -> None:
    a, b = leases
    assert a.claim("e:0") and not b.claim("e:0")
    assert a.refresh(["e:0"]) == set() and b.refresh(["e:0"]) == {"e:0"}, "b never held it"
    b.release("e:0")
    assert a.read(["e:0"], {"ra", "rb"}).held == {"e:0": "ra"}, "only the holder deletes its lease"
    assert [m.incarnation for m in a.members()] == ["ra", "rb"]
    time.sleep(0.45)  # neither refreshed: both memberships and the lease expire
    assert a.read(["e:0"], {"ra"}).held == {} and [m.incarnation for m in b.members()] == ["rb"]
    assert b.claim("e:0")
    assert a.refresh(["e:0"]) == {"e:0"}, "a's lease expired and b took the unit: a has lost it"


def test_a_refresh_recreates_a_lease_that_redis_lost(leases, redis_client) -> None:
    a, _ = leases
    assert a.claim("e:1")
    redis_client.delete(keys.lease(RUN, "e:1"))
    assert a.refresh(["e:1"]) == set()
    assert a.read(["e:1"], {"ra"}).held == {"e:1": "ra"}


def test_leaving_frees_every_lease_and_the_membership_at_once(leases) -> None:
    a, b = leases
    a.refresh([])
    assert a.claim("e:0") and a.claim("e:1")
    a.leave(["e:0", "e:1"])
    assert b.read(["e:0", "e:1"], {"ra", "rb"}).held == {}
    assert [m.incarnation for m in b.members()] == ["rb"]


def test_bad_records_are_skipped_counted_once_and_can_be_taken_over(leases, redis_client) -> None:
    a, _ = leases
    bad = {
        "e:0": b"{not json",
        "e:1": json.dumps({"run": "other", "unit": "e:1", "holder": "rb"}).encode(),
        "e:2": json.dumps({"run": RUN, "unit": "e:2", "holder": "gone"}).encode(),
        "e:3": json.dumps({"run": RUN, "unit": "e:9", "holder": "rb"}).encode(),  # another unit's record
        "e:4": json.dumps([1, 2]).encode(),
    }
    for unit, raw in bad.items():
        redis_client.set(keys.lease(RUN, unit), raw)  # no TTL: it would block the unit for good
    redis_client.set(keys.member(RUN, "rollout", "rx"), b"\xff\xfe")
    redis_client.set(
        keys.member(RUN, "rollout", "ry"), json.dumps({"run": RUN, "incarnation": "rz", "host": ""})
    )
    redis_client.sadd(keys.members(RUN, "rollout"), "rx", "ry", "gone")  # "gone": no record, pruned

    members = a.members()
    for _ in range(3):  # read every tick, counted once
        view = a.read(bad, {m.incarnation for m in members} | {"rb"})

    assert [m.incarnation for m in members] == ["ra"]
    assert redis_client.smembers(keys.members(RUN, "rollout")) == {b"rx", b"ry"}
    assert view.held == {} and view.stale == bad
    assert a.skipped == {"malformed": 5, "other_run": 1, "dead_holder": 1}
    for unit in bad:
        assert not a.claim(unit), "a plain claim never overwrites a record"
        assert a.claim(unit, replacing=bad[unit])
    assert a.read(bad, {"ra"}).held == dict.fromkeys(bad, "ra")
    assert all(0 < redis_client.pttl(keys.lease(RUN, unit)) <= 300 for unit in bad)
