"""The running batch of the continuous-batching engine: the decoding rows of every request whose prompt is read,
their keys and values padded on the left to the longest, and the step that draws one token for each (vLLM's running
sequences and their model pass). Which requests join or leave it is the engine's call."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tinker_atropos.models import lora
from tinker_atropos.sampling.params import Decoder
from tinker_atropos.sampling.request_state import KV, Request


class Rows:
    """The running batch: its requests' rows in order, their keys and values padded on the left to the longest."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: list[Request] = []
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None  # [rows, positions]: False on the left padding; None when none
        self.positions = torch.zeros(0, dtype=torch.long)  # each row's next position
        self.last = torch.zeros(
            0, dtype=torch.long
        )  # each row's newest token, not yet in the keys and values

    def join(self, joining: list[tuple[Request, torch.Tensor]], kv: KV) -> None:
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

    def decode(self, decoder: Decoder) -> None:
        """One token for every row; the rows whose samples stop leave the batch, and a request none of whose
        samples goes on leaves it answered."""
        logits = self.step(decoder)
        keep, start = [], 0
        for request in list(self.requests):
            count = len(request.live)
            tokens, going = request.next(logits[start : start + count])
            self.last[start : start + count] = tokens.to(self.last.device)
            keep += [start + row for row in going]
            start += count
            if not going:
                self.requests.remove(request)
        if len(keep) < len(self.last):
            self.keep(keep)

    def step(self, decoder: Decoder) -> torch.Tensor:
        """The logits [rows, vocab] after every row's newest token, which joins its keys and values."""
        mask = self.mask
        if mask is not None:
            mask = torch.cat([mask, torch.ones(len(self.last), 1, dtype=torch.bool, device=self.device)], 1)
        with adapted([(len(r.live), r.adapter) for r in self.requests]):
            logits, self.kv = decoder.step(
                self.last[:, None].to(self.device), self.kv, mask, self.positions[:, None].to(self.device)
            )
        self.mask, self.positions = mask, self.positions + 1
        return logits

    def drop(self, requests: list[Request]) -> None:
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


def adapted(segments: list[tuple[int, lora.Adapter | None]]) -> contextlib.AbstractContextManager[None]:
    """The rows' adapters, when any of them has one: a batch of the base alone runs without the rows' hook."""
    if all(adapter is None for _, adapter in segments):
        return contextlib.nullcontext()
    return lora.rows(segments)


def _pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values [B, heads, positions, head_dim] with ``width`` more positions on the left."""
    return F.pad(tensor, (0, 0, width, 0)) if width else tensor
