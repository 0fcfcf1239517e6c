"""What the Atropos tests send: a trainer's registration and scored groups whose content is unique to a seed, and
the key our API asks of a run whose token is ``TOKEN``; and atroposlib's own run-api with our trainer process
beside it, an environment registered."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.processes import Processes, wait_for
from tinker_atropos.frontends.http import run_key
from tinker_atropos.processes import child_preexec, free_port

TOKEN = "atropos-test-token"  # the run's token our API services get (TA_TOKEN): the key is derived from it
KEY = run_key("atropos-api", TOKEN)
HEADERS = {"X-API-Key": KEY}


def registration(batch_size: int, max_token_len: int = 64) -> dict[str, Any]:
    """A trainer's /register body."""
    return {
        "wandb_group": "g",
        "wandb_project": "p",
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "checkpoint_dir": "",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 10,
    }


def env_registration(group_size: int, name: str = "toy", **extra: Any) -> dict[str, Any]:
    """An environment's /register-env body."""
    return {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": group_size, **extra}


def scored_group(env_id: int | None, size: int, seed: int, **extra: Any) -> dict[str, Any]:
    """A scored group of ``size`` sequences; its first token is ``seed``, so served batches can be counted."""
    tokens = [[seed, k, *range(k + 3)] for k in range(size)]
    return {
        "tokens": tokens,
        "masks": [[-100] + t[1:] for t in tokens],
        "scores": [float((seed + k) % 3) for k in range(size)],
        "env_id": env_id,
        **extra,
    }


def tiny_lm_group(seed: int, tokens: tuple[int, ...] = (97, 98)) -> dict[str, Any]:
    """A group of 4 sequences for environment 0, unique to ``seed``, that the tiny LM reads: BOS, ``seed``,
    the sequence's number, then ``tokens``; masked but for its last tokens, scored 0 and 1 in turn."""
    rows = [[256, seed, k, *tokens] for k in range(4)]
    return {
        "tokens": rows,
        "masks": [[-100, -100, *r[2:]] for r in rows],
        "scores": [0.0, 1.0, 0.0, 1.0],
        "env_id": 0,
    }


@contextlib.contextmanager
def reference_api(log: Path) -> Iterator[str]:
    """atroposlib's own run-api (``atroposlib.cli.run_api``) on a free local port, its output in ``log``:
    its URL, until the block ends."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def start_atropos_trainer(
    processes: Processes,
    redis_url: str,
    run_dir: Path,
    run: str,
    trainer: dict[str, Any] | None = None,
    **atropos: Any,
) -> subprocess.Popen:
    """A trainer process of run ``run`` in ``run_dir`` running the Atropos loop alone (``atropos``: its
    settings; ``trainer``: other trainer settings), its config written beside the folder (``run.yaml``).
    The run token (``TA_TOKEN``, the inference endpoint's key is derived from it) is the caller's to set."""
    config = {
        "run": {"name": run},
        "env": {"services": 0},
        "rollout": {"replicas": 0},
        "trainer": {**(trainer or {}), "experience_loop": False, "atropos": {"enabled": True, **atropos}},
    }
    path = run_dir.parent / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["--config", str(path), "--redis-url", redis_url, "--port", "0", "--run-dir", str(run_dir)]
    return processes.start("trainer", *args, name="trainer")


def join_as_env(
    api: httpx.Client, processes: Processes, trainer: subprocess.Popen, batch_size: int, **env: Any
) -> None:
    """Once ``trainer`` (started as "trainer" by ``processes``: its log shown if it exits first) registered
    with the run-api at ``api`` (its ``batch_size`` in /info), one /batch as a trainer pulls (the reference
    lets environments register only after it), then an environment of groups of 4 registered (``env``: more
    of its /register-env fields)."""

    def registered() -> bool:
        assert trainer.poll() is None, processes.log("trainer")[-3000:]
        try:
            return api.get("/info").json()["batch_size"] == batch_size
        except (httpx.HTTPError, ValueError):
            return False

    wait_for(registered, 120, "the trainer's registration with run-api")
    api.get("/batch")
    api.post("/register-env", json=env_registration(4, **env)).raise_for_status()


def memory_kb(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of process ``pid``, in kB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line.split()[1] for line in lines if line.startswith(f"{field}:")))


def reset_peak(pid: int) -> None:
    """Resets process ``pid``'s ``VmHWM`` to its RSS now, so the next reading is the peak of what followed."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def chunked(mib: int) -> Iterator[bytes]:
    """A body of ``mib`` MiB of spaces, sent chunked (no Content-Length to refuse it by)."""
    for _ in range(mib):
        yield b" " * (1 << 20)


class Poller:
    """Asks ``url`` over and over in a thread while a test sends hostile bodies; ``slowest`` is the longest an
    answer took (a request that failed counts as its timeout), ``took`` how long each one took."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float = 5.0) -> None:
        self.url, self.headers, self.timeout_s = url, headers, timeout_s
        self.slowest, self.answers = 0.0, 0
        self.took: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(headers=self.headers, timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    client.get(self.url).raise_for_status()
                    self.answers += 1
                except httpx.HTTPError:
                    pass
                self.took.append(time.monotonic() - started)
                self.slowest = max(self.slowest, self.took[-1])
                self._stop.wait(0.02)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)
