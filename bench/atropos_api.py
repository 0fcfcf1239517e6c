"""Groups per second the Atropos trajectory API accepts and serves: ours (state in Redis) against atroposlib
0.4.0's reference server (process memory), in the same run, alternating.

Each round starts a fresh server, registers a trainer and one environment, then for ``seconds`` several posting
processes send distinct scored groups (``group_size`` sequences of ``tokens`` tokens, as atroposlib's environments
post them: JSON, gzip above 1 KB) as fast as they are answered, while one trainer pulls ``/batch`` as fast as it
is answered. Accepted: groups answered 200. Served: groups inside the batches the trainer received.

The stall soak (``stall_seconds``): the same posters for that long while the trainer pulls nothing (the
reference's out-of-memory case, atropos issue #459), the server's resident memory sampled every second; ours with
its queue bound (``stall_bound`` sequences), the reference with none.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from rich.console import Console
from rich.table import Table

from bench import report
from tinker_atropos.frontends.http import run_key
from tinker_atropos.processes import child_preexec, free_port
from tinker_atropos.state.embedded import EmbeddedValkey

SERVERS = ("tinker_atropos", "reference")
TOKEN = "bench-atropos-token"
KEY_HEADER = {"X-API-Key": run_key("atropos-api", TOKEN)}  # what ours asks; the reference ignores it


@dataclass(frozen=True)
class Load:
    seconds: float = 10.0
    posters: int = 2
    group_size: int = 8
    tokens: int = 256
    batch_size: int = 64
    rounds: int = 2
    stall_seconds: float = 60.0
    stall_bound: int = 16_384


def _group(poster: int, n: int, load: Load) -> bytes:
    tokens = [[poster, n, k, *range(load.tokens - 3)] for k in range(load.group_size)]
    group = {
        "tokens": tokens,
        "masks": [[-100] * 16 + t[16:] for t in tokens],
        "scores": [float(k % 2) for k in range(load.group_size)],
        "env_id": 0,
        "inference_logprobs": [[1.0] * 16 + [-0.5] * (load.tokens - 16) for _ in tokens],
    }
    return gzip.compress(json.dumps(group).encode())


def _poster(url: str, poster: int, load: Load, deadline: float, out: Any) -> None:
    """Posts until ``deadline``; puts (accepted, refused, latencies in ms) on ``out``."""
    accepted = refused = 0
    latencies = []
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with httpx.Client(base_url=url, timeout=30, headers=KEY_HEADER) as client:
        n = 0
        while time.monotonic() < deadline:
            body = _group(poster, n, load)
            n += 1
            start = time.perf_counter()
            response = client.post("/scored_data", content=body, headers=headers)
            latencies.append((time.perf_counter() - start) * 1000)
            if response.status_code == 200:
                accepted += 1
            else:
                refused += 1
    out.put((accepted, refused, latencies))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def measure(url: str, load: Load, pid: int, seconds: float, pull: bool = True) -> dict[str, Any]:
    """``seconds`` of posting, the trainer pulling (or not); the server's RSS sampled about every second."""
    with httpx.Client(base_url=url, timeout=30, headers=KEY_HEADER) as client:
        client.post(
            "/register",
            json={
                "wandb_group": "bench",
                "wandb_project": "bench",
                "batch_size": load.batch_size,
                "max_token_len": load.tokens + 1,
                "checkpoint_dir": "",
                "starting_step": 0,
                "save_checkpoint_interval": 0,
                "num_steps": 10**6,
            },
        ).raise_for_status()
        client.get("/batch").raise_for_status()
        client.post(
            "/register-env",
            json={
                "max_token_length": load.tokens + 1,
                "desired_name": "bench",
                "weight": 1.0,
                "group_size": load.group_size,
            },
        ).raise_for_status()
        start = time.monotonic()
        deadline = start + seconds
        spawn = multiprocessing.get_context("spawn")
        results = spawn.Queue()
        posters = [
            spawn.Process(target=_poster, args=(url, i, load, deadline, results)) for i in range(load.posters)
        ]
        for p in posters:
            p.start()
        served = 0
        rss: list[tuple[float, float]] = []
        while (now := time.monotonic()) < deadline:
            if not rss or now - start - rss[-1][0] >= 1.0:
                rss.append((round(now - start, 1), round(_rss_mb(pid), 1)))
            batch = client.get("/batch").json().get("batch") if pull else None
            if batch:
                served += len(batch)
            else:
                time.sleep(0.001 if pull else 0.05)
        rss.append((round(time.monotonic() - start, 1), round(_rss_mb(pid), 1)))
        counts = [results.get(timeout=60) for _ in posters]
        for p in posters:
            p.join(timeout=30)
        elapsed = time.monotonic() - start
    latencies = sorted(ms for _, _, lat in counts for ms in lat)
    accepted = sum(a for a, _, _ in counts)
    return {
        "accepted": accepted,
        "accepted_groups_per_s": accepted / elapsed,
        "served_groups_per_s": served / elapsed,
        "refused": sum(r for _, r, _ in counts),
        "post_ms_p50": statistics.median(latencies) if latencies else None,
        "post_ms_p99": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "rss_mb": rss,
    }


