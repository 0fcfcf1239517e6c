"""Continuous batching: the sample requests of every client of one served model (any of its LoRA adapters, or the
base itself) decode as one batch, as vLLM and SGLang batch sequences. A request joins the running batch between two
tokens once its prompt is read and leaves it when its samples stop; the batch never waits for its slowest member.

- **Prompts are read in chunks** of at most ``prefill_chunk`` tokens between two decoding steps, so a long prompt
  delays the running samples by one chunk, not by the whole prompt. A prompt's keys and values are read once and
  shared by its ``num_samples`` rows and by the other requests of that prompt and adapter (clients that send a
  group's samples one request each); unread prompts of one length are read together, one pass of several rows.
- **The keys and values are bounded** by ``kv_tokens`` positions: a request is admitted while every request in
  flight, each grown to its longest, fits (the batch is padded on the left to its longest row); otherwise it
  waits, oldest first. A request that could never fit is refused at once.
- **Several adapters in one pass**: each request's rows carry its adapter (``lora.rows``); the base's matmuls are
  shared by every row.
- **Tenants share it**: each request is accounted to a tenant (a Tinker session), admitted least-served first, and
  a newcomer that does not fit takes the room of the latest request of the tenant holding the most rows, which
  starts over later (``scheduler.py``). ``cancel`` takes a tenant's requests out at the next step.
- **Between two steps** the engine drops requests past their deadline and asks ``pause`` whether to wait (the
  Tinker API lets training requests go first where cores are short); the time it waits is not counted against the
  requests' deadlines.

Its parts, as vLLM separates them: a request's state (``request_state.py``), the queue the callers' threads hand it
(``inbox.py``), the prompts being read (``prefill.py``) and the running batch (``running_batch.py``); this engine
moves each request between them, one step at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from tinker_atropos.models import lora
from tinker_atropos.sampling import scheduler
from tinker_atropos.sampling.inbox import Inbox, Stopped
from tinker_atropos.sampling.params import Decoder, Params, SampledTokens
from tinker_atropos.sampling.prefill import Prefill
from tinker_atropos.sampling.request_state import Request
from tinker_atropos.sampling.running_batch import Rows

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The request's tenant was cancelled (its session ended) before the request finished."""


