"""The trainer as an Atropos trainer (``trainer.atropos.enabled``): it registers with a trajectory API (the run's
``atropos-api``, or atroposlib's own ``run-api``), pulls its fixed-size batches, turns them into Tinker datums
(``training/atropos_batches.py``: group-relative advantages, masks, behaviour log-probs) and learns with a Tinker
loss on ``trainer.atropos.base_model`` (the tiny byte-level LM, SmolLM2, or a local model folder of
``trainer.tinker.base_models``: any language model the Tinker API serves, LoRA or fully trained); after each
optimizer step the inference endpoint samples with the new weights, through that model's tokenizer.

Each scored sequence counts as an episode of the run (its score the return, its trained tokens the length) and
its tokens as env steps, so ``up``'s progress, ``metrics.jsonl`` and ``status`` follow an Atropos run as they follow
a control one (in its words: tokens, answers, reward); each step's curves (reward, answer length, sampler-learner
KL, gradient norm, tokens/s: ``atropos_figures.py``) go to the trainer's TensorBoard log. The model, its optimizer
and the step are checkpointed to ``RUN_DIR/atropos`` by the trainer's checkpointer (``checkpointing.py``), as the
experience loop's are; a restarted trainer resumes from the newest (or from the ``state.pt`` of earlier versions)
and registers again with the step it reached.

A group it cannot learn from (malformed, a NaN score, a token outside the vocabulary, past the context) is skipped
and counted (``groups_invalid``) and the batch's sound groups are learned from; nothing in a batch ends the loop.
A step that comes out NaN or infinite is undone and counted (``updates_discarded_nonfinite``; ``training/guard.py``,
the one guard of every driver), its batch taken without a new version being served.
The trajectory API and the inference endpoint take the run's keys (``frontends.http.endpoint_keys``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from tinker_atropos.config import Config
from tinker_atropos.errors import FatalError
from tinker_atropos.frontends.http import BackgroundServer, endpoint_key, endpoint_keys, service_client
from tinker_atropos.frontends.inference.app import build_app
from tinker_atropos.frontends.inference.sampler import Sampler
from tinker_atropos.frontends.inference.tokens import served_tokens
from tinker_atropos.models import hf_lm, smollm2
from tinker_atropos.protocol.v1 import services_pb2
from tinker_atropos.state import keys
from tinker_atropos.state.experience import MAX_EPISODES_KEPT, add_stats
from tinker_atropos.trainer import trajectory_api
from tinker_atropos.trainer.atropos_figures import StepCurves, gradient_norm
from tinker_atropos.trainer.checkpointing import snapshot
from tinker_atropos.trainer.figures import BusyMeter
from tinker_atropos.trainer.tensorboard import TensorBoardLog
from tinker_atropos.training.atropos_batches import batch_datums
from tinker_atropos.training.core import AdamParams
from tinker_atropos.training.data import ClientError, Datum
from tinker_atropos.training.driver import Checkpoint
from tinker_atropos.training.guard import NonfiniteGuard
from tinker_atropos.training.served import TINY_LM, LanguageModel, run_loss, shared_tensors

log = logging.getLogger(__name__)

EARLIER_STATE = "state.pt"  # its one checkpoint file before the trainer's checkpointer wrote numbered ones


def language_model(config: Config, device: torch.device) -> LanguageModel:
    """``trainer.atropos.base_model`` with LoRA adapters of ``lora_rank`` (0: every parameter trains); a name of
    ``trainer.tinker.base_models`` is registered as the Tinker API registers it (the same checks, the same shared
    base when both run). FatalError, one line, for a model that cannot be served."""
    section, tinker = config.trainer.atropos, config.trainer.tinker
    name = section.base_model
    if name in tinker.base_models:
        # the Tinker API's front-end (gymnasium, its envs): imported only for a model folder
        from tinker_atropos.tinker_api import base_models

        base_models.register(
            tinker.model_copy(update={"base_models": {name: tinker.base_models[name]}}), device
        )
    elif name == smollm2.NAME and not smollm2.available():
        raise FatalError(
            f"trainer.atropos.base_model: {name} is not installed on this trainer (see docs/tinker.md, "
            "The Tinker API: Models)"
        )
    try:
        lora = {"rank": section.lora_rank, "train_unembed": section.lora_train_unembed}
        return LanguageModel(name, lora, device)
    except hf_lm.FolderError as error:  # its folder changed since the check
        raise FatalError(f"trainer.atropos.base_model {name!r}: {error}") from None


class AtroposLoop:
    def __init__(
        self,
        config: Config,
        client: redis.Redis,
        run_dir: Path,
        device: torch.device,
        tensorboard: TensorBoardLog | None = None,
    ) -> None:
        """``tensorboard``: the trainer's log, where each step's curves go (None: none are written)."""
        self.section, self.client, self.run_name = config.trainer.atropos, client, config.run.name
        self.checkpoint_every = config.trainer.checkpoint.every_updates
        self.model = language_model(config, device)
        self.folder = run_dir / "atropos"  # its checkpoints (the trainer's Checkpointer writes them)
        # held over a step: ``save`` (another thread) takes its state between two
        self.lock = threading.Lock()
        self.step = 0
        self._first_step = 0  # the step it started at: ``progress`` counts from there
        self.figures: dict[str, float] = {}
        self.curves = StepCurves(tensorboard, self.section.loss)
        self.busy = BusyMeter()
        self.guard = NonfiniteGuard()  # counts the steps it undid: ``updates_discarded_nonfinite``
        self.counters = {
            "sequences_trained": 0,
            "groups_skipped_equal": 0,
            "groups_invalid": 0,
            "batches_malformed": 0,
        }
        core = self.model.core
        # a LoRA model's frozen base: the sampler's copies hold its tensors, a step copies the adapters only
        shared = [t for t in shared_tensors(core.model) if core.is_shared(t)]
        batching = config.trainer.tinker  # its running batch's bounds: the same as the Tinker API's sampling
        self.sampler = Sampler(
            core.model,
            core.version,
            served_tokens(self.model),
            shared,
            batching.kv_cache_tokens,
            batching.prefill_chunk_tokens,
        )
        keys = endpoint_keys(
            "inference",
            self.section.inference_api_keys_file,
            "trainer.atropos.inference_api_keys_file",
            "inference endpoint",
        )
        app = build_app(
            self.sampler, self.model.base_model, keys, int(self.section.inference_max_request_mb * 2**20)
        )
        self.inference = BackgroundServer(
            app, self.section.inference_host, self.section.inference_port, "inference endpoint"
        )
        self.api_url = ""
        self.api_key = endpoint_key("atropos-api", config.atropos.api_keys_file)  # None: an API without keys

    # what the trainer's Checkpointer asks (driver.py) -------------------------------------------------------
    def save(self) -> Checkpoint:
        """{"core": the model's state, "step", "counters"}, as ``state.pt`` held it, and the base model's name."""
        with self.lock:
            state = {
                "core": self.model.core.state_dict(),
                "step": self.step,
                "counters": self.counters,
                "base_model": self.model.base_model,
            }
            return Checkpoint(self.model.core.version, snapshot(state))

    def restore(self, state: dict[str, Any], source: Path) -> None:
        """A checkpoint back; FatalError, one line, for one of another base model (those before it: the tiny LM's)."""
        if (held := state.get("base_model", TINY_LM)) != self.model.base_model:
            raise FatalError(
                f"{source} holds a {held} model, trainer.atropos.base_model is {self.model.base_model}: "
                "name the model it trained, or start a new run folder"
            )
        with self.lock:
            core = self.model.core
            core.load_state_dict(state["core"])
            self.step = self._first_step = state["step"]
            self.counters |= state["counters"]
            self.sampler.update(core.model, core.version)
        log.info(
            "resumed the Atropos trainer from %s at step %d (policy version %d)",
            source,
            self.step,
            core.version,
        )

    def progress(self) -> int:
        return self.step - self._first_step

    def status(self) -> services_pb2.TrainerStatus:
        return services_pb2.TrainerStatus(
            policy_version=self.model.core.version,
            updates=self.step,
            losses=self.figures,
            busy_fraction=self.busy.fraction(),
            updates_discarded_nonfinite=self.guard.undone,
        )

    # the loop ---------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.inference.start(stop)
        log.info("inference endpoint at %s (OpenAI /v1, SGLang /generate)", self.inference.url)
        self.api_url = trajectory_api.find_api(self.section, self.client, self.run_name, stop) or ""
        body = trajectory_api.registration(
            self.section, self.run_name, self.folder, self.checkpoint_every, self.step
        )
        with service_client(self.api_url, key=self.api_key) as http:
            if self.api_url and trajectory_api.register(http, body, stop):
                training = (
                    f"LoRA rank {self.section.lora_rank}" if self.section.lora_rank else "every parameter"
                )
                log.info(
                    "learning %s (%s) from the trajectory API at %s",
                    self.model.base_model,
                    training,
                    self.api_url,
                )
                for batch in trajectory_api.batches(http, stop):
                    self.learn(batch)

    def close(self) -> None:
        """Its engines closed (after its last checkpoint), then the inference endpoint: a request in flight is
        answered 503 at once (``Stopped``) rather than cancelled with a traceback when the endpoint's graceful
        shutdown runs out."""
        self.sampler.close()
        self.inference.close()

    def learn(self, batch: list[dict[str, Any]]) -> None:
        """One optimizer step on ``batch``'s sound groups (each other one skipped and counted), then serve the new
        weights."""
        with self.lock:
            self._step(batch)

    def _step(self, batch: list[dict[str, Any]]) -> None:
        started = time.monotonic()
        if not isinstance(batch, list):
            self.counters["batches_malformed"] += 1
            log.warning("skipped a batch that is not a list of groups: %.200r", batch)
            return
        datums = batch_datums(batch, self.model.schema)
        for problem in datums.groups_invalid:
            log.warning("skipped a group the model cannot learn from: %s", problem)
        self.counters["groups_invalid"] += len(datums.groups_invalid)
        self.counters["groups_skipped_equal"] += datums.groups_skipped_equal
        core = self.model.core
        stood = False
        # this step's figures: the last step's loss and sync time stay in ``figures`` when this one taught nothing
        fresh = datums.figures()
        if datums.data:
            try:
                # a sequence without behaviour log-probs: the current policy's (ratio 1)
                for datum in datums.data:
                    if "logprobs" not in datum.inputs:
                        outputs, _ = run_loss(self.model, [datum], "cross_entropy", {}, forward_only=True)
                        datum.inputs["logprobs"] = outputs[0]["logprobs"].astype(np.float32)
                learner: list[np.ndarray] = []  # the learner's log-probs of the loss pass
                update = functools.partial(self._update, datums.data, learner)
                metrics, bad = self.guard.update(core, None, update)
            except ClientError as error:  # checked per group already: a batch no loss can take
                core.discard_gradients()
                self.counters["batches_malformed"] += 1
                log.warning("skipped a batch the loss cannot take: %s", error)
                return
            stood = not bad
            if stood:
                synced = time.monotonic()
                self.sampler.update(core.model, core.version)
                # trainer step -> the endpoint sampling with the new adapter (at most 1 s on SmolLM2)
                fresh["weight_sync_seconds"] = time.monotonic() - synced
                fresh |= self.curves.learned(datums.data, learner, metrics)
            else:
                log.warning("step undone: NaN or infinity in %s", ", ".join(bad[:3]))
        self.step += 1
        if stood:
            self.counters["sequences_trained"] += len(datums.data)
        fresh |= self.curves.ended(datums, stood, started)
        # built whole, then swapped in: ``status`` (another thread) never reads half of them
        self.figures = self.figures | fresh | {k: float(v) for k, v in self.counters.items()}
        self.curves.write(self.step, self.figures, fresh)
        record_episodes(self.client, self.run_name, datums.episodes)
        self.busy.record(started, time.monotonic())

    def _update(self, data: list[Datum], learner: list[np.ndarray]) -> dict[str, float]:
        """The loss's gradients on ``data``, then one optimizer step: what the non-finite guard judges; ``learner``
        gets each datum's log-probs of the loss pass."""
        outputs, metrics = run_loss(self.model, data, self.section.loss, {}, forward_only=False)
        learner.extend(output["logprobs"] for output in outputs)
        section = self.section
        adam = AdamParams(
            learning_rate=section.learning_rate,
            beta1=section.adam_beta1,
            beta2=section.adam_beta2,
            grad_clip_norm=section.grad_clip_norm or None,
        )
        if adam.grad_clip_norm is None:  # a clipped step measures it itself
            metrics["grad_norm"] = gradient_norm(self.model.core.model)
        return metrics | self.model.core.optim_step(adam)


def record_episodes(client: redis.Redis, run: str, sequences: list[tuple[float, int]]) -> None:
    """Each sound sequence as an episode of run ``run`` (score, trained tokens), its tokens as env steps."""
    if not sequences:
        return
    episodes = [json.dumps({"return": score, "length": length}) for score, length in sequences]
    with client.pipeline(transaction=True) as pipe:
        pipe.lpush(keys.episodes(run), *episodes)
        pipe.ltrim(keys.episodes(run), 0, MAX_EPISODES_KEPT - 1)
        pipe.execute()
    tokens = sum(length for _, length in sequences)
    add_stats(client, run, env_steps=tokens, episodes=len(episodes), chunks_consumed=1)
