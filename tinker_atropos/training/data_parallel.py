"""Data-parallel learning, the maths side (``trainer.learners`` > 1): each learner holds its own share of a batch,
steps through it in as many minibatches as the others, and every step's gradient is the whole minibatch's, made of
every learner's rows, as DDP with a distributed sampler makes it (CleanRL's ppo_atari_multigpu, RLlib's learner
group). ``Group`` is what an update asks of the other learners: sums over all of them, in one all-reduce per step.
Starting the learners, linking them and handing them their shares is the trainer's (``trainer/learner_replicas.py``):
the all-reduce is handed in, so that no transport is reached from here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    """This process's place among the learners, and how it sums a tensor with theirs."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], object]  # sums a tensor over the learners, in place, on every one

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the learners (a copy; the same on every one)."""
        total = value.detach().clone()
        self.all_reduce(total)
        return total

    def count(self, value: int) -> int:
        """An integer summed over the learners: rows, env steps."""
        return int(self.sum(torch.tensor(value, dtype=torch.int64)).item())

    def reduce_step(
        self, parameters: list[torch.nn.Parameter], stats: dict[str, float], weight: float
    ) -> dict[str, float]:
        """A minibatch step's gradients and figures, each learner's (means over its rows) weighted by ``weight``,
        its share of the minibatch's rows, and summed, in one flat all-reduce: the gradient and the figures of the
        whole minibatch's mean on every learner, so that each steps the same parameters and takes the same
        decision on a figure (``target_kl``'s stop)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        names = sorted(stats)
        figures = torch.tensor([stats[name] for name in names], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), figures]) * weight
        self.all_reduce(flat)
        offset = 0
        for parameter, grad in zip(parameters, grads, strict=True):
            parameter.grad = flat[offset : offset + grad.numel()].view_as(grad)
            offset += grad.numel()
        return dict(zip(names, flat[offset:].tolist(), strict=True))
