"""The Tinker API as one of the trainer's drivers: the HTTP app (``http/``) on a server thread, and the engine's
worker (``engine/worker.py``) in the driver's own thread, meeting only at the store."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.environment.envs import env_maker
from tinker_atropos.frontends.http import BackgroundServer
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.state.run_dir import RunFolderOwner
from tinker_atropos.tinker_api import base_models
from tinker_atropos.tinker_api.engine.training_steps import StepLog
from tinker_atropos.tinker_api.engine.worker import Worker
from tinker_atropos.tinker_api.http.app import api_keys, build_app
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.training.driver import Checkpoint

log = logging.getLogger(__name__)


class TinkerAPI:
    """Serves the Tinker API with the API keys it accepts until the trainer stops."""

    def __init__(
        self,
        config: Config,
        client: redis.Redis,
        run_dir: Path,
        device: torch.device,
        owner: RunFolderOwner | None = None,
        training_log: StepLog | None = None,
    ) -> None:
        """``training_log``: where each model's optimizer steps are told (the trainer's TensorBoard log)."""
        section = config.trainer.tinker
        keys, self.keys_file = api_keys(config, run_dir)
        checkpoints = Path(section.checkpoint_dir) if section.checkpoint_dir else run_dir / "tinker"
        store = Store(
            client, config.run.name, checkpoints, section.future_ttl_s, section.ephemeral_weights_ttl_s
        )
        self.worker = Worker(store, client, config, device, owner, training_log)
        configured = base_models.register(section, device)  # FatalError for a folder it cannot serve
        capabilities = base_models.capabilities(config.env.id, _run_env_action_space(config), configured)
        app = build_app(
            store,
            keys,
            capabilities,
            section.long_poll_s,
            int(section.max_request_mb * 2**20),
            section.max_request_tokens,
            section.max_queued_requests,
        )
        self.unauthenticated = app.state.api.unauthenticated
        self.http = BackgroundServer(app, section.host, section.port, "Tinker API")

    def run(self, stop: threading.Event) -> None:
        """Serve, and apply the requests in this thread, until ``stop``."""
        self.http.start(stop)
        if self.keys_file is None:
            log.warning(
                "Tinker API at %s WITHOUT API keys (--insecure): anyone who reaches it can use it",
                self.http.url,
            )
        else:
            log.info("Tinker API at %s (keys in %s)", self.http.url, self.keys_file)
        self.worker.run(stop)

    def status(self) -> services_pb2.TrainerStatus:
        """Where it serves, the steps of Tinker clients' models it undid, and what it refused or expired: requests
        refused without a key, sessions that stopped heart-beating and the models they held."""
        events = {"requests_unauthenticated": self.unauthenticated.total(), **self.worker.expiry.expired}
        return services_pb2.TrainerStatus(
            tinker_api=self.http.url,
            updates_discarded_nonfinite=self.worker.guard.undone,
            tinker_events=events,
        )

    def save(self) -> Checkpoint | None:
        """Nothing for a checkpointer: every state-changing request is snapshotted as it is applied."""
        return None

    def restore(self, state: dict[str, Any], source: Path) -> None:
        """Never called (no checkpointer): a restarted worker rebuilds its models from their snapshots."""

    def progress(self) -> int:
        return 0

    def close(self) -> None:
        self.http.close()
        # a sample in progress stops at its next token, to run again after a restart
        self.worker.close()


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
