"""Where the parts that every node of a run shares saturate: ``python -m bench capacity``.

Against a private Valkey loaded with ``deploy/redis-acl.conf`` (each process logs in as its own service's user,
records signed with a run token, as in a secured run), N load generators behave as N rollouts do in a run: they
append Humanoid chunks (8 instances x 64 steps of Humanoid-v5's 348 observations and 17 actions, signed), pausing
while the stream holds half its bound (``rollout.flow_control: pause``), beat their registry entry every second,
refresh their membership and four session-slot leases three times per lease TTL, read the published weights'
version and the members four times a second and SCAN the registry twice a second, through the product's own
``ExperienceWriter``, ``Registration`` and ``Leases``. One reader consumes as the trainer does
(``ExperienceReader.take``, then ``decode_trajectory``). N is raised until the chunks consumed per second stop
growing.

Beside chunks/s, MB/s and env steps/s, Valkey's own CPU time per chunk (``INFO cpu``, its main thread) is what a
bigger machine cannot remove: one Valkey main thread can take at most 1 / that many chunks a second, whatever the
number of cores around it; ``INFO commandstats`` says which command costs it. The weights phase publishes a record
of each size of ``weights_mb`` and times M rollouts fetching it at once, as they do after every update.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from tests.support.acl_valkey import AclValkey
from tinker_atropos.frontends.atropos.store import TrajectoryStore, encode
from tinker_atropos.protocol.trajectory import (
    Trajectory,
    TrajectorySpec,
    decode_trajectory,
    encode_trajectory,
)
from tinker_atropos.security import derive_key
from tinker_atropos.state import keys
from tinker_atropos.state.experience import ExperienceReader, ExperienceWriter, read_stats
from tinker_atropos.state.leases import Leases
from tinker_atropos.state.registry import Registration, live_services
from tinker_atropos.state.weights import fetch_weights, publish_weights, published_version

RUN = "capacity"
TOKEN = "capacity-bench-token"  # the run's token: the signing keys derive from it
HUMANOID = TrajectorySpec((348,), (17,), None)
BOUND = 64  # rollout.max_queued_chunks, the default
LEASE_TTL_S, UNITS = 3.0, 4  # rollout.lease_ttl_s; session slots each rollout holds


@dataclass(frozen=True)
class CapacityOptions:
    rollouts: tuple[int, ...] = (1, 2, 4, 8)
    fetchers: tuple[int, ...] = (1, 4, 16, 48)
    window_s: float = 20.0
    instances: int = 8  # per chunk
    steps: int = 64  # per chunk (rollout.chunk_length)
    # Humanoid's 64x64 actor-critic (55 k float32 with its normaliser, as .npz), and a record 22 x its size
    weights_mb: tuple[float, ...] = (0.225, 5.0)
    # the learning phase (learner_capacity.py): (learners, threads each) on each update shape
    learners: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1))
    learning_shapes: tuple[str, ...] = ("humanoid-16core", "wide-256")


def humanoid_chunk(instances: int, steps: int, seed: int = 0) -> bytes:
    """One record of the experience stream as a Humanoid rollout writes it (random values of the real shapes)."""
    rng = np.random.default_rng(seed)
    obs, act = HUMANOID.obs_shape, HUMANOID.action_shape
    trajectory = Trajectory(
        policy_version=1,
        observations=rng.standard_normal((steps, instances, *obs), dtype=np.float32),
        actions=rng.standard_normal((steps, instances, *act), dtype=np.float32),
        log_probs=rng.standard_normal((steps, instances), dtype=np.float32),
        rewards=rng.standard_normal((steps, instances), dtype=np.float32),
        terminated=np.zeros((steps, instances), bool),
        truncated=np.zeros((steps, instances), bool),
        bootstrap_observations=rng.standard_normal((instances, *obs), dtype=np.float32),
        truncated_observations=np.zeros((0, *obs), np.float32),
        values=rng.standard_normal((steps, instances), dtype=np.float32),
        truncation_values=np.zeros((steps, instances), np.float32),
        bootstrap_values=rng.standard_normal(instances, dtype=np.float32),
        rollout_incarnation=uuid.uuid4().hex,
        sequence=1,
    )
    return encode_trajectory(trajectory)


@dataclass(frozen=True)
class Window:
    """The measured window, set once every load process has started: its processes' imports and connections
    take seconds on 2 cores, longer with more of them, and must not eat into it."""

    gate: Any  # a Barrier of the load processes and the parent, passed twice: all ready, then the window set
    since: Any  # a shared double: the window's start (time.time()), 2 s of warm-up after the gate
    seconds: float

    def open(self) -> tuple[float, float]:
        """In a load process: (since, until), once every process is ready."""
        self.gate.wait(timeout=120)
        self.gate.wait(timeout=120)
        return self.since.value, self.since.value + self.seconds

    def set(self) -> tuple[float, float]:
        """In the parent: wait for every load process, then start the window."""
        self.gate.wait(timeout=120)
        self.since.value = time.time() + 2.0
        self.gate.wait(timeout=120)
        return self.since.value, self.since.value + self.seconds


def rollout_load(url: str, window: Window, record: bytes, steps: int, results: Any) -> None:
    """One rollout's Redis traffic until the window ends: appends, heartbeats, leases, discovery; those in the
    window counted."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    incarnation = uuid.uuid4().hex
    writer = ExperienceWriter(client, RUN, BOUND, derive_key(TOKEN, "experience"))
    leases = Leases(client, RUN, incarnation, "load", LEASE_TTL_S)
    units = [f"env-{incarnation}-{i}" for i in range(UNITS)]
    for unit in units:
        leases.claim(unit)
    beat = Registration(client, RUN, "rollout", f"load:{incarnation}", incarnation, dict, 1.0, 5.0).start()
    appended = paused = 0
    cpu = None
    since, until = window.open()
    next_poll = next_scan = next_refresh = 0.0
    while (now := time.time()) < until:
        if cpu is None and now >= since:
            cpu = time.process_time()
        if now >= next_poll:  # PolicySource.refresh and the members, each balance round
            next_poll = now + 0.25
            published_version(client, RUN)
            leases.members()
        if now >= next_scan:
            next_scan = now + 0.5
            live_services(client, RUN, "env")
        if now >= next_refresh:
            next_refresh = now + LEASE_TTL_S / 3
            leases.refresh(units)
        if writer.queued() >= BOUND // 2:  # flow control: the trainer has a batch waiting
            paused += now >= since
            time.sleep(0.005)
            continue
        writer.append(record, steps)
        appended += now >= since
    beat.close()
    results.put({"appended": appended, "paused": paused, "cpu_s": time.process_time() - (cpu or 0.0)})


