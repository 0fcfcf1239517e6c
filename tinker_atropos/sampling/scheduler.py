"""Which request a running batch takes next, and whose rows make room for it: the engine's admission rule.

The key-value budget bounds the batch: a request is admitted while every request in flight, each grown to the
longest, fits it; one that could never fit is refused at once.

A tenant is whoever a request is accounted to (a Tinker session; "" where the caller has none). The rule is
least-served first, as fair queueing serves flows: the next request admitted is the oldest of the tenant holding
the fewest rows in flight, so a newcomer's request joins the next batch however much another tenant has queued.
When it does not fit the key-value budget, the tenant holding the most rows gives up its latest request (vLLM's
preemption by recomputation: the request goes back to the head of its tenant's queue and starts over), but only
while that tenant would still hold at least as many rows as the newcomer's: two tenants never take turns
preempting each other, and one tenant alone is never preempted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class Held(Protocol):
    """A request as the share rule sees it."""

    tenant: str
    submitted: float

    @property
    def rows(self) -> int: ...

    @property
    def positions(self) -> int: ...


R = TypeVar("R", bound=Held)


def check_budget(samples: int, positions: int, kv_tokens: int, budget_name: str) -> None:
    """ValueError for a request of ``samples`` rows of ``positions`` (prompt + max_tokens) that could never fit."""
    if samples * positions > kv_tokens:
        raise ValueError(
            f"{samples} samples of {positions} positions (prompt + max_tokens) need {samples * positions} "
            f"positions of keys and values, more than {budget_name} ({kv_tokens}); ask for fewer or shorter "
            "samples"
        )


def next_admission(
    waiting: Sequence[R], flight: Sequence[R], kv_tokens: int, preempt: bool = True
) -> tuple[R | None, R | None]:
    """(the request of ``waiting`` to admit, None) while every request in ``flight`` and it, each grown to the
    longest, fit ``kv_tokens`` positions (or nothing is in flight); else (None, the request of ``flight`` to
    preempt for it, when ``preempt`` and one is over-served); (None, None) when nothing is admitted now."""
    if not waiting:
        return None, None
    held = rows_by_tenant(flight)
    request = fairest(waiting, held)
    longest = max([r.positions for r in flight] + [request.positions])
    if not flight or (sum(held.values()) + request.rows) * longest <= kv_tokens:
        return request, None
    return None, victim(flight, held, request) if preempt else None


def rows_by_tenant(flight: Iterable[Held]) -> Counter[str]:
    """The rows each tenant holds in the batch and among the prompts being read."""
    held: Counter[str] = Counter()
    for request in flight:
        held[request.tenant] += request.rows
    return held


def fairest(waiting: Sequence[R], held: Counter[str]) -> R:
    """The request of ``waiting`` admitted next: the oldest of the tenant holding the fewest rows (ties: the tenant
    that has waited longest)."""
    oldest: dict[str, R] = {}
    for request in waiting:
        if request.tenant not in oldest or request.submitted < oldest[request.tenant].submitted:
            oldest[request.tenant] = request
    return min(oldest.values(), key=lambda r: (held[r.tenant], r.submitted))


def victim(flight: Sequence[R], held: Counter[str], newcomer: Held) -> R | None:
    """The request in ``flight`` (oldest first) that makes room for ``newcomer``: the latest of the tenant holding
    the most rows, if that tenant still holds at least the newcomer's tenant's rows once it is gone and the
    newcomer is in; None when no tenant holds more than its share."""
    after = held[newcomer.tenant] + newcomer.rows
    candidates = [r for r in flight if r.tenant != newcomer.tenant and held[r.tenant] - r.rows >= after]
    if not candidates:
        return None
    richest = max(held[r.tenant] for r in candidates)
    return [r for r in candidates if held[r.tenant] == richest][-1]
