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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tinker_atropos.models import lora
from tinker_atropos.sampling import scheduler
from tinker_atropos.sampling.params import Decoder, Params, SampledTokens, Topk, TopRow, top

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]


class Stopped(Exception):
    """The engine was closed before the request finished."""


class Cancelled(Exception):
    """The request's tenant was cancelled (its session ended) before the request finished."""


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: Params
    adapter: lora.Adapter | None
    deadline: float | None  # time.monotonic() past which it fails (time paused for training aside)
    future: Future[list[SampledTokens]]
    generators: list[torch.Generator] = field(default_factory=list)  # one per sample
    excused: float = 0.0  # seconds the engine paused while this request was in it
    tenant: str = ""  # whom its rows are accounted to (scheduler.py)
    submitted: float = field(default_factory=time.monotonic)
    kv: KV | None = None  # its prompt's, while it is read
    read: int = 0  # prompt tokens read
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    topk: list[list[TopRow | None]] = field(default_factory=list)  # per sample, per token
    ends: list[str | None] = field(default_factory=list)
    live: list[int] = field(default_factory=list)  # its samples still in the batch, in the batch's order

    @property
    def rows(self) -> int:
        """The batch rows it holds: its live samples once it decodes, all of them before."""
        return len(self.live) if self.live else self.params.num_samples

    def restart(self, device: torch.device) -> None:
        """Nothing read nor sampled, its seeded generators afresh: as it starts, and over again once preempted."""
        n = self.params.num_samples
        self.generators = self.params.generators(device)
        self.kv, self.read, self.live = None, 0, []
        self.tokens, self.logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        self.topk, self.ends = [[] for _ in range(n)], [None] * n

    @property
    def positions(self) -> int:
        """The positions each of its rows holds at most."""
        return len(self.prompt) + self.params.max_tokens

    def record(self, sample: int, token: int, logprob: float, topk: TopRow | None) -> bool:
        """A sample's new token (and the most likely ones of its step, when asked); whether the sample goes on."""
        tokens = self.tokens[sample]
        tokens.append(token)
        self.logprobs[sample].append(logprob)
        self.topk[sample].append(topk)
        params = self.params
        if token in params.stop_tokens or (params.stop_text is not None and params.stop_text(tokens)):
            self.ends[sample] = "stop"
        elif len(tokens) == params.max_tokens:
            self.ends[sample] = "length"
        return self.ends[sample] is None

    def result(self) -> list[SampledTokens]:
        k = self.params.topk_logprobs
        return [
            SampledTokens(t, lp, end, Topk(k, rows) if k else None)  # type: ignore[arg-type]
            for t, lp, end, rows in zip(self.tokens, self.logprobs, self.ends, self.topk, strict=True)
        ]

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw the first token of each sample from its prompt's last ``logits``: those of the samples that go on
        (answered when none does)."""
        n = self.params.num_samples
        tokens, logprobs = self.params.draw(logits.expand(n, -1), self.generators)
        topk = self.top(logits) * n  # the samples share the prompt's last step
        self.live = [
            s
            for s, t, lp, tk in zip(range(n), tokens.tolist(), logprobs.tolist(), topk, strict=True)
            if self.record(s, t, lp, tk)
        ]
        if not self.live:
            self.future.set_result(self.result())
        return tokens[self.live]

    def top(self, logits: torch.Tensor) -> Sequence[TopRow | None]:
        """Per row of ``logits``, its ``Params.topk_logprobs`` most likely tokens (None each when not asked)."""
        k = self.params.topk_logprobs
        return top(logits, k) if k else [None] * len(logits)


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
        self.changed = threading.Condition()
        self.waiting: deque[_Request] = deque()  # submitted, under ``changed``
        self.reading: deque[_Request] = deque()  # admitted, their prompts being read
        self.rows = Rows(self.device)  # decoding
        # submitted and not yet answered, under ``changed``: a request moving between the queues above is in none
        self.unanswered: list[Future[list[SampledTokens]]] = []
        # the latest requests' times to their first token
        self.first_token_s: deque[float] = deque(maxlen=1024)
        self.cancelled: set[str] = set()  # tenants whose requests leave at the next step, under ``changed``
        self.preempted = 0  # requests that gave up their room to another tenant's and started over
        self.closed = False
        self.thread: threading.Thread | None = None
        self.busy_since = time.monotonic()

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
        request = _Request(list(prompt), params, adapter, deadline, Future(), tenant=tenant)
        request.restart(self.device)
        with self.changed:
            if self.closed:
                raise Stopped("the sampling engine is closed")
            self.waiting.append(request)
            self.unanswered.append(request.future)
            self.changed.notify()
        return request.future

    def cancel(self, tenant: str) -> None:
        """Fail ``tenant``'s requests with ``Cancelled``; their rows leave the batch at the next step."""
        with self.changed:
            self.cancelled.add(tenant)
            self.changed.notify()

    def start(self, name: str = "sampling-engine") -> None:
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def drain(self) -> None:
        """Run until every submitted request is answered."""
        while self._has_work():
            self.step()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop between two steps; every request not yet answered fails with ``Stopped``."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        if self.thread is not None:
            self.thread.join(timeout_s)
        self._remove(lambda _: True, lambda: Stopped("the sampling engine stopped"))

    def _serve(self) -> None:
        while True:
            with self.changed:
                while not self.closed and not self._has_work() and not self.cancelled:
                    self.changed.wait()
                if self.closed:
                    return
            self.step()

    def busy(self) -> bool:
        """Whether a request is not yet answered (asked of another thread, while this one may be moving one)."""
        with self.changed:
            self.unanswered = [future for future in self.unanswered if not future.done()]
            return bool(self.unanswered)

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
                self._decode()
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
        with self.changed:
            tenants, self.cancelled = self.cancelled, set()
        if tenants:
            self._remove(lambda r: r.tenant in tenants, lambda: Cancelled("its session ended"))

    def _remove(self, which: Callable[[_Request], bool], error: Callable[[], Exception]) -> None:
        """Take the requests ``which`` names out of every queue and the batch, each failed with ``error()``."""
        with self.changed:
            gone = [r for r in self.waiting if which(r)]
            for request in gone:
                self.waiting.remove(request)
        gone += [r for r in self.reading if which(r)]
        self.reading = deque(r for r in self.reading if not which(r))
        in_batch = [r for r in self.rows.requests if which(r)]
        self.rows.drop(in_batch)
        for request in [*gone, *in_batch]:
            _fail(request, error())

    def _admit(self, preempt: bool = True) -> None:
        """As ``scheduler.next_admission`` rules: the requests it admits start reading their prompts, those it
        preempts (when ``preempt``) go back to the head of the queue to start over."""
        while True:
            with self.changed:
                flight = [*self.reading, *self.rows.requests]
                admitted, preempted = scheduler.next_admission(self.waiting, flight, self.kv_tokens, preempt)
                if admitted is None and preempted is None:
                    return
                if admitted is not None:
                    self.waiting.remove(admitted)
                    self.reading.append(admitted)
                    continue
            assert preempted is not None
            self._preempt(preempted)

    def _preempt(self, request: _Request) -> None:
        """Out of the batch (or the prompts being read) and back to the head of the queue, to start over."""
        if request in self.reading:
            self.reading.remove(request)
        else:
            self.rows.drop([request])
        request.restart(self.device)
        with self.changed:
            self.waiting.appendleft(request)
        self.preempted += 1

    def _read_prompts(self) -> None:
        """Up to ``prefill_chunk`` prompt tokens, oldest request first, the unread prompts of its length that fit
        beside it in the same pass (a client's group of prompts arrives together); a prompt read joins the
        batch."""
        budget = self.prefill_chunk
        while budget > 0 and self.reading:
            head = self.reading[0]
            count = min(budget, len(head.prompt) - head.read)
            batch = _beside(self.reading, head, count, budget)
            tokens = torch.tensor([r.prompt[r.read : r.read + count] for r in batch], device=self.device)
            positions = torch.arange(head.read, head.read + count, device=self.device)[None]
            try:
                with _adapted([(1, r.adapter) for r in batch]):
                    logits, kv = self.decoder.step(tokens, head.kv, None, positions.expand(len(batch), -1))
            except Exception as error:
                for request in batch:
                    self.reading.remove(request)
                    _fail(request, error)
                continue
            budget -= count * len(batch)
            for i, request in enumerate(batch):
                request.read += count
                request.kv = [(k[i : i + 1], v[i : i + 1]) for k, v in kv]
            if head.read < len(head.prompt):
                return
            for i, request in enumerate(batch):
                self._join(request, logits[i : i + 1])

    def _join(self, request: _Request, logits: torch.Tensor) -> None:
        """Its prompt read: it and its twins draw their first tokens and join the batch, its keys and values
        shared, as one request's samples share them."""
        # (still counted as reading, so never preempted here) those that arrived while it was read: its twins
        # read nothing
        self._admit(preempt=False)
        self.reading.remove(request)
        self.reading, twins = _same_prompt(self.reading, request)
        kv, request.kv = request.kv, None
        for twin in twins:
            twin.read = len(twin.prompt)
        joining = []
        for r in (request, *twins):
            self.first_token_s.append(time.monotonic() - r.submitted)
            if len(first := r.first(logits)):
                joining.append((r, first))
        if joining:
            assert kv is not None
            self.rows.join(joining, kv)

    def _decode(self) -> None:
        """One token for every row; the rows whose samples stop leave the batch."""
        rows = self.rows
        logits = rows.step(self.decoder)
        keep, start = [], 0
        for request in list(rows.requests):
            count = len(request.live)
            generators = [request.generators[i] for i in request.live]
            tokens, logprobs = request.params.draw(logits[start : start + count], generators)
            topk = request.top(logits[start : start + count])
            rows.last[start : start + count] = tokens.to(rows.last.device)
            going = []
            for row, (sample, t, lp, tk) in enumerate(
                zip(request.live, tokens.tolist(), logprobs.tolist(), topk, strict=True)
            ):
                if request.record(sample, t, lp, tk):
                    going.append(sample)
                    keep.append(start + row)
            request.live = going
            start += count
            if not going:
                rows.requests.remove(request)
                request.future.set_result(request.result())
        if len(keep) < len(rows.last):
            rows.keep(keep)