def trainer_load(url: str, window: Window, results: Any) -> None:
    """The trainer's side: take the oldest chunks, check their signature, decode them (those in the window
    counted)."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    reader = ExperienceReader(client, RUN, derive_key(TOKEN, "experience"))
    since, until = window.open()
    chunks = steps = size = rejected = 0
    take_s = decode_s = 0.0
    cpu = None
    while (now := time.time()) < until:
        started = time.perf_counter()
        records = reader.take(count=8, block_ms=100)
        taken = time.perf_counter()
        if now < since:
            continue
        cpu = time.process_time() if cpu is None else cpu
        for record in records:
            if not isinstance(record, bytes):  # not signed with the run's key: counted, as the trainer does
                rejected += 1
                continue
            steps += decode_trajectory(record, HUMANOID).num_steps
            size += len(record)
        chunks += len(records)
        take_s, decode_s = take_s + taken - started, decode_s + time.perf_counter() - taken
    results.put(
        {
            "chunks": chunks,
            "steps": steps,
            "bytes": size,
            "rejected": rejected,
            "take_s": take_s,
            "decode_s": decode_s,
            "cpu_s": time.process_time() - (cpu or 0.0),
        }
    )


def valkey_cpu_s(admin: redis.Redis) -> float:
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def command_costs(admin: redis.Redis) -> dict[str, dict[str, float]]:
    """Per command: calls and microseconds of Valkey's time (since the last CONFIG RESETSTAT)."""
    stats = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): {"calls": s["calls"], "usec": s["usec"]} for name, s in stats.items()
    }


