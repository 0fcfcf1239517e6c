"""What the training requests do to a served model: ``forward_backward`` (or forward only) runs its loss, alone or
beside other LoRA models' in one batched pass, and ``optim_step`` takes an Adam step the guard undoes when it comes
out non-finite. A request ends past its time budget (``trainer.tinker.max_request_s``, the client's error) or when
the worker stops (it runs again after the restart). Each step that stands is told to the trainer's log, if it keeps
one: the model's loss and tokens over the ``forward_backward`` passes since its last step, and the gradient norm of a
clipped step, tagged ``tinker/<model id>/...``, at the model's version."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tinker import types as sdk

from tinker_atropos.config import TinkerSection
from tinker_atropos.tinker_api import wire
from tinker_atropos.tinker_api.engine.live_models import ServedModels
from tinker_atropos.tinker_api.engine.responses import JSON, PROTOBUF, Response, json_body
from tinker_atropos.tinker_api.engine.sampling_process import Interrupted
from tinker_atropos.tinker_api.store.sequences import Record
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.data import Datum
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import LanguageModel, LossRun, run_loss, run_losses

StepLog = Callable[[Mapping[str, float], int], None]  # a step's points by tag, and the step


class Training:
    """The handlers of ``forward_backward`` and ``optim_step``, and the replay of an accumulation after a restart;
    ``stability``: what the samplers recorded for ``stable_reinforce``."""

    def __init__(
        self,
        models: ServedModels,
        stability: Record,
        guard: NonfiniteGuard,
        stopping: threading.Event,
        settings: TinkerSection,
        log: StepLog | None = None,
    ) -> None:
        self.models, self.stability, self.guard = models, stability, guard
        self.stopping, self.settings, self.log = stopping, settings, log
        # per model, the loss and tokens of its forward_backward passes since its last step (lanes of several
        # threads add to it): lost with the process, and rebuilt by the replay of an accumulation after a restart
        self._since_step: dict[str, tuple[float, int]] = {}
        self._since_step_lock = threading.Lock()

    def budget(self) -> wire.Budget:
        """What one request's body may build (``trainer.tinker.max_request_mb``)."""
        return wire.request_budget(int(self.settings.max_request_mb * 2**20))

    def apply_forward_backward(
        self, model_id: str, request: wire.ForwardBackward, deadline: float | None
    ) -> bytes:
        """A forward_backward as applied, or replayed after a restart (the samplers' record is in Redis)."""
        if request.loss_fn == "stable_reinforce":
            self.stability.look_up(model_id, request)
        outputs, metrics = run_loss(
            self.models.loaded(model_id),
            request.data,
            request.loss_fn,
            request.loss_fn_config,
            request.forward_only,
            self._time_check(deadline),
        )
        if not request.forward_only:
            self._passed(model_id, metrics, request.data)
        return wire.forward_backward_output(outputs, metrics)

    def forward_backward(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        request = wire.parse_forward_backward(body, self.budget())
        return self.apply_forward_backward(model_id, request, deadline), PROTOBUF

    def forward_backward_together(
        self, requests: list[tuple[str, bytes]], deadline: float
    ) -> list[Response | Exception]:
        """The ``forward_backward`` (or forward) requests, given as (model, body), of LoRA models of one base and
        one adapter layout, in one batched pass (``run_losses``); per request, its response or the error it alone
        failed with, its model untouched."""
        outcomes: list[Response | Exception | None] = [None] * len(requests)
        runs, ran = [], []
        for index, (model_id, body) in enumerate(requests):
            try:
                request = wire.parse_forward_backward(body, self.budget())
                if request.loss_fn == "stable_reinforce":
                    self.stability.look_up(model_id, request)
                model = self.models.loaded(model_id)
            except Exception as error:  # this request's alone: a body, a model, a sampler record
                outcomes[index] = error
                continue
            assert isinstance(model, LanguageModel)  # the dispatcher groups LoRA language models only
            runs.append(
                LossRun(
                    model,
                    request.data,
                    request.loss_fn,
                    request.loss_fn_config,
                    request.forward_only,
                    self._time_check(deadline),
                )
            )
            ran.append(index)
        for index, run, outcome in zip(ran, runs, run_losses(runs) if runs else [], strict=True):
            if isinstance(outcome, Exception):
                outcomes[index] = outcome
                continue
            outcomes[index] = wire.forward_backward_output(*outcome), PROTOBUF
            if not run.forward_only:
                self._passed(requests[index][0], outcome[1], run.data)
        return outcomes  # type: ignore[return-value]  # every request has its outcome by now

    def _time_check(self, deadline: float | None) -> Callable[[], None]:
        """What a request calls between its steps: it ends the request past its time budget, or when the
        worker stops (the request then runs again after the restart)."""
        limit = self.settings.max_request_s

        def check() -> None:
            if self.stopping.is_set():
                raise Interrupted
            if deadline is not None and time.monotonic() > deadline:
                raise wire.WireError(
                    f"the request ran past its time budget of {limit:g} s "
                    "(trainer.tinker.max_request_s); ask for less work per request"
                )

        return check

    def optim_step(self, model_id: str, seq: int, body: bytes, deadline: float) -> Response:
        model = self.models.loaded(model_id)
        adam = adam_params(json.loads(body).get("adam_params"))
        metrics, bad = self.guard.update(model.core, None, lambda: model.core.optim_step(adam))
        with self._since_step_lock:  # an undone step's passes are undone with it
            loss, tokens = self._since_step.pop(model_id, (0.0, 0))
        if bad:
            raise wire.WireError(f"the step made {', '.join(bad[:3])} non-finite; it was undone")
        if self.log is not None:
            figures = {"loss": loss, "tokens": float(tokens), **metrics}
            self.log(
                {f"tinker/{model_id}/{name}": value for name, value in figures.items()}, model.core.version
            )
        return json_body(metrics={f"{k}:mean": v for k, v in metrics.items()}), JSON

    def _passed(self, model_id: str, metrics: Mapping[str, float], data: list[Datum]) -> None:
        """A forward_backward pass of the model's next step: its loss and tokens (each datum's positions)."""
        if self.log is None:
            return
        with self._since_step_lock:
            loss, tokens = self._since_step.get(model_id, (0.0, 0))
            self._since_step[model_id] = loss + metrics["loss:sum"], tokens + sum(len(d.tokens) for d in data)


def adam_params(adam: Any) -> AdamParams:
    """The SDK's AdamParams (its defaults where a field is absent) as the training core's; WireError for a value
    no step can be taken with (a NaN learning rate, a beta of 1)."""
    if not isinstance(adam, dict):
        raise wire.WireError("optim_step: this server runs Adam(W) only; send AdamParams")
    # what the SDK's client means by a field it leaves out: the pinned SDK's own defaults, not a copy of them
    sdk_defaults = sdk.AdamParams()
    defaults = {field.name: getattr(sdk_defaults, field.name) for field in dataclasses.fields(AdamParams)}
    values = {}
    for name, default in defaults.items():
        value = adam.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wire.WireError(f"AdamParams.{name} must be a finite number, got {value!r}")
        values[name] = float(value)
    bounds = {
        "learning_rate": values["learning_rate"] >= 0,
        "beta1": 0 <= values["beta1"] < 1,
        "beta2": 0 <= values["beta2"] < 1,
        "eps": values["eps"] > 0,
        "weight_decay": values["weight_decay"] >= 0,
        "grad_clip_norm": values["grad_clip_norm"] >= 0,
    }
    wrong = [name for name, holds in bounds.items() if not holds]
    if wrong:
        raise wire.WireError(
            f"AdamParams out of range: {', '.join(f'{n}={values[n]}' for n in wrong)} (learning "
            "rate, weight decay and clip norm >= 0, betas in [0, 1), eps > 0)"
        )
    clip = values["grad_clip_norm"]
    return AdamParams(
        learning_rate=values["learning_rate"],
        beta1=values["beta1"],
        beta2=values["beta2"],
        eps=values["eps"],
        weight_decay=values["weight_decay"],
        grad_clip_norm=clip if clip > 0 else None,
    )
