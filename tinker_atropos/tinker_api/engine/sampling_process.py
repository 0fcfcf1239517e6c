"""The Tinker API's sampling, in a process of its own beside the trainer's: a long sample then holds neither
another model's training (no interpreter lock shared with the training lanes: decoding a small model is mostly
Python between tiny tensor operations) nor the trainer's memory (a sample that runs out of it ends this process,
its request fails with the reason, and the next sample starts a new one).

The worker resolves a request's sampler (its base model and weights file) and sends it here with its time
budget, each request as soon as it is queued (up to ``trainer.tinker.max_running_samples``): every sample of one
base model, whichever client, session or LoRA sampler it comes from, joins that base's running batch
(``sampling/engine.py``: continuous batching). A stopping worker interrupts the samples in progress: their requests
stay queued and run again after the restart.

Training goes first: while a training request runs (the worker counts them in ``training``, shared with this
process), the batch waits between two tokens, up to ``YIELD`` times as long as it has run (``TrainingFirst``), so
that where cores are short (two, shared with other processes) a client's training step is not slowed by other
clients' samples, and sampling still gets at least a fifth of the time when training never pauses.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
from torch import nn

from tinker_atropos.config import ModelSection, TinkerSection
from tinker_atropos.models import lora, tiny_lm
from tinker_atropos.sampling.engine import Cancelled, Engine, Retired, Stopped
from tinker_atropos.sampling.params import Params, Topk, stop_strings, top
from tinker_atropos.tinker_api import base_models, wire
from tinker_atropos.training.data import ClientError
from tinker_atropos.training.served import LanguageModel, serving_tree, tokenizer

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
YIELD = 4.0  # the batch waits for training requests at most this many times as long as it has run
YIELD_POLL_S = 0.005
CANCELLED_KEPT = (
    4096  # the latest cancelled tenants remembered, so that a job of theirs still on its way fails
)
_PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """The worker is stopping: the request is left pending, to run again after the restart."""


@dataclass(frozen=True)
class Settings:
    model: ModelSection  # trainer.model: what a control policy would be built with (not sampled, but named)
    device: str
    seed: int
    # its base_models (registered in the sampling process too), max_samplers, threads and batch sizes
    tinker: TinkerSection


@dataclass(frozen=True)
class Job:
    key: str  # the sampler: its weights file, or its base model
    base_model: str
    file: str | None
    body: bytes  # the SampleRequest, as the SDK sent it
    deadline: float  # time.monotonic() past which it fails (one clock for every process of the machine)
    budget_s: float
    tenant: str = ""  # the session it is accounted to in the running batch (sampling/scheduler.py)


@dataclass(frozen=True)
class Outcome:
    status: str  # "done", "user" (the client's error), "server", "interrupted"
    body: bytes
    content_type: str = "application/json"


class SamplingProcess:
    """The worker's side: starts the process (from a long-lived thread: a parent-death signal follows the thread
    that made the child), sends it jobs and hands each outcome to the lane that waits for it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.training = multiprocessing.get_context("spawn").Value("i", 0)  # training requests running now
        self.lock = threading.Lock()
        self.process: Any = None
        self.connection: Connection | None = None
        self.pending: dict[int, Future[Outcome]] = {}
        self.next_id = 0

    def ensure_started(self) -> None:
        with self.lock:
            if self.process is not None and self.process.is_alive():
                return
            context = multiprocessing.get_context("spawn")
            ours, theirs = context.Pipe()
            self.process = context.Process(
                target=serve, args=(theirs, self.settings, self.training), name="tinker-sampling", daemon=True
            )
            self.process.start()
            theirs.close()
            self.connection = ours
            threading.Thread(
                target=self._read, args=(ours,), name="tinker-sampling-results", daemon=True
            ).start()
            log.info("Tinker sampling process started (pid %d)", self.process.pid)

    @contextlib.contextmanager
    def training_request(self) -> Iterator[None]:
        """While a training request runs: the samples wait between their tokens (within their share)."""
        with self.training.get_lock():
            self.training.value += 1
        try:
            yield
        finally:
            with self.training.get_lock():
                self.training.value -= 1

    def run(self, job: Job) -> Outcome:
        """The job's outcome, once the process answers (Interrupted when it was stopped first)."""
        future: Future[Outcome] = Future()
        with self.lock:
            if self.connection is None:
                raise RuntimeError("the sampling process is not started")
            job_id, self.next_id = self.next_id, self.next_id + 1
            self.pending[job_id] = future
            self.connection.send(("sample", job_id, job))
        outcome = future.result()
        if outcome.status == "interrupted":
            raise Interrupted
        return outcome

    def _read(self, connection: Connection) -> None:
        """Hand each outcome to its waiting lane; when the process ends, fail what it left unanswered."""
        try:
            while True:
                job_id, outcome = connection.recv()
                with self.lock:
                    future = self.pending.pop(job_id, None)
                if future is not None:
                    future.set_result(outcome)
        except (EOFError, OSError):
            pass
        with self.lock:
            if self.connection is connection:
                self.connection = None
            lost, self.pending = self.pending, {}
        code = self.process.exitcode if self.process is not None else None
        for future in lost.values():
            message = f"the sampling process ended (exit code {code}) during the request, e.g. out of memory"
            future.set_result(
                Outcome("server", json.dumps({"error": message, "category": "server"}).encode())
            )

    def cancel(self, tenant: str) -> None:
        """Fail ``tenant``'s samples in progress (its session ended): their rows leave the batch at the next
        token."""
        with self.lock:
            if self.connection is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.connection.send(("cancel", tenant))

    def close(self, timeout_s: float = 10.0) -> None:
        """Interrupt the samples in progress and end the process."""
        with self.lock:
            process, connection = self.process, self.connection
        if process is None:
            return
        if connection is not None:
            with contextlib.suppress(OSError, ValueError):  # the process already ended
                connection.send(("stop",))
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()