def experience_point(server: AclValkey, n: int, options: CapacityOptions, record: bytes) -> dict[str, Any]:
    """N rollouts and one trainer for ``window_s``: what went through, and what it cost Valkey."""
    server.admin.delete(keys.experience(RUN), keys.stats(RUN))
    context = mp.get_context("spawn")  # no Redis connection or lock of this process crosses into the children
    results = context.Queue()
    window = Window(context.Barrier(n + 2), context.Value("d", 0.0), options.window_s)
    steps = options.instances * options.steps
    children = [context.Process(target=trainer_load, args=(server.url("trainer"), window, results))]
    children += [
        context.Process(target=rollout_load, args=(server.url("rollout"), window, record, steps, results))
        for _ in range(n)
    ]
    for child in children:
        child.start()
    since, until = window.set()
    time.sleep(max(0.0, since - time.time()))
    cpu = valkey_cpu_s(server.admin)
    server.admin.config_resetstat()
    time.sleep(max(0.0, until - time.time()))
    cpu = valkey_cpu_s(server.admin) - cpu
    try:
        reports = [results.get(timeout=30) for _ in children]
    except queue.Empty:
        failed = [child.exitcode for child in children]
        raise RuntimeError(
            f"a load process did not report (exit codes {failed}): see its traceback above"
        ) from None
    for child in children:
        child.join(10)
    trainer = next(r for r in reports if "chunks" in r)
    stats = read_stats(server.admin, RUN)
    costs = command_costs(server.admin)
    seconds = options.window_s
    chunks_s = trainer["chunks"] / seconds
    return {
        "rollouts": n,
        "chunks_s": chunks_s,
        "env_steps_s": trainer["steps"] / seconds,
        "mb_s": trainer["bytes"] / seconds / 1e6,
        "valkey_cpu": cpu / seconds,
        "valkey_cpu_ms_per_chunk": 1000 * cpu / max(1.0, chunks_s * seconds),
        "trainer_take_us_per_step": 1e6 * trainer["take_s"] / max(1, trainer["steps"]),
        "trainer_decode_us_per_step": 1e6 * trainer["decode_s"] / max(1, trainer["steps"]),
        "rollout_pauses": sum(r.get("paused", 0) for r in reports),
        # each side's share of a core over the window: with Valkey's, what the machine's cores went to
        "rollouts_cpu": sum(r["cpu_s"] for r in reports if "appended" in r) / seconds,
        "trainer_cpu": trainer["cpu_s"] / seconds,
        "dropped": stats.get("chunks_dropped_backpressure", 0),
        "rejected": trainer["rejected"],
        "top_commands": dict(sorted(costs.items(), key=lambda kv: -kv[1]["usec"])[:6]),
    }


def _fetch(client: redis.Redis, key: bytes, fetched: list[int | None]) -> None:
    published = fetch_weights(client, RUN, key)
    fetched.append(published.version if published is not None else None)


