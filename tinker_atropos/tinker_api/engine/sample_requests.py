"""The hand-off of a ``sample`` request to the sampling process: the worker finds the weights the request's sampling
session samples from and keeps them while used; the process samples (``sampling_process.py``), the request's tenant
in turn with the others."""

from __future__ import annotations

import json
import threading

from tinker_atropos.config import TinkerSection
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.responses import Response
from tinker_atropos.tinker_api.engine.sampling_process import Interrupted, Job, SamplingProcess
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.tinker_api.store.files import EPHEMERAL, parts
from tinker_atropos.training.served import LANGUAGE_MODELS


class SampleRequests:
    """The handler of ``sample``, run in the request's own lane while the sampling process samples."""

    def __init__(
        self,
        store: Store,
        checkpoints: Checkpoints,
        sampling: SamplingProcess,
        stopping: threading.Event,
        settings: TinkerSection,
    ) -> None:
        self.store, self.checkpoints, self.sampling = store, checkpoints, sampling
        self.stopping, self.settings = stopping, settings

    def sample(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        """Sampled in the sampling process, from the sampler this request's session names."""
        sampler_id = json.loads(body).get("sampling_session_id") or ""
        found = self.store.samplers.get(sampler_id)
        if found is None:
            raise wire.WireError(f"no sampling session {sampler_id!r}")
        base_model, path = found
        if base_model not in LANGUAGE_MODELS:
            raise wire.WireError(
                f"{base_model} is a control policy: it acts through the rollout services, and "
                "sample() only returns tokens"
            )
        file = str(self.store.files.file_of(path)) if path is not None else None
        if path is not None and parts(path)[2].startswith(EPHEMERAL):
            self.checkpoints.keep_ephemeral(path)
        if self.stopping.is_set():
            raise Interrupted
        budget = self.settings.max_request_s
        tenant = sampler_id.split(":")[0]  # the session that made the sampler (routes/samples.py names it so)
        outcome = self.sampling.run(Job(path or base_model, base_model, file, body, deadline, budget, tenant))
        if outcome.status == "done":
            return outcome.body, outcome.content_type
        error = json.loads(outcome.body)["error"]
        raise wire.WireError(error) if outcome.status == "user" else RuntimeError(error)