class Rows:
    """The running batch: its requests' rows in order, their keys and values padded on the left to the longest."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: list[_Request] = []
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None  # [rows, positions]: False on the left padding; None when none
        self.positions = torch.zeros(0, dtype=torch.long)  # each row's next position
        self.last = torch.zeros(
            0, dtype=torch.long
        )  # each row's newest token, not yet in the keys and values

    def join(self, joining: list[tuple[_Request, torch.Tensor]], kv: KV) -> None:
        """Add the live samples of requests of one prompt, each with its samples' first tokens drawn, the
        prompt's keys and values shared by all (in one pass over the batch's: 32 one-sample requests of one prompt
        joined one by one copied them 32 times)."""
        tokens = torch.cat([first for _, first in joining])
        rows, length = len(tokens), len(joining[0][0].prompt)
        shared = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in kv]
        if self.kv is None:
            self.kv, self.mask = shared, None
        else:
            held = self.kv[0][0].shape[2]
            width = max(held, length)
            self.kv = [
                (
                    torch.cat([_pad(k, width - held), _pad(jk, width - length)]),
                    torch.cat([_pad(v, width - held), _pad(jv, width - length)]),
                )
                for (k, v), (jk, jv) in zip(self.kv, shared, strict=True)
            ]
            real = torch.ones(rows, length, dtype=torch.bool, device=self.device)
            mask = self.mask
            if mask is None:
                mask = torch.ones(len(self.last), held, dtype=torch.bool, device=self.device)
            mask = torch.cat([F.pad(mask, (width - held, 0)), F.pad(real, (width - length, 0))])
            self.mask = None if bool(mask.all()) else mask
        self.positions = torch.cat([self.positions, torch.full((rows,), length, dtype=torch.long)])
        self.last = torch.cat([self.last, tokens.to(self.last.device)])
        self.requests += [request for request, _ in joining]

    def step(self, decoder: Decoder) -> torch.Tensor:
        """The logits [rows, vocab] after every row's newest token, which joins its keys and values."""
        mask = self.mask
        if mask is not None:
            mask = torch.cat([mask, torch.ones(len(self.last), 1, dtype=torch.bool, device=self.device)], 1)
        with _adapted([(len(r.live), r.adapter) for r in self.requests]):
            logits, self.kv = decoder.step(
                self.last[:, None].to(self.device), self.kv, mask, self.positions[:, None].to(self.device)
            )
        self.mask, self.positions = mask, self.positions + 1
        return logits

    def drop(self, requests: list[_Request]) -> None:
        """Take ``requests``' rows out of the batch."""
        if not requests:
            return
        keep, start = [], 0
        for request in self.requests:
            if request not in requests:
                keep += range(start, start + len(request.live))
            start += len(request.live)
        self.requests = [r for r in self.requests if r not in requests]
        self.keep(keep)

    def keep(self, rows: list[int]) -> None:
        """Only ``rows`` of the batch stay; positions every row pads are cut."""
        if not rows:
            self.kv, self.mask = None, None
            self.positions, self.last = self.positions[:0], self.last[:0]
            return
        index = torch.tensor(rows, dtype=torch.long)
        device_index = index.to(self.device)
        self.positions, self.last = self.positions[index], self.last[index]
        kv = [(k.index_select(0, device_index), v.index_select(0, device_index)) for k, v in self.kv or []]
        if self.mask is not None:
            mask = self.mask[device_index]
            first = int(mask.any(0).nonzero()[0])  # the leftmost position some row still reads
            kv = [(k[:, :, first:], v[:, :, first:]) for k, v in kv]
            mask = mask[:, first:]
            self.mask = None if bool(mask.all()) else mask
        self.kv = kv


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


