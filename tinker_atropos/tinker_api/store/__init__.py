"""Everything the Tinker API must not lose, and the one place its routes and its worker meet: in Redis under the
run's namespace (``ta:{run}:tinker:…``) the sessions, the models, every request as a future with the queue, the
sampling sessions and the training runs' checkpoints; on disk the checkpoint files. The routes write requests
here and read their futures; the worker (``tinker_api/engine/worker.py``) takes the requests from here and writes
their outcomes back, as the API and the engine of SkyRL's Tinker server meet only at their tables."""

from __future__ import annotations

from pathlib import Path

import redis

from tinker_atropos.tinker_api.store.files import CheckpointFiles
from tinker_atropos.tinker_api.store.model_records import Models
from tinker_atropos.tinker_api.store.queue import Requests
from tinker_atropos.tinker_api.store.runs import TrainingRuns
from tinker_atropos.tinker_api.store.samplers import Samplers
from tinker_atropos.tinker_api.store.sessions import Sessions


class Store:
    """One run's Tinker state, each part a class over its own keys; ``checkpoints``: the run's checkpoint folder."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        checkpoints: Path,
        future_ttl_s: float = 3600.0,
        ephemeral_ttl_s: float = 3600.0,
    ) -> None:
        self.client, self.run = client, run
        self.sessions = Sessions(client, run)
        self.models = Models(client, run)
        self.requests = Requests(client, run, future_ttl_s)
        self.samplers = Samplers(client, run)
        self.runs = TrainingRuns(client, run)
        self.files = CheckpointFiles(checkpoints, self.runs, ephemeral_ttl_s)
