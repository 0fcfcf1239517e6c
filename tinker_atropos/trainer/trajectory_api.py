"""The Atropos trajectory API as the Atropos loop uses it, the way atroposlib's own trainers do: found (the
configured ``trainer.atropos.api_url``, else the run's ``atropos-api`` in the registry), registered with (batch
size, token bound, the step a restarted trainer reached), then polled for batches. An API that does not answer is
waited for, never fatal: the loop learns again once it is back."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

from tinker_atropos.config import AtroposTrainerSection
from tinker_atropos.state.registry import live_services

log = logging.getLogger(__name__)

POLL_S = 0.1  # between two /batch calls that found no batch
RETRY_S = 1.0  # after the API did not answer


def find_api(
    section: AtroposTrainerSection, client: redis.Redis, run: str, stop: threading.Event
) -> str | None:
    """The API's URL; None once ``stop`` is set before one registered."""
    if section.api_url:
        return section.api_url.rstrip("/")
    while not stop.is_set():
        apis = [s.figures.get("url") for s in live_services(client, run, "atropos_api")]
        if url := next((u for u in apis if u), None):
            return url
        log.info("waiting for the run's atropos-api to register")
        stop.wait(RETRY_S)
    return None


def register(http: httpx.Client, body: dict[str, Any], stop: threading.Event) -> bool:
    """POST /register until it is taken; False once ``stop`` is set first."""
    while not stop.is_set():
        try:
            http.post("/register", json=body).raise_for_status()
            return True
        except httpx.HTTPError as error:
            log.warning("cannot register with the trajectory API at %s: %s", http.base_url, error)
            stop.wait(RETRY_S)
    return False


def registration(
    section: AtroposTrainerSection, run: str, folder: Path, every: int, step: int
) -> dict[str, Any]:
    """What an Atropos trainer tells the API it is: atroposlib's ``/register`` body."""
    return {
        "wandb_group": run,
        "wandb_project": "tinker-atropos",
        "batch_size": section.batch_size,
        "max_token_len": section.max_token_len,
        "checkpoint_dir": str(folder),
        "save_checkpoint_interval": every,
        "starting_step": step,
        "num_steps": section.num_steps,
    }


def batches(http: httpx.Client, stop: threading.Event) -> Iterator[list[dict[str, Any]]]:
    """Each batch the API hands out (GET /batch), until ``stop``; an empty answer polled again, a failed one
    retried."""
    while not stop.is_set():
        try:
            answer = http.get("/batch").json()
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            log.warning("GET /batch failed (%s); retrying", error)
            stop.wait(RETRY_S)
            continue
        batch = answer.get("batch") if isinstance(answer, dict) else None
        if batch:
            yield batch
        else:
            stop.wait(POLL_S)
