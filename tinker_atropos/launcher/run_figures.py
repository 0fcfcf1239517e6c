"""What one row of ``up``'s progress (``progress.py``) says, read from Redis: the run's counters and latest
episodes, and each live service's figures, the trainer's above all (its policy version, lag, losses, latest
evaluation). Between two rows it keeps what a row is measured against: the counts of steps of the latest rows (the
rate), each service's last heartbeat and incident counters, the trainer's latest figures and its Tinker API's
address."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import redis

from tinker_atropos.state.experience import queued_chunks, read_stats, recent_episodes
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

# the words that name a counter of something refused, rejected, lost or gone wrong, whatever service counts it
INCIDENT_WORDS = (
    "rejected",
    "refused",
    "failed",
    "nonfinite",
    "repaired",
    "skipped",
    "lost",
    "invalid",
    "dropped",
    "timed_out",
    "bad_requests",
    "taken_over",
)


RATE_WINDOW_S = 30.0  # a row's steps/s is over at least this much of the latest rows' time (or all there is)


class StepRate:
    """Steps per second over the latest ``window_s`` of rows rather than since the last row alone: an Atropos
    loop's steps come a batch at a time, seconds apart, and a rate per row swung from 0 to thousands."""

    def __init__(self, now: float, steps: int, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque([(now, steps)])  # (time, steps) of the rows kept

    def rate(self, now: float, steps: int) -> float:
        """The rate from the newest row at least ``window_s`` old (the oldest kept, early on) to ``steps`` now."""
        self._points.append((now, steps))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        then, before = self._points[0]
        return (steps - before) / max(now - then, 1e-9)


def is_incident(name: str) -> bool:
    """Whether the counter ``name`` counts something refused, skipped, lost or failed."""
    return any(word in name for word in INCIDENT_WORDS)


class RunFigures:
    """Run ``run``'s figures in ``client``, one row at a time; ``counters``, ``wall_offset_s`` and
    ``policy_version`` continue a resumed run, ``return_window`` is the episodes a row's return averages."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        return_window: int,
        counters: dict[str, int] | None,
        wall_offset_s: float,
        policy_version: int,
    ) -> None:
        self.client, self.run, self.return_window = client, run, return_window
        self.start, self.wall_offset_s = time.monotonic(), wall_offset_s
        self.counters = dict(counters or {})  # the run's counters at the last row
        self.rate = StepRate(self.start, self.counters.get("env_steps", 0))
        # (service name, incarnation) -> its incident counters at the last row that saw it: a service that
        # restarted starts from 0, and a stopped one is gone from the registry by the time `up` sums up
        self.service_incidents: dict[tuple[str, str], dict[str, int]] = {}
        # a service's name -> when a row last saw it in the registry
        self.heartbeats: dict[str, float] = {}
        self.trainer: dict[str, Any] = {}  # the trainer's figures at the last row (empty while it restarts)
        self.tinker_api = ""  # the trainer's Tinker API URL, once it serves one
        # until the trainer publishes: a resumed run's checkpoint version
        self._policy_version = policy_version

    def row(self) -> dict[str, Any]:
        """The run's figures now, as one metrics.jsonl row."""
        now = time.monotonic()
        stats = read_stats(self.client, self.run)
        episodes = recent_episodes(self.client, self.run, self.return_window)
        services = live_services(self.client, self.run)
        self.heartbeats |= dict.fromkeys((service.name for service in services), now)
        for service in services:
            self.service_incidents[(service.name or service.kind, service.incarnation)] = {
                name: value
                for name, value in service.figures.items()
                if type(value) is int and value and is_incident(name)
            }
        trainer = self.trainer = next((s.figures for s in services if s.kind == "trainer"), {})
        self.tinker_api = str(trainer.get("tinker_api") or self.tinker_api)
        # what the rollouts act with: it never goes back, also while a trainer restarts; a malformed weights
        # record (ValueError) is the trainer's to replace
        with contextlib.suppress(ValueError):
            self._policy_version = published_version(self.client, self.run) or self._policy_version
        # a trainer whose policy is not published to rollouts (the Atropos loop's LM) reports its own
        self._policy_version = max(self._policy_version, int(trainer.get("policy_version") or 0))
        steps = stats.get("env_steps", 0)
        row = {
            "env_steps": steps,
            "wall_time_s": round(self.wall_offset_s + now - self.start, 3),
            "time": round(time.time(), 3),  # unix time: lines the rows up with logs and outside events
            "env_steps_per_s": round(self.rate.rate(now, steps), 1),
            "episodes": stats.get("episodes", 0),
            "episode_return_mean": (sum(e["return"] for e in episodes) / len(episodes)) if episodes else None,
            "policy_version": self._policy_version,
            "trainer_busy": round(float(trainer["busy_fraction"]), 3) if "busy_fraction" in trainer else None,
            "policy_lag_mean": float(trainer.get("policy_lag_mean", 0.0)),
            # the latest periodic evaluation (trainer.evaluation), None before one
            "eval_return_mean": float(trainer["eval_return_mean"])
            if trainer.get("eval_policy_version")
            else None,
            # {lag: chunks} of the trainer's latest 200 (registry figures come as JSON: keys are strings)
            "policy_lag_counts": {
                int(k): int(v) for k, v in (trainer.get("policy_lag_counts") or {}).items()
            },
            # the latest update's figures (PPO's losses; SAC's also gradient_steps, utd_ratio, replay_size)
            "losses": {k: float(v) for k, v in (trainer.get("losses") or {}).items()},
            "chunks_written": stats.get("chunks_written", 0),
            "chunks_rejected_stale": stats.get("chunks_rejected_stale", 0),
            "chunks_dropped_backpressure": stats.get("chunks_dropped_backpressure", 0),
            "chunks_queued": queued_chunks(self.client, self.run),
            "counters": stats,  # every run counter, as Redis holds it: what a resumed run starts from
        }
        self.counters = stats
        return row

    def incidents(self) -> dict[str, int]:
        """Every counter of something refused, skipped, lost or failed, by name: the run's (Redis) and each
        service incarnation's (its registry figures, added up), a run counter where both count it."""
        counts = {name: n for name, n in self.counters.items() if n and is_incident(name)}
        from_services: dict[str, int] = {}
        for figures in self.service_incidents.values():
            for name, n in figures.items():
                from_services[name] = from_services.get(name, 0) + n
        return {**from_services, **counts}
