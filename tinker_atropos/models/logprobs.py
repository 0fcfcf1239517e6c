"""Target log-probabilities of a batch of sequences, what every training request of a served LM computes.

Sequences that begin alike (the answers to one prompt: a GRPO group) are forwarded with their common prefix once:
the prefix runs as one row, and every member's continuation reads its keys and values, as vLLM's prefix cache and
SGLang's RadixAttention share a prompt, here with gradients (autograd adds each member's through the one prefix).
Eight 10-token answers to a 45-token prompt forward 125 tokens instead of 440. Which sequences share what is
planned on the tokens alone (``plan``), so any client's data gain, and data that share nothing cost what one padded
batch did: two passes, every sequence's last token in the second.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tinker_atropos.models import lora

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [B, heads, positions, head_dim]
MAX_GROUP = 64  # sequences one prefix serves at most: bounds the planning's work, not what sharing saves


class Extender(Protocol):
    """A causal LM that continues keys and values (``TinyCausalLM``, ``smollm2.SmolLM2``)."""

    def extend(
        self, tokens: torch.Tensor, past: KV | None, mask: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """Logits [B, T, vocab] of ``tokens`` [B, T] at ``positions`` after ``past``, and the keys and values with
        theirs; ``mask`` [B, P + T] marks the real positions (None: all)."""
        ...


@dataclass(frozen=True)
class Group:
    members: list[int]  # indices of the sequences
    # their first ``shared`` tokens, forwarded once; each member keeps at least one token of its own
    shared: int


def plan(sequences: Sequence[Sequence[int]], owners: Sequence[int]) -> list[Group]:
    """Groups of sequences of one owner (an adapter: keys and values differ between models), chosen to forward
    the fewest tokens, padding counted: a group costs its prefix plus its members times its longest rest. Groups
    are runs of the sequences in sorted order (a run's common prefix is the least of its neighbours'), the best
    split found by dynamic programming; a sequence alone is a group of one."""
    order = sorted(range(len(sequences)), key=lambda i: (owners[i], tuple(sequences[i])))
    lengths = [len(sequences[i]) for i in order]
    # common[k]: the common prefix of order[k - 1] and order[k]; none across owners
    common = [0] + [
        _common_prefix(sequences[a], sequences[b]) if owners[a] == owners[b] else 0
        for a, b in zip(order, order[1:], strict=False)
    ]
    best = [0] + [0] * len(order)  # best[j]: the cheapest cost of the first j sequences
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best[end], start[end] = best[end - 1] + lengths[end - 1], end - 1  # alone
        shortest, longest, prefix = lengths[end - 1], lengths[end - 1], lengths[end - 1]
        for first in range(end - 2, max(-1, end - 1 - MAX_GROUP), -1):
            prefix = min(prefix, common[first + 1])
            if prefix == 0:
                break
            shortest, longest = min(shortest, lengths[first]), max(longest, lengths[first])
            shared = min(prefix, shortest - 1)
            cost = best[first] + shared + (end - first) * (longest - shared)
            if cost < best[end]:
                best[end], start[end] = cost, first
    groups: list[Group] = []
    end = len(order)
    while end:
        first = start[end]
        members = order[first:end]
        shared = min(
            min(lengths[first:end]) - 1,
            min(common[first + 1 : end], default=lengths[first] - 1),
        )
        groups.append(Group(members, shared))
        end = first
    return groups[::-1]


def target_logprobs(
    model: Extender,
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    adapters: Sequence[lora.Adapter | None] | None = None,
) -> list[torch.Tensor]:
    """log p(targets[t] | inputs[:t+1]) of each sequence, Tinker's convention (``model_input`` and next-token
    ``target_tokens`` of the same length), differentiable. ``adapters``: each sequence's model's LoRA layers,
    when the sequences of several models of one base run together (``lora.rows``); None: ``model``'s own.

    Two passes: every group's prefix, one row each, then every sequence's rest after its group's keys and values
    (right-padded: causal attention never reads the padding after a sequence; the padding of a shorter prefix is
    masked)."""
    if len(inputs) != len(targets) or not inputs:
        raise ValueError(
            f"need as many targets as inputs, at least one: got {len(inputs)} and {len(targets)}"
        )
    if any(len(x) != len(y) or len(x) == 0 for x, y in zip(inputs, targets, strict=True)):
        raise ValueError("each sequence needs at least one token and as many targets as inputs")
    owners = [id(a) for a in adapters] if adapters is not None else [0] * len(inputs)
    groups = plan([x.tolist() for x in inputs], owners)
    members = [i for g in groups for i in g.members]  # the second pass's rows: sequences, group by group
    device = inputs[0].device
    group_of = torch.tensor([n for n, g in enumerate(groups) for _ in g.members], device=device)
    shared = torch.tensor([g.shared for g in groups], device=device)[group_of]  # per row
    width = max(g.shared for g in groups)

    past, mask, heads = None, None, None
    if width:  # the prefixes, one row per group; then each row reads its group's keys and values
        prefixes = _pad([inputs[g.members[0]][: g.shared] for g in groups])
        with _rows(adapters, [g.members[0] for g in groups]):
            logits, kv = model.extend(
                prefixes, None, None, torch.arange(width, device=device).expand_as(prefixes)
            )
        # each row's targets in its group's prefix logits, less that position's logsumexp: [rows, width], no
        # [rows, width, vocab] copy of the prefix logits and no full-vocabulary log-softmax
        head_targets = _pad([targets[i][:g] for i, g in zip(members, shared.tolist(), strict=True)], width)
        picked = logits[group_of[:, None], torch.arange(width, device=device)[None], head_targets]
        heads = picked.to(_precision(logits.dtype)) - _logsumexp(logits)[group_of]
        past = [(keys[group_of], values[group_of]) for keys, values in kv]
        mask = (
            torch.arange(width, device=device)[None] < shared[:, None]
        )  # a shorter prefix's padding: masked

    # the rests, at their own positions after their prefix (a padded position repeats the last real one)
    rests = [inputs[i][g:] for i, g in zip(members, shared.tolist(), strict=True)]
    lengths = torch.tensor([len(r) for r in rests], device=device)
    steps = torch.arange(int(lengths.max()), device=device)[None]
    positions = shared[:, None] + torch.minimum(steps, lengths[:, None] - 1)
    if mask is not None:
        mask = torch.cat([mask, torch.ones(len(rests), steps.shape[1], dtype=torch.bool, device=device)], 1)
    with _rows(adapters, members):
        logits, _ = model.extend(_pad(rests), past, mask, positions)
    rest_targets = _pad([targets[i][g:] for i, g in zip(members, shared.tolist(), strict=True)])
    tails = selective_log_softmax(logits, rest_targets)  # [rows, longest rest]

    found: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
    for row, (i, g, n) in enumerate(zip(members, shared.tolist(), lengths.tolist(), strict=True)):
        found[i] = tails[row, :n] if heads is None else torch.cat([heads[row, :g], tails[row, :n]])
    return found


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``logits.log_softmax(-1).gather(-1, index[..., None])[..., 0]`` in float32 at least, differentiable, without
    the full-vocabulary log-softmax: only the targets' log-probs are needed, so the target logits are gathered and
    each row's logsumexp subtracted (as TRL's ``selective_log_softmax``). A log-softmax of [B, T, vocab] logits
    is another [B, T, vocab] tensor in float32 (autograd keeps it); this keeps [B, T]. ``index``: the target of
    each position, of ``logits``' shape less its last dimension."""
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked.to(_precision(logits.dtype)) - _logsumexp(logits)