def weights_point(server: AclValkey, m: int, blob: bytes, rounds: int = 5) -> dict[str, Any]:
    """Publish ``rounds`` versions; after each, M rollouts fetch it at once: the time until the last has it."""
    key = derive_key(TOKEN, "weights")
    publisher = server.client("trainer")
    fetchers = [server.client("rollout") for _ in range(m)]
    publish_s, all_fetched_s, current = [], [], 0
    for version in range(1, rounds + 1):
        started = time.perf_counter()
        version = publish_weights(publisher, RUN, version + 1000 * m, blob, {"bench": True}, key)
        published = time.perf_counter()
        fetched: list[int | None] = []
        threads = [threading.Thread(target=_fetch, args=(c, key, fetched)) for c in fetchers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        publish_s.append(published - started)
        all_fetched_s.append(time.perf_counter() - published)
        current += fetched.count(version)
    for client in (publisher, *fetchers):
        client.close()
    return {
        "fetchers": m,
        "fetched_current": current / (m * rounds),
        "publish_ms": 1000 * float(np.median(publish_s)),
        "all_fetched_ms": 1000 * float(np.median(all_fetched_s)),
        "fetch_mb_s": m * len(blob) / 1e6 / float(np.median(all_fetched_s)),
    }


def llm_group(n: int, size: int = 8, tokens: int = 64) -> dict[str, Any]:
    """A scored group as an Atropos environment posts it for SmolLM2's arithmetic: ``size`` answers of ``tokens``
    tokens with their inference log-probs (unique to ``n``: no post is a retry)."""
    sequences = [[n, k, *range(tokens - 2)] for k in range(size)]
    return {
        "tokens": sequences,
        "masks": [[-100] * 16 + t[16:] for t in sequences],
        "scores": [float(k % 2) for k in range(size)],
        "env_id": 0,
        "inference_logprobs": [[1.0] * 16 + [-0.5] * (tokens - 16) for _ in sequences],
    }


def llm_point(server: AclValkey, seconds: float, batch_groups: int = 4) -> dict[str, Any]:
    """The Atropos path's Redis side, flat out: the API process's store queues posted groups and serves the
    trainer a batch of ``batch_groups`` groups after each ``batch_groups`` posts (one process owns that state:
    its rate is this loop's)."""
    client = server.client("atropos_api")
    store = TrajectoryStore(client, RUN, max_queue_sequences=1 << 20, dedup_window=1000)
    store.register(
        {
            "batch_size": 8 * batch_groups,
            "max_token_len": 64,
            "starting_step": 0,
            "num_steps": 0,
            "wandb_group": "",
            "wandb_project": "",
            "checkpoint_dir": "",
            "save_checkpoint_interval": 0,
        }
    )
    store.batch()  # the trainer's first call starts the run: environments may register
    store.register_env({"max_token_length": 64, "desired_name": "arithmetic", "weight": 1.0, "group_size": 8})
    groups = [llm_group(n) for n in range(batch_groups)]
    size = sum(len(encode(g)) for g in groups) / len(groups)
    posted = served = 0
    cpu, started = valkey_cpu_s(server.admin), time.perf_counter()
    while time.perf_counter() - started < seconds:
        for n, group in enumerate(groups):
            group["tokens"][0][0] = posted + n  # a new body: not a retried post
        store.post(groups)
        posted += len(groups)
        served += len(store.batch()["batch"] or ())
    elapsed = time.perf_counter() - started
    cpu = valkey_cpu_s(server.admin) - cpu
    client.close()
    return {
        "groups_s": served / elapsed,
        "group_kb": size / 1e3,
        "valkey_cpu": cpu / elapsed,
        "valkey_cpu_ms_per_group": 1000 * cpu / max(1, served),
    }


def saturated(points: list[dict[str, Any]]) -> int | None:
    """The first rollout count that carried less than 10 % more than the count before it."""
    for before, point in zip(points, points[1:], strict=False):
        if point["chunks_s"] < 1.1 * before["chunks_s"]:
            return point["rollouts"]
    return None


def run_capacity(options: CapacityOptions, out: Path) -> dict[str, Any]:
    """Both phases against one Valkey; ``capacity.json`` written to ``out``."""
    record = humanoid_chunk(options.instances, options.steps)
    with tempfile.TemporaryDirectory() as directory:
        server = AclValkey(Path(directory) / "valkey")
        try:
            experience = [experience_point(server, n, options, record) for n in options.rollouts]
            weights = [
                {"mb": mb, **weights_point(server, m, np.random.default_rng(1).bytes(int(mb * 1e6)))}
                for mb in options.weights_mb
                for m in options.fetchers
            ]
            llm = llm_point(server, options.window_s)
            denied = server.denials()
        finally:
            server.stop()
    # imported here: the load processes import this module, and torch's learners would slow their start
    from bench.learner_capacity import learning_points

    learning = learning_points(options.learning_shapes, options.learners, options.window_s)
    result = {
        "conditions": {
            "chunk_bytes": len(record),
            "steps_per_chunk": options.instances * options.steps,
            "window_s": options.window_s,
            "weights_mb": list(options.weights_mb),
            "date": time.strftime("%Y-%m-%d"),
        },
        "experience": experience,
        "saturated_at_rollouts": saturated(experience),
        "weights": weights,
        "llm": llm,
        "learning": learning,
        "acl_denials": denied,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    """The experience and weights figures as Markdown tables."""
    rows = [
        "| rollouts | chunks/s | env steps/s | MB/s | Valkey CPU | Valkey ms/chunk | trainer decode µs/step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["experience"]:
        rows.append(
            f"| {p['rollouts']} | {p['chunks_s']:.1f} | {p['env_steps_s']:,.0f} | {p['mb_s']:.1f} | "
            f"{100 * p['valkey_cpu']:.0f} % | {p['valkey_cpu_ms_per_chunk']:.2f} | "
            f"{p['trainer_decode_us_per_step']:.2f} |"
        )
    rows += [
        "",
        "| record MB | rollouts fetching | publish ms | all fetched ms | fetched MB/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for w in result["weights"]:
        rows.append(
            f"| {w['mb']:g} | {w['fetchers']} | {w['publish_ms']:.1f} | {w['all_fetched_ms']:.1f} | {w['fetch_mb_s']:.0f} |"
        )
    llm = result["llm"]
    rows += [
        "",
        f"Atropos store, flat out: {llm['groups_s']:.0f} groups/s of {llm['group_kb']:.1f} kB, Valkey "
        f"{100 * llm['valkey_cpu']:.0f} % busy, {llm['valkey_cpu_ms_per_group']:.3f} ms a group",
    ]
    rows += [
        "",
        "| update | learners x threads | env steps/s learned | x the first | update s | in all-reduces | "
        "all-reduce ms a step | dealing out |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["learning"]:
        rows.append(
            f"| {p['shape']} | {p['learners']} x {p['threads']} | {p['env_steps_s']:,.0f} | {p['x_first']:.2f} | "
            f"{p['update_s']:.3f} | {100 * p['collectives_share']:.0f} % | {p['allreduce_ms_per_step']:.2f} | "
            f"{100 * p['dealing_share']:.0f} % |"
        )
    return "\n".join(rows)