def _wait_up(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode}")
        try:
            if httpx.get(url + "/", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not answer within 60 s")


def one_round(server: str, load: Load, work: Path, stall: bool = False) -> dict[str, Any]:
    """A fresh server of ``server``'s kind, measured once (the stall soak when ``stall``)."""
    port = free_port()
    valkey = None
    if server == "reference":
        command = [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(port)]
    else:
        valkey = EmbeddedValkey(work / f"valkey-{port}")
        bound = load.stall_bound if stall else 100_000_000
        config = work / f"atropos-{port}.yaml"
        config.write_text(f"run: {{name: bench}}\natropos: {{port: {port}, max_queue_sequences: {bound}}}\n")
        command = [sys.executable, "-m", "tinker_atropos", "atropos-api", "--config", str(config)]
        command += ["--redis-url", valkey.url, "--port", "0"]
    # ours asks the key of the run's token, as under `up`
    with open(work / f"{server}-{port}.log", "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
            env={**os.environ, "TA_TOKEN": TOKEN},
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url, process)
        if not stall:
            return measure(url, load, process.pid, load.seconds)
        figures = measure(url, load, process.pid, load.stall_seconds, pull=False)
        if valkey is not None:
            with redis.Redis.from_url(valkey.client_url) as r:
                figures["valkey_used_memory_mb"] = round(r.info("memory")["used_memory"] / 2**20, 1)
        return figures
    finally:
        process.terminate()
        process.wait(timeout=30)
        if valkey is not None:
            valkey.stop()


def _growth(rss: list[tuple[float, float]]) -> dict[str, float]:
    """Resident memory after 10 s (start-up and first allocations done) and at the end."""
    at_10 = next((mb for t, mb in rss if t >= 10), rss[-1][1])
    return {"rss_at_10s_mb": at_10, "rss_end_mb": rss[-1][1], "rss_growth_after_10s_mb": rss[-1][1] - at_10}


def run(out: Path, load: Load, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
    with tempfile.TemporaryDirectory(prefix="bench-atropos-") as scratch:
        for r in range(load.rounds):
            for server in SERVERS if r % 2 == 0 else SERVERS[::-1]:  # alternate who goes first
                figures = one_round(server, load, Path(scratch))
                console.print(f"round {r + 1} {server}: {figures}")
                rounds[server].append(figures)
        stalled = {
            server: one_round(server, load, Path(scratch), stall=True)
            for server in SERVERS
            if load.stall_seconds > 0
        }
    summary = {
        s: {k: statistics.mean(r[k] for r in rs) for k in ("accepted_groups_per_s", "served_groups_per_s")}
        for s, rs in rounds.items()
    }
    ours, reference = summary["tinker_atropos"], summary["reference"]
    result = {
        "load": load.__dict__,
        "rounds": rounds,
        "summary": summary,
        "ratios": {k: ours[k] / reference[k] if reference[k] else None for k in ours},
        "stall": {server: {**figures, **_growth(figures["rss_mb"])} for server, figures in stalled.items()},
        "conditions": "fresh server per round, alternating; posters and the trainer on the same machine",
        "machine": report.machine(),
        "packages": report.package_versions(),
    }
    (out / "bench-atropos.json").write_text(json.dumps(result, indent=2) + "\n")
    table = Table(
        title=f"Atropos trajectory API, {load.posters} posters, groups of {load.group_size} x {load.tokens} tokens"
    )
    for column in ("server", "accepted groups/s", "served groups/s"):
        table.add_column(column)
    for server, s in summary.items():
        table.add_row(server, f"{s['accepted_groups_per_s']:.0f}", f"{s['served_groups_per_s']:.0f}")
    console.print(table)
    if stalled:
        table = Table(title=f"Trainer stalled {load.stall_seconds:.0f} s, {load.posters} posters flat out")
        for column in ("server", "groups accepted", "refused", "RSS at 10 s (MB)", "RSS at the end (MB)"):
            table.add_column(column)
        for server, figures in result["stall"].items():
            table.add_row(
                server,
                str(figures["accepted"]),
                str(figures["refused"]),
                f"{figures['rss_at_10s_mb']:.0f}",
                f"{figures['rss_end_mb']:.0f}",
            )
        console.print(table)
    console.print(f"ours / reference: {result['ratios']}; wrote {out / 'bench-atropos.json'}")
    return result