def _precision(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: a bfloat16 model's logits lose the small log-probs otherwise."""
    return torch.promote_types(dtype, torch.float32)


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension (the vocabulary) in float32 at least. Logits narrower than float32 (a
    bfloat16 model's) go one row of the first dimension at a time, so that their float32 copy is one sequence's
    [T, vocab], never the batch's; float32 logits need no copy and go in one call."""
    dtype = _precision(logits.dtype)
    if logits.dim() <= 2 or logits.dtype == dtype:
        return torch.logsumexp(logits.to(dtype), -1)
    return torch.stack([torch.logsumexp(row.to(dtype), -1) for row in logits])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _pad(rows: list[torch.Tensor], width: int = 0) -> torch.Tensor:
    """Rows right-padded with 0 (a token never read: causal attention, or masked) to at least ``width``."""
    padded = nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return nn.functional.pad(padded, (0, max(0, width - padded.shape[1])))


@contextlib.contextmanager
def _rows(adapters: Sequence[lora.Adapter | None] | None, sequences: list[int]) -> Iterator[None]:
    """``lora.rows`` for a pass whose rows are ``sequences`` (runs of one adapter, as ``plan`` orders them)."""
    if adapters is None:
        yield
        return
    with lora.rows([(1, adapters[i]) for i in sequences]):  # neighbours of one adapter merge there
        yield
