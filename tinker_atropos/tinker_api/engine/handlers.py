"""What each kind of queued Tinker request does, one part of the engine per concept: the served models and their
lifecycle (``live_models.py``: create, load, unload), training (``training_steps.py``: forward_backward, optim_step),
saving (``save_requests.py``), sampling (``sample_requests.py``: the hand-off to the sampling process).
``RequestHandlers.table`` names the handler of each kind, the worker's one dispatch table. Each handler takes the request's model, number, body and
deadline, and returns the response's body and content type; a ``ClientError`` it raises is the client's error."""

from __future__ import annotations

import threading

import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.live_models import ServedModels
from tinker_atropos.tinker_api.engine.responses import Handler, Response
from tinker_atropos.tinker_api.engine.sample_requests import SampleRequests
from tinker_atropos.tinker_api.engine.sampling_process import SamplingProcess
from tinker_atropos.tinker_api.engine.save_requests import SaveRequests
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.engine.training_steps import StepLog, Training
from tinker_atropos.tinker_api.engine.training_steps import adam_params as adam_params  # the benches' import
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.sequences import Record
from tinker_atropos.training.guard import NonfiniteGuard


class RequestHandlers:
    """The models served, the parts that act on them, and ``table``: kind of request -> its handler."""

    def __init__(
        self,
        store: Store,
        client: redis.Redis,
        config: Config,
        checkpoints: Checkpoints,
        sampling: SamplingProcess,
        guard: NonfiniteGuard,
        stopping: threading.Event,
        device: torch.device,
        training_log: StepLog | None = None,
    ) -> None:
        """``training_log``: where each model's steps are told (the trainer's TensorBoard log)."""
        settings = config.trainer.tinker
        self.models = ServedModels(store, config, checkpoints, device)
        self.stability = Record(client, store.run)  # what samplers recorded for stable_reinforce
        self.training = Training(self.models, self.stability, guard, stopping, settings, training_log)
        saving = SaveRequests(self.models, checkpoints, store, client, config.run.name)
        samples = SampleRequests(store, checkpoints, sampling, stopping, settings)
        self.table: dict[str, Handler] = {
            "create_model": self.models.create_model,
            "create_from_state": self.models.create_from_state,
            "load_weights": self.models.load_weights,
            "unload_model": self.models.unload_model,
            "forward_backward": self.training.forward_backward,
            "optim_step": self.training.optim_step,
            "save_weights": saving.save_weights,
            "save_weights_for_sampler": saving.save_weights_for_sampler,
            "save_weights_external": saving.save_weights_external,
            "sample": samples.sample,
            "refused": refused,
        }


def refused(model_id: str, seq: int, body: bytes, deadline: float) -> Response:
    """A numbered request the API refused: answered as failed, with the reason it was refused for."""
    raise wire.WireError(body.decode(errors="replace"))
