"""How atroposlib 0.4.0's trajectory API packs scored groups into batches, and what it tells an environment of
the queue, as functions of the groups' sizes and env ids only.

Compatibility means the same batches in the same order and the same ``/status-env`` figures, so these follow the
reference's rules step for step (its ``api/utils.py`` and ``/status-env``), odd corners included; the group
bodies stay in Redis (``store.py``). A batch is a list of queue indices, in the order the reference puts the
groups into the batch.

- **Packs**: groups are never split. A group of size s joins a batch only as part of a *pack*: max-size / s
  queued groups of that size, counted in queue order; a batch is packs' groups in the order the packs complete,
  until exactly ``batch_size`` sequences.
- **Minimum allocations**: when an env registered with ``min_batch_allocation``, its packs go first, up to
  int(batch_size × allocation) sequences each (scaled down together when they exceed the batch), then any packs
  in queue order.
- **Odd-sized groups** (a group whose size is not its env's ``group_size``) wait in a per-env buffer until some of
  them sum to ``group_size`` exactly (first in, first out; else any subset, by dynamic programming).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ENV_WEIGHT = 0.01  # the floor of an env's sampling weight, so that none starves


@dataclass(frozen=True)
class Queued:
    """One queued group as the packing sees it: its sequence count and the env that sent it."""

    size: int
    env_id: int | None


@dataclass
class EnvEntry:
    """One registered environment (the reference's fields, persisted as they are)."""

    max_context_len: int
    weight: float
    desired_name: str
    real_name: str
    registered_id: int
    last_update: float
    connected: bool
    min_batch_allocation: float | None
    group_size: int


def summing_to(sizes: list[int], target: int) -> list[int]:
    """Indices of buffered groups whose sizes sum to ``target`` exactly, or []: first in, first out when that
    works, else the subset that the dynamic programme's backtracking finds (earliest indices preferred)."""
    if not sizes:
        return []
    chosen, total = [], 0
    for i, size in enumerate(sizes):
        if total + size <= target:
            chosen.append(i)
            total += size
            if total == target:
                return chosen
    # reachable[i][j]: the first i groups can make j
    reachable = [[False] * (target + 1) for _ in range(len(sizes) + 1)]
    reachable[0][0] = True
    for i in range(1, len(sizes) + 1):
        for j in range(target + 1):
            reachable[i][j] = reachable[i - 1][j] or (
                j >= sizes[i - 1] and reachable[i - 1][j - sizes[i - 1]]
            )
    if not reachable[len(sizes)][target]:
        return []
    chosen, j = [], target
    for i in range(len(sizes), 0, -1):
        if j >= sizes[i - 1] and reachable[i - 1][j - sizes[i - 1]]:
            chosen.append(i - 1)
            j -= sizes[i - 1]
    return sorted(chosen)


def _packs(queue: list[Queued], max_size: int) -> list[int]:
    """Queue indices of complete packs, in the order they complete (all envs together)."""
    pending: dict[int, list[int]] = {}
    packed: list[int] = []
    for i, group in enumerate(queue):
        bucket = pending.setdefault(group.size, [])
        bucket.append(i)
        if len(bucket) * group.size == max_size:
            packed += bucket
            bucket.clear()
    return packed


def exact_batch(queue: list[Queued], batch_size: int) -> list[int] | None:
    """The next batch of exactly ``batch_size`` sequences made of whole packs, or None."""
    if not queue or sum(g.size for g in queue) < batch_size:
        return None
    packed = _packs(queue, max(g.size for g in queue))
    if sum(queue[i].size for i in packed) < batch_size:
        return None
    batch, total = [], 0
    for i in packed:
        batch.append(i)
        total += queue[i].size
        if total >= batch_size:
            break
    return batch if total == batch_size else None


def allocated_batch(queue: list[Queued], batch_size: int, envs: list[EnvEntry]) -> list[int] | None:
    """The next batch when envs have minimum allocations: each such env's packs first (up to its minimum),
    then packs of any env in queue order; None when a minimum cannot be met or no exact batch forms."""
    if not queue:
        return None
    minimums = {
        e.registered_id: e.min_batch_allocation
        for e in envs
        if e.connected and e.min_batch_allocation is not None
    }
    if not minimums:
        return exact_batch(queue, batch_size)
    max_size = max(g.size for g in queue)
    pending: dict[int, dict[int, list[int]]] = {}  # env -> size -> indices not yet a pack
    packable: dict[int, list[int]] = {}  # env -> indices in complete packs, in completion order
    for i, group in enumerate(queue):
        if group.env_id is None:
            continue
        by_size = pending.setdefault(group.env_id, {})
        packable.setdefault(group.env_id, [])
        bucket = by_size.setdefault(group.size, [])
        bucket.append(i)
        if len(bucket) * group.size == max_size:
            packable[group.env_id] += bucket
            by_size[group.size] = []
    wanted: dict[int, int] = {}
    for env_id, allocation in minimums.items():
        sequences = int(batch_size * allocation)
        if sequences > 0:
            if env_id not in pending or not packable.get(env_id):
                return None  # a minimum this queue cannot meet
            wanted[env_id] = sequences
    if sum(wanted.values()) > batch_size:
        scale = batch_size / sum(wanted.values())
        for env_id in wanted:
            if packable.get(env_id):
                smallest = min(queue[i].size for i in packable[env_id])
                wanted[env_id] = max(smallest, int(wanted[env_id] * scale))
    batch: list[int] = []
    taken = dict.fromkeys(packable, 0)
    total = 0
    for env_id, sequences in wanted.items():
        for i in packable.get(env_id, []):
            if taken[env_id] >= sequences:
                break
            if total + queue[i].size <= batch_size:
                batch.append(i)
                taken[env_id] += queue[i].size
                total += queue[i].size
    if total < batch_size:
        in_packs = {i for indices in packable.values() for i in indices}
        for i, group in enumerate(queue):
            if i in batch or i not in in_packs:
                continue
            if total + group.size <= batch_size:
                batch.append(i)
                total += group.size
            if total == batch_size:
                break
    return batch if total == batch_size else None


def next_batch(queue: list[Queued], batch_size: int, envs: list[EnvEntry]) -> list[int] | None:
    """The reference's choice: with any env holding a minimum allocation (connected or not), the allocating
    packer, else the plain one."""
    if any(e.min_batch_allocation is not None for e in envs):
        return allocated_batch(queue, batch_size, envs)
    return exact_batch(queue, batch_size)


def env_status(
    queue: list[Queued], envs: list[EnvEntry], env_id: int, step: int, batch_size: int
) -> tuple[dict[str, float | int], int]:
    """``/status-env``'s answer for ``env_id`` and that env's group size as the reference updates it (the
    largest of its registered size and its queued groups'): the caller stores it back."""
    entry = envs[env_id]
    total = sum(e.max_context_len * max(0.0, e.weight) for e in envs if e.connected)
    weight = max(MIN_ENV_WEIGHT, entry.max_context_len * entry.weight / total)
    allocated = sum(
        e.min_batch_allocation for e in envs if e.connected and e.min_batch_allocation is not None
    )
    group_size, max_group_size, own_sequences = entry.group_size, 1, 0
    for group in queue:
        max_group_size = max(max_group_size, group.size)
        if group.env_id == env_id:
            group_size = max(group_size, group.size)
            own_sequences += group.size
    minimum_of = {
        e.registered_id: int(batch_size * e.min_batch_allocation)
        for e in envs
        if e.connected and e.min_batch_allocation is not None
    }
    others: dict[int | None, int] = {}
    for group in queue:
        if group.env_id != env_id:
            others[group.env_id] = others.get(group.env_id, 0) + group.size
    available = 0
    if max_group_size > 1:
        for other, sequences in others.items():
            packed = math.ceil(sequences / max_group_size) * max_group_size
            available += max(0, packed - minimum_of.get(other, 0))  # type: ignore[arg-type]
    return {
        "current_step": step,
        "queue_size": (own_sequences + available) // group_size,
        "unallocated_fraction": 1.0 - min(allocated, 1.0),
        "self_queue_size": own_sequences // group_size,
        "max_group_size": max_group_size,
        "env_weight": weight,
    }, group_size