class Engine:
    """One served model's running batch. ``submit`` from any thread; ``start`` runs it in a thread of its own,
    ``drain`` in the caller's."""

    def __init__(
        self,
        decoder: Decoder,
        *,
        kv_tokens: int,
        prefill_chunk: int,
        pause: Callable[[float], float] | None = None,
        budget_name: str = "kv_tokens",
    ) -> None:
        self.decoder = decoder
        self.device = next(decoder.parameters()).device  # type: ignore[attr-defined]
        self.kv_tokens, self.prefill_chunk, self.budget_name = kv_tokens, prefill_chunk, budget_name
        self.pause = pause
        self.inbox = Inbox()  # submitted, waiting to be admitted
        self.reading = Prefill(self.device)  # admitted, their prompts being read
        self.rows = Rows(self.device)  # decoding
        # the latest requests' times to their first token
        self.first_token_s: deque[float] = deque(maxlen=1024)
        self.preempted = 0  # requests that gave up their room to another tenant's and started over
        self.thread: threading.Thread | None = None
        self.busy_since = time.monotonic()

    @property
    def waiting(self) -> deque[Request]:
        """The requests submitted and not yet admitted, oldest first."""
        return self.inbox.waiting

    @property
    def closed(self) -> bool:
        """Whether it was closed (it takes no more requests)."""
        return self.inbox.closed

    # ---- the callers' side -------------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        params: Params,
        adapter: lora.Adapter | None = None,
        deadline: float | None = None,
        tenant: str = "",
    ) -> Future[list[SampledTokens]]:
        """The request's samples, in a future, accounted to ``tenant``; ValueError at once for one the model or
        the budget cannot take."""
        params.check(prompt, self.decoder.config)
        scheduler.check_budget(
            params.num_samples, len(prompt) + params.max_tokens, self.kv_tokens, self.budget_name
        )
        request = Request(list(prompt), params, adapter, deadline, Future(), tenant=tenant)
        request.restart(self.device)
        self.inbox.put(request)
        return request.future

    def cancel(self, tenant: str) -> None:
        """Fail ``tenant``'s requests with ``Cancelled``; their rows leave the batch at the next step."""
        self.inbox.cancel(tenant)

    def start(self, name: str = "sampling-engine") -> None:
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def drain(self) -> None:
        """Run until every submitted request is answered."""
        while self._has_work():
            self.step()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop between two steps; every request not yet answered fails with ``Stopped``."""
        self.inbox.close()
        if self.thread is not None:
            self.thread.join(timeout_s)
        self._remove(lambda _: True, lambda: Stopped("the sampling engine stopped"))

    def _serve(self) -> None:
        while self.inbox.wait(self._has_work):
            self.step()

    def busy(self) -> bool:
        """Whether a request is not yet answered (asked of another thread, while this one may be moving one)."""
        return self.inbox.busy()

    def _has_work(self) -> bool:
        return bool(self.waiting or self.reading or self.rows.requests)

    # ---- one step ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Drop what is past its deadline, maybe pause, admit what fits, read up to a chunk of prompts, and
        decode one token for every row."""
        now = time.monotonic()
        if self.pause is not None:
            waited = self.pause(now - self.busy_since)
            for request in [*self.waiting, *self.reading, *self.rows.requests]:
                request.excused += waited
        self.busy_since = time.monotonic()
        self._drop_cancelled()
        self._expire()
        self._admit()
        self._read_prompts()
        if self.rows.requests:
            try:
                self.rows.decode(self.decoder)
            # the batch's model failed (out of memory): its requests fail, not the engine
            except Exception as error:
                log.exception("sampling step failed")
                self._remove(set(self.rows.requests).__contains__, lambda failure=error: failure)

    def _expire(self) -> None:
        now = time.monotonic()
        self._remove(
            lambda r: r.deadline is not None and now - r.excused > r.deadline,
            lambda: TimeoutError("the request ran past its deadline"),
        )

    def _drop_cancelled(self) -> None:
        if tenants := self.inbox.take_cancelled():
            self._remove(lambda r: r.tenant in tenants, lambda: Cancelled("its session ended"))

    def _remove(self, which: Callable[[Request], bool], error: Callable[[], Exception]) -> None:
        """Take the requests ``which`` names out of every queue and the batch, each failed with ``error()``."""
        gone = self.inbox.take(which) + self.reading.take(which)
        in_batch = [r for r in self.rows.requests if which(r)]
        self.rows.drop(in_batch)
        for request in [*gone, *in_batch]:
            request.fail(error())

    def _admit(self, preempt: bool = True) -> None:
        """As ``scheduler.next_admission`` rules: the requests it admits start reading their prompts, those it
        preempts (when ``preempt``) go back to the head of the queue to start over."""
        while True:
            flight = [*self.reading, *self.rows.requests]
            admitted, preempted = self.inbox.admit(flight, self.kv_tokens, preempt)
            if admitted is not None:
                self.reading.append(admitted)
            elif preempted is not None:
                self._preempt(preempted)
            else:
                return

    def _preempt(self, request: Request) -> None:
        """Out of the batch (or the prompts being read) and back to the head of the queue, to start over."""
        if request in self.reading:
            self.reading.remove(request)
        else:
            self.rows.drop([request])
        request.restart(self.device)
        self.inbox.requeue(request)
        self.preempted += 1

    def _read_prompts(self) -> None:
        """Up to ``prefill_chunk`` prompt tokens (``Prefill.read``); a prompt read joins the batch."""
        for request, logits in self.reading.read(self.decoder, self.prefill_chunk):
            self._join(request, logits)

    def _join(self, request: Request, logits: torch.Tensor) -> None:
        """Its prompt read: it and its twins draw their first tokens and join the batch, its keys and values
        shared, as one request's samples share them."""
        # (still counted as reading, so never preempted here) those that arrived while it was read: its twins
        # read nothing
        self._admit(preempt=False)
        kv, readers = self.reading.finish(request)
        joining = []
        for r in readers:
            self.first_token_s.append(time.monotonic() - r.submitted)
            if len(first := r.first(logits)):
                joining.append((r, first))
        if joining:
            self.rows.join(joining, kv)


class Retired:
    """Engines no longer given new requests (an older policy version's, an evicted sampler's), each closed, with
    its thread and the model it holds, once it has answered every request it took."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engines: list[Engine] = []

    def add(self, engine: Engine) -> None:
        with self.lock:
            self.engines.append(engine)

    def close_idle(self) -> None:
        with self.lock:
            idle = [engine for engine in self.engines if not engine.busy()]
            self.engines = [engine for engine in self.engines if engine not in idle]
        for engine in idle:
            engine.close()

    def all(self) -> list[Engine]:
        with self.lock:
            return list(self.engines)

    def __len__(self) -> int:
        """Engines not yet closed."""
        with self.lock:
            return len(self.engines)


def sample(
    decoder: Decoder, prompt: Sequence[int], params: Params, adapter: lora.Adapter | None = None
) -> list[SampledTokens]:
    """One request's samples, decoded in the caller's thread by an engine of its own (the prompt read at once)."""
    engine = Engine(
        decoder,
        kv_tokens=params.num_samples * (len(prompt) + params.max_tokens),
        prefill_chunk=max(1, len(prompt)),
    )
    future = engine.submit(prompt, params, adapter)
    engine.drain()
    return future.result()
