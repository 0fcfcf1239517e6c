"""A trainer serving only the Tinker API (``trainer.experience_loop: false``) over an embedded Valkey, started as
a user starts one, for the benchmarks that drive it through the tinker SDK."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tinker_atropos.processes import child_preexec, free_port
from tinker_atropos.state.embedded import EmbeddedValkey

# the AdamParams every SDK benchmark steps with
ADAM = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


@dataclass(frozen=True)
class Served:
    url: str
    key: str
    pid: int  # the trainer's
    redis_url: str = ""  # its Valkey's


@contextlib.contextmanager
def serving(
    work: Path,
    tinker: dict[str, Any] | None = None,
    env_id: str = "Pendulum-v1",
    key: str = "tml-bench-0123456789abcdef",
    trainer: dict[str, Any] | None = None,
) -> Iterator[Served]:
    """The trainer, its log and config in ``work``; ``tinker``: settings of ``trainer.tinker`` besides the port
    and the key file; ``trainer``: other settings of ``trainer``. Stopped on leaving."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "keys").write_text(key + "\n")
    port = free_port()
    env = {"id": env_id, **({"backend": "mujoco"} if env_id.startswith("Humanoid") else {})}
    config = {
        "run": {"name": "bench-tinker"},
        "env": env,
        "trainer": {
            **(trainer or {}),
            "experience_loop": False,
            "tinker": {"enabled": True, "port": port, "api_keys_file": str(work / "keys"), **(tinker or {})},
        },
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    valkey = EmbeddedValkey(work / "valkey")
    log_path = work / "trainer.log"
    log = open(log_path, "w")  # noqa: SIM115 - inherited by the child
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinker_atropos",
            "trainer",
            "--config",
            str(work / "run.yaml"),
            "--redis-url",
            valkey.url,
            "--port",
            str(free_port()),
            "--run-dir",
            str(work / "run"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=child_preexec,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while "Tinker API at" not in log_path.read_text():
            if time.monotonic() > deadline or trainer.poll() is not None:
                raise RuntimeError(f"the trainer did not serve the Tinker API:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield Served(f"http://127.0.0.1:{port}", key, trainer.pid, valkey.url)
    finally:
        trainer.terminate()
        trainer.wait(timeout=30)
        log.close()
        valkey.stop()
