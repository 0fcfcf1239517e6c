"""The Tinker API beside the trainer's gRPC port: its HTTP server and its worker, as two threads of the trainer
process, with the API keys it accepts."""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.environment.envs import env_maker
from tinker_atropos.errors import FatalError
from tinker_atropos.frontends.http import BackgroundServer
from tinker_atropos.frontends.tinker import base_models
from tinker_atropos.frontends.tinker.app import build_app
from tinker_atropos.frontends.tinker.store import Store
from tinker_atropos.frontends.tinker.worker import Worker
from tinker_atropos.security import insecure, read_keys

log = logging.getLogger(__name__)


def api_keys(config: Config, run_dir: Path) -> tuple[list[str], Path | None]:
    """The allowed keys and the file they come from; without ``api_keys_file``, a fresh key written (0600) to
    the run folder on first use; none under ``--insecure`` without a file. FatalError for a file that is missing
    or holds a key the SDK would refuse."""
    configured = config.trainer.tinker.api_keys_file
    if configured is None and insecure():
        return [], None
    path = Path(configured) if configured else run_dir / "tinker_api_keys"
    if configured is None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(f"tml-{secrets.token_urlsafe(32)}\n")
    keys = read_keys(path, "trainer.tinker.api_keys_file")
    for number, key in enumerate(keys, 1):
        if not key.startswith("tml-") or len(key) < 20:
            raise FatalError(f"{path}: key {number} must start with 'tml-' and be at least 20 characters long "
                             "(the tinker SDK refuses other keys)")  # fmt: skip
    return keys, path


def _run_env_action_space(config: Config) -> object | None:
    try:
        env = env_maker(config.env.id)(**config.env.kwargs)
    except Exception as error:  # an env this process cannot build: its policy is simply not listed
        log.warning("cannot build %s here (%s); its control policy is not listed", config.env.id, error)
        return None
    try:
        return env.action_space
    finally:
        env.close()


class TinkerAPI:
    def __init__(self, config: Config, client: redis.Redis, run_dir: Path, device: torch.device) -> None:
        section = config.trainer.tinker
        keys, self.keys_file = api_keys(config, run_dir)
        checkpoints = Path(section.checkpoint_dir) if section.checkpoint_dir else run_dir / "tinker"
        store = Store(client, config.run.name, section.future_ttl_s)
        self.worker = Worker(store, client, config, checkpoints, device)
        capabilities = base_models.capabilities(config.env.id, _run_env_action_space(config))
        app = build_app(store, self.worker, keys, capabilities, section.long_poll_s,
                        int(section.max_request_mb * 2**20), section.max_request_tokens)  # fmt: skip
        self.unauthenticated = app.state.api.unauthenticated
        self.http = BackgroundServer(app, section.host, section.port, "Tinker API")
        self.worker_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.http.url

    def events(self) -> dict[str, int]:
        """What the trainer's status shows as ``tinker_events``: requests refused without a key, sessions that
        stopped heart-beating and the models they held."""
        return {"requests_unauthenticated": self.unauthenticated.total(), **self.worker.expiry.expired}

    def start(self, stop: threading.Event) -> None:
        self.worker_thread = threading.Thread(
            target=self.worker.run, args=(stop,), name="tinker-worker", daemon=True
        )
        self.worker_thread.start()
        self.http.start(stop)
        if self.keys_file is None:
            log.warning(
                "Tinker API at %s WITHOUT API keys (--insecure): anyone who reaches it can use it", self.url
            )
        else:
            log.info("Tinker API at %s (keys in %s)", self.url, self.keys_file)

    def close(self) -> None:
        self.http.close()
        self.worker.stopping.set()  # a sample in progress stops at its next token, to run again after a restart
        self.worker.wake.set()
        if self.worker_thread is not None:
            self.worker_thread.join(timeout=15)
