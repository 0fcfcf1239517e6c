"""The requests that save a served model: as a named checkpoint, as the weights a sampling client samples from (a
control policy's also published to the rollouts), as transformers or PEFT files. What the files are and where they
go is ``saving.py``'s; which model is live is ``live_models.py``'s."""

from __future__ import annotations

import json
import logging
import uuid

import redis

from tinker_atropos.security import signing_key
from tinker_atropos.state.weights import publish_weights
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.live_models import ServedModels
from tinker_atropos.tinker_api.engine.responses import JSON, Response, json_body
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.files import EPHEMERAL, named, tinker_path
from tinker_atropos.training.served import PolicyModel

log = logging.getLogger(__name__)


class SaveRequests:
    """The handlers that save a served model: as a named checkpoint (``save_weights``), as the weights a sampling
    client samples from (``save_weights_for_sampler``; a control policy's are also published to the rollouts, of
    ``run``), as transformers or PEFT files (``save_weights_external``)."""

    def __init__(
        self, models: ServedModels, checkpoints: Checkpoints, store: Store, client: redis.Redis, run: str
    ) -> None:
        self.models, self.checkpoints, self.store, self.client, self.run = (
            models,
            checkpoints,
            store,
            client,
            run,
        )

    def save_weights(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        self.models.loaded(model_id)
        request = json.loads(body)
        name = named(request) or f"step-{seq}"
        file = self.store.files.file(model_id, "weights", name)
        if file.exists() and not request.get("overwrite"):
            raise wire.WireError(
                f"checkpoint {name!r} exists; save under another name or pass overwrite=True"
            )
        self.checkpoints.save(file, self.models.state(model_id))
        return json_body(
            path=self.checkpoints.saved(model_id, "weights", name, request), type="save_weights"
        ), JSON

    def save_weights_for_sampler(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        model = self.models.loaded(model_id)
        request = json.loads(body)
        name = named(request)
        stored = name or f"{EPHEMERAL}{seq}"
        self.checkpoints.save(
            self.store.files.file(model_id, "sampler_weights", stored),
            self.models.state(model_id, optimizer=False),
        )
        path = tinker_path(model_id, "sampler_weights", stored)
        if name is None:  # kept while its sampling client samples
            self.checkpoints.keep_ephemeral(path)
        if isinstance(model, PolicyModel):  # the rollouts act with it from now on
            version = publish_weights(
                self.client, self.run, 1, model.core.weights(), model.core.spec, signing_key("weights")
            )
            log.info("Tinker model %s published as policy version %d", model_id, version)
        if name is not None:
            self.checkpoints.saved(model_id, "sampler_weights", name, request)
            return json_body(path=path, type="save_weights_for_sampler"), JSON
        sampler = f"{model_id.split(':')[0]}:sample:{uuid.uuid4().hex[:12]}"
        self.store.samplers.add(sampler, model.base_model, path)
        return json_body(path=path, sampling_session_id=sampler, type="save_weights_for_sampler"), JSON

    def save_weights_external(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        """Weights for transformers and PEFT, on the trainer's disk (``tinker_api/engine/weights_out.py``)."""
        path, size = self.checkpoints.save_external(model_id, self.models.loaded(model_id), json.loads(body))
        return json_body(path=path, size_bytes=size, type="save_weights_external"), JSON