# ---- in the sampling process --------------------------------------------------------------------------------


def serve(connection: Connection, settings: Settings, training: Synchronized) -> None:
    """The sampling process: one thread per job (the worker sends a sampler's jobs one at a time), until told to
    stop or its parent ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the worker died before the signal was set: no orphan
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops this process
    torch.set_num_threads(settings.tinker.sampling_threads or len(os.sched_getaffinity(0)))
    base_models.register(settings.tinker, torch.device(settings.device))
    stopping, threads = threading.Event(), []
    samplers, sending = Samplers(settings, training, stopping), threading.Lock()

    def answer(job_id: int, job: Job) -> None:
        outcome = samplers.sample(job)
        with sending:
            connection.send((job_id, outcome))

    try:
        while True:
            message = connection.recv()
            if message[0] == "stop":
                break
            if message[0] == "cancel":
                samplers.cancel(message[1])
                continue
            thread = threading.Thread(target=answer, args=message[1:], daemon=True)
            threads.append(thread)
            thread.start()
            threads = [t for t in threads if t.is_alive()]
    except (EOFError, OSError):  # the worker went away
        pass
    stopping.set()
    samplers.close()
    for thread in threads:
        thread.join(timeout=10)


class TrainingFirst:
    """An engine's ``pause``: while training requests run, the batch waits between two tokens, up to ``YIELD``
    times as long as it has run since training began, so a client's training step is not slowed by others' long
    samples and sampling still gets a fifth of the time when training never pauses."""

    def __init__(self, training: Synchronized, stopping: threading.Event) -> None:
        self.training, self.stopping = training, stopping
        self.ran = self.waited = 0.0

    def __call__(self, ran: float) -> float:
        if not self.training.value:
            self.ran = self.waited = 0.0
            return 0.0
        self.ran += ran
        started = time.monotonic()
        while self.training.value and not self.stopping.is_set():
            if self.waited + time.monotonic() - started >= YIELD * self.ran:
                break
            time.sleep(YIELD_POLL_S)
        waited = time.monotonic() - started
        self.waited += waited
        return waited


class Samplers:
    """The sampler models (the latest ``max_samplers`` kept; a LoRA one only for its adapter), one engine per base
    model (its LoRA samplers' rows and the base's own decode together) or per fully trained sampler, kept as long
    as its sampler (then closed once it has answered its requests), and the sampling of a request."""

    def __init__(self, settings: Settings, training: Synchronized, stopping: threading.Event) -> None:
        self.settings, self.device = settings, torch.device(settings.device)
        self.training, self.stopping = training, stopping
        self.models: dict[str, LanguageModel] = {}
        self.loading: dict[str, Future[LanguageModel]] = {}  # by sampler, while one request loads it
        self.engines: dict[str, tuple[Engine, nn.Module]] = {}
        self.retired = Retired()  # those of samplers no longer kept, until they answer their requests
        self.cancelled: dict[str, None] = {}  # the latest cancelled tenants, oldest first
        self.lock = threading.Lock()

    def model(self, job: Job) -> LanguageModel | None:
        """The sampler's model, loaded from its weights file once (the requests that ask for it while it loads
        wait for that load: a client's group of requests for a new sampler, all at once, would otherwise build it
        each); None for the base model itself."""
        if job.file is None:
            return None
        with self.lock:
            model = self.models.get(job.key)
            loading = self.loading.get(job.key)
            first = model is None and loading is None
            if first:
                loading = self.loading[job.key] = Future()
        if model is not None:
            return model
        assert loading is not None
        if not first:
            return loading.result()
        try:
            model = self._load(job)
        except BaseException as error:
            with self.lock:
                del self.loading[job.key]
            loading.set_exception(error)
            raise
        with self.lock:
            del self.loading[job.key]
            self.models[job.key] = model
            while len(self.models) > self.settings.tinker.max_samplers:
                oldest = next(iter(self.models))  # a request using it keeps its own
                del self.models[oldest]
                if oldest in self.engines:  # a fully trained sampler's: it goes with its model
                    self.retired.add(self.engines.pop(oldest)[0])
        loading.set_result(model)
        self.retired.close_idle()
        return model

    def cancel(self, tenant: str) -> None:
        """Fail ``tenant``'s requests in every engine, and its jobs still on their way."""
        with self.lock:
            self.cancelled[tenant] = None
            while len(self.cancelled) > CANCELLED_KEPT:
                del self.cancelled[next(iter(self.cancelled))]
            engines = [engine for engine, _ in self.engines.values()] + self.retired.all()
        for engine in engines:
            engine.cancel(tenant)

    def _load(self, job: Job) -> LanguageModel:
        state = torch.load(job.file, map_location=self.device, weights_only=True)
        built = base_models.build(
            job.base_model,
            state["record"].get("lora") or {},
            self.settings.model,
            self.device,
            self.settings.seed,
            None,  # a language model: no policy is sampled
        )
        assert isinstance(built, LanguageModel)
        built.load_model_state(state["model"])
        return built

    def engine(self, key: str, tree: Callable[[], nn.Module]) -> tuple[Engine, nn.Module]:
        with self.lock:
            found = self.engines.get(key)
            if found is None:
                decoder = tree()
                tinker = self.settings.tinker
                engine = Engine(
                    decoder,
                    kv_tokens=tinker.kv_cache_tokens,
                    prefill_chunk=tinker.prefill_chunk_tokens,
                    pause=TrainingFirst(self.training, self.stopping),
                    budget_name="trainer.tinker.kv_cache_tokens",
                )
                engine.start(f"tinker-sampling {key}")
                found = self.engines[key] = (engine, decoder)
            return found

    def close(self) -> None:
        with self.lock:
            engines = [engine for engine, _ in self.engines.values()] + self.retired.all()
        for engine in engines:
            engine.close()

    def sample(self, job: Job) -> Outcome:
        try:
            return Outcome("done", self._sample(job), PROTOBUF)
        except Cancelled:
            message = (
                "the session ended before the sample finished; its queued and running samples were cancelled"
            )
            return Outcome("user", json.dumps({"error": message, "category": "user"}).encode())
        except Interrupted:
            return Outcome("interrupted", b"")
        except ClientError as error:
            return Outcome("user", json.dumps({"error": str(error), "category": "user"}).encode())
        except Exception as error:
            log.exception("sampling from %s failed", job.key)
            message = f"{type(error).__name__}: {error}"
            return Outcome("server", json.dumps({"error": message, "category": "server"}).encode())
        finally:
            self.retired.close_idle()

    def _sample(self, job: Job) -> bytes:
        model = self.model(job)
        if model is not None and not model.lora:  # trained fully: a batch of its own weights
            engine, decoder = self.engine(job.key, lambda: model.core.model)
            adapter = None
        else:
            engine, decoder = self.engine(job.base_model, lambda: serving_tree(job.base_model, self.device))
            adapter = model.adapter if model is not None else None
        request = json.loads(job.body)
        prompt = wire.prompt_tokens(request)
        try:
            if job.tenant in self.cancelled:
                raise Cancelled
            future = engine.submit(
                prompt, params(request, decoder.eos_id, job.base_model), adapter, job.deadline, job.tenant
            )
            sequences = future.result()
        except Stopped:
            raise Interrupted from None
        except TimeoutError:
            raise wire.WireError(
                f"the request ran past its time budget of {job.budget_s:g} s "
                "(trainer.tinker.max_request_s); ask for less work per request"
            ) from None
        except ValueError as error:
            raise wire.WireError(str(error)) from None
        with torch.inference_mode(), lora.rows([(1, adapter)]):
            logprobs, topk = prompt_scores(decoder, prompt, request)
        return wire.sample_response(sequences, logprobs, topk)