def _beside(reading: deque[_Request], head: _Request, count: int, budget: int) -> list[_Request]:
    """``head`` and, when it reads its whole prompt at once, the unread other prompts of ``reading`` of its length
    that the budget reads with it (a prompt's twins read none: ``_same_prompt``)."""
    batch = [head]
    if head.read or count < len(head.prompt):
        return batch
    prompts = {tuple(head.prompt)}
    for request in reading:
        if (len(batch) + 1) * count > budget:
            break
        if request.read == 0 and len(request.prompt) == count and tuple(request.prompt) not in prompts:
            batch.append(request)
            prompts.add(tuple(request.prompt))
    return batch


def _same_prompt(reading: deque[_Request], request: _Request) -> tuple[deque[_Request], list[_Request]]:
    """The requests of ``reading`` waiting to read the very prompt ``request`` has just read, with the same adapter
    (``reading`` without them, and them): they need no pass of their own (clients that send a group's samples one
    request each, as the Tinker Cookbook's RL loop does, read each prompt once)."""
    # an adapter is its layers by path, built again for each request: the same layers are the same weights
    twins = [
        r for r in reading if r.read == 0 and r.adapter == request.adapter and r.prompt == request.prompt
    ]
    return (deque(r for r in reading if r not in twins) if twins else reading), twins


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values [B, heads, positions, head_dim] with ``width`` more positions on the left."""
    return F.pad(tensor, (0, 0, width, 0)) if width else tensor


def _adapted(segments: list[tuple[int, lora.Adapter | None]]) -> contextlib.AbstractContextManager[None]:
    """The rows' adapters, when any of them has one."""
    if all(adapter is None for _, adapter in segments):
        return contextlib.nullcontext()
    return lora.rows(segments)


def _fail(request: _Request, error: BaseException) -> None:
    if not request.future.done():
        request.future.set_exception(error)


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
