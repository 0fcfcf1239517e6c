"""Which rollout acts on which part of the env services: every rollout of a run computes the same answer from the
same view, so they divide the work without talking to each other.

The unit of work is one session slot of one env service: ``rollout.sessions_per_env`` slots per service, its
instances split among them, each slot weighing its instances. ``assign`` gives every unit to one live rollout:

1. a unit keeps the rollout that holds its lease, if that rollout is live (a join, leave or death moves only the
   units that must move);
2. the other units, heaviest first, go to the least loaded rollout (or one less than the unit's instances above
   it), preferring one on the unit's own host (its local fast path), then by rendezvous hashing of (unit,
   rollout), so that ties break alike everywhere and spread evenly;
3. while the most loaded rollout holds a unit whose move to the least loaded one narrows the gap, the least
   loaded takes the one it prefers: at the end no two rollouts differ by more than one unit's instances (with
   equal units: their counts differ by at most one);
4. where a unit sits off its host while a rollout of that host holds an equal unit that is off its own, the two
   swap: balance stays, and one more session takes the local path.

Applied to its own answer it answers the same, so once the rollouts act on it, nothing moves until the view
changes. Rendezvous hashing (Thaler and Ravishankar, 1998) alone would not do: with 4 units over 2 rollouts it
gives one of them 3 or 4 units in 5 cases out of 8.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tinker_atropos.state.leases import Member


@dataclass(frozen=True)
class Unit:
    """One session slot of one env service."""

    key: str  # "{env incarnation}:{slot}": what its lease is named by
    env_incarnation: str
    env_name: str
    address: str
    slot: int
    slots: int
    instances: int
    host: str


def units_of(incarnation: str, name: str, address: str, host: str, instances: int, slots: int) -> list[Unit]:
    """The session slots of one env service, its instances split as evenly as they go; a slot without
    instances (more slots than instances) is no unit."""
    units = []
    for slot in range(slots):
        n = instances // slots + (slot < instances % slots)
        if n:
            units.append(Unit(f"{incarnation}:{slot}", incarnation, name, address, slot, slots, n, host))
    return units


def rendezvous(unit: str, member: str) -> int:
    """The rendezvous weight of (unit, rollout): a hash every process computes alike (Python's own is salted)."""
    return int.from_bytes(hashlib.blake2b(f"{unit}|{member}".encode(), digest_size=8).digest(), "big")


def _preference(unit: Unit, member: Member) -> tuple[bool, int]:
    return bool(unit.host) and unit.host == member.host, rendezvous(unit.key, member.incarnation)


def assign(units: Sequence[Unit], members: Sequence[Member], held: Mapping[str, str]) -> dict[str, str]:
    """Unit key -> the incarnation of the rollout that acts on it; ``held``: unit key -> the holder of its lease
    (holders that are no live member are ignored). Empty without members."""
    if not members:
        return {}
    members = sorted(set(members), key=lambda m: m.incarnation)
    by_incarnation = {m.incarnation: m for m in members}
    units = sorted(units, key=lambda u: u.key)
    owner: dict[str, Member] = {}
    load = dict.fromkeys(members, 0)
    for unit in units:  # 1. live holders keep their units
        holder = by_incarnation.get(held.get(unit.key, ""))
        if holder is not None:
            owner[unit.key] = holder
            load[holder] += unit.instances
    for unit in sorted((u for u in units if u.key not in owner), key=lambda u: (-u.instances, u.key)):
        lightest = min(load.values())  # 2. the least loaded take it (any within the unit's weight of them)
        chosen = max(
            (m for m in members if load[m] < lightest + unit.instances), key=lambda m: _preference(unit, m)
        )
        owner[unit.key] = chosen
        load[chosen] += unit.instances
    while True:  # 3. each move lowers the sum of squared loads, so this ends
        most = max(members, key=lambda m: (load[m], m.incarnation))
        least = min(members, key=lambda m: (load[m], m.incarnation))
        movable = [u for u in units if owner[u.key] == most and load[least] + u.instances < load[most]]
        if not movable:
            break
        unit = max(movable, key=lambda u: _preference(u, least))
        owner[unit.key] = least
        load[most] -= unit.instances
        load[least] += unit.instances
    swapped = True
    while swapped:  # 4. each swap adds a local session, so this ends
        swapped = False
        for unit in units:
            here = owner[unit.key]
            if not unit.host or unit.host == here.host:
                continue
            local = next(
                (
                    other
                    for other in units
                    if owner[other.key].host == unit.host
                    and other.host != unit.host
                    and other.instances == unit.instances
                ),
                None,
            )
            if local is not None:
                owner[unit.key], owner[local.key] = owner[local.key], here
                swapped = True
    return {key: member.incarnation for key, member in owner.items()}