def params(request: dict[str, Any], eos: int, base_model: str) -> Params:
    """The engine's parameters of a SampleRequest (its JSON body, read)."""
    sampling = request.get("sampling_params") or {}
    stop = stops(sampling.get("stop"), eos)
    return Params(
        max_tokens=int(sampling.get("max_tokens") or 16),
        num_samples=int(request.get("num_samples", 1)),
        temperature=float(sampling.get("temperature", 1.0)),
        top_k=int(sampling.get("top_k", -1)),
        top_p=float(sampling.get("top_p", 1.0)),
        stop_tokens=frozenset(stop.tokens),
        stop_text=stop_strings(stop.strings, tokenizer(base_model).decode),
        seed=sampling.get("seed"),
        topk_logprobs=int(request.get("topk_sample_logprobs") or 0),
    )


def prompt_scores(
    decoder: nn.Module, prompt: list[int], request: dict[str, Any]
) -> tuple[list[float | None] | None, Topk | None]:
    """The prompt's log-probs and top-k a SampleRequest asks for (``prompt_logprobs``, ``topk_prompt_logprobs``),
    both read from one forward of the sampler's model at temperature 1; None at position 0 (nothing predicts it)
    and, with ``prompt_logprobs_last_n``, before the last that many positions (the API checked its range). There
    is no prefix cache to skip the prefix with: the whole prompt is read, its unasked positions left out."""
    wanted, k = bool(request.get("prompt_logprobs")), int(request.get("topk_prompt_logprobs") or 0)
    if not wanted and not k:
        return None, None
    vocabulary = decoder.config.vocab_size
    if k > vocabulary:
        raise wire.WireError(f"topk_prompt_logprobs must lie in [0, {vocabulary}] (the vocabulary), got {k}")
    last_n = request.get("prompt_logprobs_last_n")
    first = len(prompt) - int(last_n) if last_n else 1  # the first position scored
    scores = tiny_lm.next_token_logprobs(decoder, prompt)[first - 1 :]  # type: ignore[arg-type]
    logprobs = None
    if wanted:
        targets = torch.tensor(prompt[first:], dtype=torch.long, device=scores.device)
        logprobs = [None] * first + scores.gather(-1, targets[:, None])[:, 0].tolist()
    return logprobs, Topk(k, [None] * first + top(scores, k)) if k else None


@dataclass(frozen=True)
class Stops:
    """SamplingParams.stop as the sampler applies it: stop tokens, and stop strings matched on the text the
    model's tokenizer decodes from what was sampled so far. The token that completes a stop string ends the
    sample and is kept, as the hosted service keeps it (the cookbook's renderers parse responses that end with
    their stop string)."""

    tokens: list[int]
    strings: tuple[str, ...] = ()


def stops(stop: Any, eos: int) -> Stops:
    """SamplingParams.stop as the SDK documents it: None stops at the end-of-sequence token, ``[]`` at nothing
    (not even it), stop tokens or stop strings besides it otherwise."""
    if stop is None:
        return Stops([eos])
    listed = [stop] if isinstance(stop, str) else list(stop)
    if not listed:
        return Stops([])
    if all(isinstance(s, int) and not isinstance(s, bool) for s in listed):
        return Stops([*listed, eos])
    if all(isinstance(s, str) and s for s in listed):
        return Stops([eos], tuple(listed))
    raise wire.WireError(
        f"SamplingParams.stop must be token ids or non-empty strings, not both; got {listed!r}"
    )
