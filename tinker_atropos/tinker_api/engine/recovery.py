"""A restarted worker's first act: every model a previous incarnation served rebuilt from its snapshot, and the
gradient accumulations it applied since replayed."""

from __future__ import annotations

import logging

from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.live_models import ServedModels
from tinker_atropos.tinker_api.engine.saving import Checkpoints
from tinker_atropos.tinker_api.engine.training_steps import Training
from tinker_atropos.tinker_api.store import Store
from tinker_atropos.training.data import ClientError

log = logging.getLogger(__name__)


def recover(
    store: Store, models: ServedModels, training: Training, checkpoints: Checkpoints
) -> dict[str, list[str]]:
    """Rebuild the loaded models up to the last request each applied; per model, the requests replayed (a
    later snapshot makes them unneeded)."""
    replays: dict[str, list[str]] = {}
    for model_id in store.models.loaded():
        applied, snapshot_seq, snapshot = store.models.progress(model_id)
        record = store.models.record(model_id)
        if applied < 0 or record is None or snapshot is None:
            continue
        try:
            models.restore(model_id, record, snapshot)
        except Exception:
            log.exception("cannot restore Tinker model %s from %s; it stays unloaded", model_id, snapshot)
            continue
        checkpoints.restored(model_id, snapshot)
        replayed = []
        for seq in range(snapshot_seq + 1, applied + 1):
            request_id = store.requests.op(model_id, seq)
            request = store.requests.request(request_id) if request_id else None
            if request is None or request[0] != "forward_backward" or not request[1]:
                continue
            parsed = wire.parse_forward_backward(request[1], training.budget())
            if not parsed.forward_only:
                try:
                    training.apply_forward_backward(model_id, parsed, deadline=None)
                # the samplers' record it named may have expired since: a warning, never a crash loop
                except ClientError as error:
                    log.warning(
                        "Tinker model %s: accumulated gradients of request %s cannot be replayed (%s); "
                        "they are lost",
                        model_id,
                        request_id,
                        error,
                    )
                    continue
            replayed.append(request_id)
        replays[model_id] = replayed
        log.info(
            "Tinker model %s restored (applied %d, %d accumulations replayed)",
            model_id,
            applied,
            len(replayed),
        )
    return replays
