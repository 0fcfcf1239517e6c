"""Chunked prefill: the admitted requests whose prompts are being read, at most a chunk of tokens between two
decoding steps, so a long prompt delays the running batch by one chunk, not by the whole prompt. Unread prompts of
one length are read together, one pass of several rows; a prompt's twins (requests of the same prompt and adapter,
waiting to read it) read none and share its keys and values."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import torch

from tinker_atropos.sampling.params import Decoder
from tinker_atropos.sampling.request_state import KV, Request
from tinker_atropos.sampling.running_batch import adapted


class Prefill:
    """The requests whose prompts are being read, oldest first; iterated and counted as the queue it is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: deque[Request] = deque()

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def append(self, request: Request) -> None:
        self.requests.append(request)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def take(self, which: Callable[[Request], bool]) -> list[Request]:
        """Take the requests ``which`` names out, in their order."""
        taken = [r for r in self.requests if which(r)]
        if taken:
            self.requests = deque(r for r in self.requests if not which(r))
        return taken

    def read(self, decoder: Decoder, budget: int) -> Iterator[tuple[Request, torch.Tensor]]:
        """Read up to ``budget`` prompt tokens, oldest request first, the unread prompts of its length that fit
        beside it in the same pass (a client's group of prompts arrives together); each request whose prompt is
        then read, with its last logits [1, vocab], while it is still here (``finish`` takes it out). The
        requests of a pass that fails fail with its error."""
        while budget > 0 and self.requests:
            head = self.requests[0]
            count = min(budget, len(head.prompt) - head.read)
            batch = _beside(self.requests, head, count, budget)
            tokens = torch.tensor([r.prompt[r.read : r.read + count] for r in batch], device=self.device)
            positions = torch.arange(head.read, head.read + count, device=self.device)[None]
            try:
                with adapted([(1, r.adapter) for r in batch]):
                    logits, kv = decoder.step(tokens, head.kv, None, positions.expand(len(batch), -1))
            except Exception as error:
                for request in batch:
                    self.requests.remove(request)
                    request.fail(error)
                continue
            budget -= count * len(batch)
            for i, request in enumerate(batch):
                request.read += count
                request.kv = [(k[i : i + 1], v[i : i + 1]) for k, v in kv]
            if head.read < len(head.prompt):
                return
            for i, request in enumerate(batch):
                yield request, logits[i : i + 1]

    def finish(self, request: Request) -> tuple[KV, list[Request]]:
        """Its prompt read: its keys and values, and it and its twins (marked read) out of here. Clients that send a
        group's samples one request each, as the Tinker Cookbook's RL loop does, read each prompt once."""
        self.requests.remove(request)
        # an adapter is its layers by path, built again for each request: the same layers are the same weights
        twins = self.take(
            lambda r: r.read == 0 and r.adapter == request.adapter and r.prompt == request.prompt
        )
        for twin in twins:
            twin.read = len(twin.prompt)
        kv, request.kv = request.kv, None
        assert kv is not None
        return kv, [request, *twins]


def _beside(reading: deque[Request], head: Request, count: int, budget: int) -> list[Request]:
    """``head`` and, when it reads its whole prompt at once, the unread other prompts of ``reading`` of its length
    that the budget reads with it (a prompt's twins read none: ``Prefill.finish``)."""
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
