"""What the Tinker worker starts next, and what of it runs together: the scheduling rules, apart from the running.

A training model's requests run one at a time in the order of their numbers (its lane); a refused number is
answered in its place; queued sample requests start at once, each in a lane of its own (it joins its model's
running batch in the sampling process), tenants (sessions) in turn, least-served first, up to
``trainer.tinker.max_running_samples``; past it a tenant below its share of that number still starts one, up to
twice the number, so a newcomer's sample never waits behind another tenant's; the next ``forward_backward`` requests
of LoRA models of one base run as one batched pass (``trainer.tinker.batch_models``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

from tinker_atropos.tinker_api.store.queue import Upcoming
from tinker_atropos.tinker_api.store.samplers import SAMPLER_LANE
from tinker_atropos.training.served import LanguageModel, ServedModel

Job = tuple[str, str, tuple[str, int] | None]  # (lane, request, the model's number it applies, if numbered)


def next_jobs(
    upcoming: Upcoming,
    applied: dict[str, int],
    busy: set[str],
    max_samples: int,
    take_refusal: Callable[[str, int, str], str],
) -> list[Job]:
    """The next request of every idle lane: a model's next number (or, ``take_refusal``, the failure a refused
    number is answered with), then the queue's requests oldest first: a model's numbered one goes before its
    unload, every sample in a lane of its own (``fair_samples``)."""
    jobs: list[Job] = []
    for model_id in sorted({*upcoming.requests, *upcoming.refused} - busy):
        seq = applied[model_id] + 1
        request_id = upcoming.requests.get(model_id)
        if request_id is None:
            request_id = take_refusal(model_id, seq, upcoming.refused[model_id])
        jobs.append((model_id, request_id, (model_id, seq)))
    seen = busy | {lane for lane, _, _ in jobs}
    samples = dict(upcoming.samples)
    for request_id, lane in upcoming.queued:
        if lane.startswith(SAMPLER_LANE):  # queued before samples queued per tenant: the lane is the tenant
            samples.setdefault(lane.removeprefix(SAMPLER_LANE), []).append(request_id)
        elif lane not in seen:
            seen.add(lane)
            jobs.append((lane, request_id, None))
    jobs += [(lane, request_id, None) for lane, request_id in fair_samples(samples, busy, max_samples)]
    return jobs


def sample_lane(tenant: str, request_id: str) -> str:
    return f"{SAMPLER_LANE}{tenant}#{request_id}"


def lane_tenant(lane: str) -> str:
    """The tenant of a sample's lane (``sample_lane``)."""
    return lane[len(SAMPLER_LANE) :].rpartition("#")[0]


def fair_samples(queued: dict[str, list[str]], busy: set[str], max_samples: int) -> list[tuple[str, str]]:
    """(lane, request) of the queued samples to start, oldest first within a tenant and the tenant running the
    fewest first: while fewer than ``max_samples`` run, and past it for a tenant below its share of them (at most
    twice ``max_samples`` in all)."""
    running = Counter(
        lane[len(SAMPLER_LANE) :].rpartition("#")[0] for lane in busy if lane.startswith(SAMPLER_LANE)
    )
    waiting = {
        tenant: [r for r in ids if sample_lane(tenant, r) not in busy] for tenant, ids in queued.items()
    }
    waiting = {
        tenant: ids[::-1] for tenant, ids in waiting.items() if ids
    }  # popped from the end: oldest first
    share = math.ceil(max_samples / max(1, len({*waiting, *running})))
    started, total = [], sum(running.values())
    while waiting:
        tenant = min(waiting, key=lambda t: running[t])
        if total >= max_samples and (running[tenant] >= share or total >= 2 * max_samples):
            break
        request_id = waiting[tenant].pop()
        if not waiting[tenant]:
            del waiting[tenant]
        started.append((sample_lane(tenant, request_id), request_id))
        running[tenant] += 1
        total += 1
    return started


def together(
    jobs: list[Job],
    models: Mapping[str, ServedModel],
    kinds: Callable[[list[str]], list[str | None]],
    passes: int = 1,
) -> list[list[Job]]:
    """The jobs as they run, each list in one thread: the next requests of LoRA models of one base and one adapter
    layout that are all ``forward_backward`` (or forward) run as batched passes, ``passes`` of them side by side
    (each of at least two requests), any other alone. ``kinds``: the kind of each request (the store's)."""
    layouts = {}
    for job in jobs:
        model = models.get(job[0]) if job[2] is not None else None
        if isinstance(model, LanguageModel) and model.lora:
            layouts[job] = (model.base_model, frozenset(model.adapter))
    if len(layouts) < 2:
        return [[job] for job in jobs]
    groups: dict[tuple[str, frozenset[str]], list[Job]] = {}
    for (job, layout), kind in zip(
        layouts.items(), kinds([request_id for _, request_id, _ in layouts]), strict=True
    ):
        if kind == "forward_backward":
            groups.setdefault(layout, []).append(job)
    grouped = [
        group[i::passes] for group in groups.values() for i in range(passes) if len(group[i::passes]) > 1
    ]
    members = {job for group in grouped for job in group}
    return grouped + [[job] for job in jobs if job not in members]
