"""``logprobs.selective_log_softmax``: the targets' log-probs without a full-vocabulary log-softmax are the full
one's, in float32 at least (also from bfloat16 logits), and their gradients are the full one's too."""

from __future__ import annotations

import pytest
import torch

from tinker_atropos.models.logprobs import selective_log_softmax


def _full(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """What the selective form replaces: every token's log-prob in float32 at least, then the targets'."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(wide, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("shape", [(3, 7, 50), (7, 50), (2, 3, 4, 50)], ids=["batch", "one-sequence", "4d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_targets_log_probs_and_gradients_are_the_full_log_softmaxs(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(shape, generator=gen) * 4).to(dtype)
    index = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    weights = torch.rand(shape[:-1], generator=gen)  # every position's gradient counts differently
    mine, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()

    got, want = selective_log_softmax(mine, index), _full(theirs, index)
    assert got.shape == want.shape == index.shape
    assert got.dtype == want.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(got, want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert mine.grad is not None and mine.grad.dtype == dtype and mine.grad.abs().sum() > 0
    torch.testing.assert_close(mine.grad, theirs.grad)
