"""The services ``up`` starts, each its own OS process (a ``supervisor.Child``): the env services, the rollouts, the
trainer, the evaluation env service, the Atropos trajectory API and the Atropos environment programs; and their
stop, producers first."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from tinker_atropos.config import Config
from tinker_atropos.launcher.client_files import ATROPOS_CONFIG
from tinker_atropos.launcher.supervisor import Child

STOP_TIMEOUT_S = 10.0

_LISTENERS: list[socket.socket] = []  # sockets up holds for its children's lifetime


def service_children(
    config: Config, config_path: Path, redis_url: str, run_dir: Path, metrics: bool = False
) -> list[Child]:
    """Every service of the run as a child of ``up``; the Redis URL goes by environment, since a URL with a
    password on a command line is there for any user's ``ps`` to read."""
    common = ["--config", str(config_path), "--host", "127.0.0.1", "--port", "0"]
    common += ["--metrics-port", "0"] if metrics else []
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = [("env", f"env-{i}") for i in range(config.env.services)]
    names += [("rollout", f"rollout-{i}") for i in range(config.rollout.replicas)]
    names.append(("trainer", "trainer"))
    evaluation = config.trainer.evaluation
    if evaluation.every_updates:
        names.append(("env", "env-eval"))
    if config.atropos.enabled:
        names.append(("atropos-api", "atropos-api"))
    children = []
    for kind, name in names:
        extra = ["--run-dir", str(run_dir)] if kind == "trainer" else []
        if name == "env-eval":
            extra = ["--role", "eval", "--instances", str(evaluation.instances)]
        if kind == "atropos-api":
            listener = socket.create_server((config.atropos.host, config.atropos.port))
            _LISTENERS.append(listener)  # held by up for the run: a restarted API serves the same socket
            extra = ["--http-fd", str(listener.fileno())]
        child = Child(name, [kind, *common, "--name", name, *extra], logs / f"{name}.log")
        if kind == "atropos-api":
            child.pass_fds = (listener.fileno(),)
        child.environment["TA_REDIS_URL"] = redis_url
        children.append(child)
    return children + atropos_environments(config, logs, run_dir)  # last: the trajectory API starts first


def atropos_environments(config: Config, logs: Path, run_dir: Path) -> list[Child]:
    """The Atropos environment programs of ``atropos.environments``, their placeholders filled in."""
    trainer = config.trainer.atropos
    values = {
        "python": sys.executable,
        "api_url": f"http://{config.atropos.host}:{config.atropos.port}",
        "inference_url": f"http://{trainer.inference_host}:{trainer.inference_port}/v1",
        "atropos_config": str(run_dir / ATROPOS_CONFIG),
    }
    children = []
    for i, argv in enumerate(config.atropos.environments):
        filled = [arg.format(**values) for arg in argv]
        children.append(
            Child(f"atropos-env-{i}", filled[1:], logs / f"atropos-env-{i}.log", program=filled[:1])
        )
    return children


def stop_children(children: list[Child]) -> None:
    """The rollouts (and Atropos environments) first, then the rest: every chunk they write is written before the
    trainer stops, so its last look (TensorBoard, counters) sees the whole run."""
    producers = [c for c in children if c.name.startswith(("rollout-", "atropos-env-"))]
    for group in (producers, [c for c in children if c not in producers]):
        for child in group:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in group:
            child.wait(deadline)
