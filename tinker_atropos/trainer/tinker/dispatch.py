"""What the Tinker worker starts next, and what of it runs together: the scheduling rules, apart from the running.

A training model's requests run one at a time in the order of their numbers (its lane); a refused number is
answered in its place; every queued sample request runs at once, up to ``trainer.tinker.max_running_samples``
(each joins its model's running batch in the sampling process); the next ``forward_backward`` requests of LoRA
models of one base run as one batched pass (``trainer.tinker.batch_models``).
"""

from __future__ import annotations

from collections.abc import Callable

from tinker_atropos.frontends.tinker.store.requests import Upcoming
from tinker_atropos.frontends.tinker.store.samplers import SAMPLER_LANE
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
    unload, every sample in a lane of its own while fewer than ``max_samples`` run."""
    jobs: list[Job] = []
    for model_id in sorted({*upcoming.requests, *upcoming.refused} - busy):
        seq = applied[model_id] + 1
        request_id = upcoming.requests.get(model_id)
        if request_id is None:
            request_id = take_refusal(model_id, seq, upcoming.refused[model_id])
        jobs.append((model_id, request_id, (model_id, seq)))
    seen = busy | {lane for lane, _, _ in jobs}
    samples = sum(lane.startswith(SAMPLER_LANE) for lane in busy)
    for request_id, lane in upcoming.queued:
        if lane.startswith(SAMPLER_LANE):
            lane = f"{lane}#{request_id}"
            if lane in seen or samples >= max_samples:
                continue
            samples += 1
        elif lane in seen:
            continue
        seen.add(lane)
        jobs.append((lane, request_id, None))
    return jobs


def together(
    jobs: list[Job],
    models: dict[str, ServedModel],
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
