"""The training core: a model, its optimizer and its policy version, and the primitives every driver drives.

``forward_backward`` runs a loss on the model and accumulates its gradients; ``optim_step`` applies them with
Adam (and clears them). An algorithm's update is a sequence of the two (PPO: one pair per minibatch), and so is
a Tinker client's training loop. ``publish_weights`` hands the model's weights and spec to whatever publishes
them (Redis for the rollouts), ``state_dict`` / ``load_state_dict`` are what a checkpoint holds. Nothing here
knows about a transport.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tinker_atropos.models.weight_bytes import weights_to_bytes

if TYPE_CHECKING:
    from tinker_atropos.training.data_parallel import Group

KEEP_SHADOW_BYTES = (
    16 << 20
)  # ``snapshot``'s copies kept between steps up to this size (the tiny LM's: 2 MB; not a
# SmolLM2 LoRA client's 30 MB, which every client of a base would hold between its steps)
LossFn = Callable[[nn.Module], tuple[torch.Tensor, dict[str, float]]]
# (version, weights, spec) -> the version published: higher than asked when another driver published above it
Publisher = Callable[[int, bytes, dict[str, Any]], int]


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's settings: Adam's, and an optional clip of the global gradient norm first."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = None


class TrainingCore:
    """``model`` (described by ``spec``, the JSON a rollout rebuilds it from) and everything that learns it.
    ``shared``: tensors of the model that other models hold too (a LoRA model's frozen base, one copy per base and
    device): never trained, never copied by ``snapshot``, never written by a restore or a ``load_state_dict``, and
    left out of ``state_dict``."""

    def __init__(
        self,
        model: nn.Module,
        spec: dict[str, Any],
        device: torch.device,
        shared: Iterable[torch.Tensor] = (),
    ) -> None:
        self.model, self.spec, self.device = model.to(device), spec, device
        self._shared = {id(t) for t in shared}
        self.version = 0
        # fused: one kernel per step for all parameters (not the default on CPU); PPO updates of Humanoid took
        # 0.93x the CPU time of foreach, which was itself faster than one kernel per parameter tensor. Its
        # settings are each step's (``optim_step``); its moments are created at the first one. AdamW: weight decay
        # decoupled, as Tinker's optim_step defines it; with weight decay 0 (PPO's) it is Adam to the bit.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), fused=True)
        self._shadow: list[torch.Tensor] = []  # ``snapshot``'s copies, reused from one step to the next
        self.group: Group | None = None  # the data-parallel learners it is one of (``trainer.learners`` > 1)

    def forward_backward(self, loss_fn: LossFn) -> dict[str, float]:
        """``loss_fn(model)`` -> (loss, metrics); the loss's gradients are added to the parameters' ``.grad``."""
        loss, metrics = loss_fn(self.model)
        loss.backward()
        return metrics

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Apply the accumulated gradients, then clear them; the gradient norm when it was clipped."""
        metrics = {}
        if adam.grad_clip_norm is not None:
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), adam.grad_clip_norm, foreach=True)
            metrics["grad_norm"] = float(norm)
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def discard_gradients(self) -> None:
        """Clear the accumulated gradients without a step (an update that stops before it)."""
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot(self) -> Callable[[], None]:
        """Copy what a step changes (the trained parameters, the buffers, the optimizer's moments, the version),
        in one fused copy into the copies of the step before: the non-finite guard takes one before every Tinker
        step. Returns what puts it all back exactly, dropping the moments a first step created."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        moments = [t for p in trained for t in self.optimizer.state.get(p, {}).values() if torch.is_tensor(t)]
        live = [p.detach() for p in trained] + [b for _, b in self.own_buffers() if b.is_floating_point()]
        live += moments
        shadow = self._shadow
        if len(live) != len(shadow) or any(a.shape != b.shape for a, b in zip(live, shadow, strict=True)):
            shadow = [t.detach().clone() for t in live]
        else:
            torch._foreach_copy_(shadow, live)
        # kept for the next step only while small: a fully trained LLM's would hold three times its weights
        self._shadow = shadow if sum(t.nbytes for t in shadow) <= KEEP_SHADOW_BYTES else []
        had_moments, version = {p for p in trained if p in self.optimizer.state}, self.version

        def restore() -> None:
            torch._foreach_copy_(live, shadow)
            for parameter in trained:
                if parameter not in had_moments:
                    self.optimizer.state.pop(parameter, None)
            self.version = version

        return restore

    def nonfinite(self) -> list[str]:
        """The trained parameters and the buffers that hold a NaN or an infinity (none after a sound update);
        frozen parameters (a LoRA model's base) cannot have changed. One fused pass looks at all of them (the check
        GradScaler runs on gradients, its scale 1: nothing changes), 0.03 ms on the tiny LM against 0.6 for one
        ``isfinite`` per tensor; the names are sought only when it found something."""
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        state = {**trained, **dict(self.own_buffers())}
        floating = {name: t.detach() for name, t in state.items() if t.is_floating_point()}
        if not floating:
            return []
        found, unit = torch.zeros(1, device=self.device), torch.ones(1, device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(floating.values()), found, unit)
        if not found.item():
            return []
        return [name for name, t in floating.items() if not bool(torch.isfinite(t).all())]

    def is_shared(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._shared

    def own_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The model's buffers but the shared ones (a shared base's rotary frequencies)."""
        return [(name, b) for name, b in self.model.named_buffers() if id(b) not in self._shared]

    def shared_names(self) -> set[str]:
        """The names, in the model's state dict, of the tensors it shares with other models."""
        named = [
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ]
        return {name for name, t in named if id(t) in self._shared}

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict without its shared tensors (a LoRA model's: its adapters)."""
        state = self.model.state_dict()
        for name in self.shared_names():
            state.pop(name, None)
        return state

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """``model_state``'s back; a state's entries for the shared tensors (a checkpoint of a full model, an older
        one holding the base) are skipped, never written into the tensors other models hold. A state that does not fit
        raises before anything is written (ValueError; RuntimeError from torch for a model sharing nothing)."""
        if not self._shared:
            self.model.load_state_dict(state)  # RuntimeError on a state that does not fit, as before
            return
        shared = self.shared_names()
        own = {name: value for name, value in state.items() if name not in shared}
        expected = set(self.model.state_dict()) - shared
        missing, unexpected = expected - set(own), set(own) - expected
        if missing or unexpected:
            raise ValueError(
                f"the state does not fit the model (missing {sorted(missing)[:3]}, unexpected "
                f"{sorted(unexpected)[:3]})"
            )
        self.model.load_state_dict(own, strict=False)

    def weights(self) -> bytes:
        return weights_to_bytes(self.model)

    def stood(self) -> None:
        """A step stood (the guard found nothing non-finite): the model is a new policy version, what rollouts,
        samplers and checkpoints name it by. The one place a step bumps the version."""
        self.version += 1

    def continue_above(self, version: int, adopt: bool = False) -> None:
        """Go on above ``version``, seen elsewhere (a checkpoint of another model, weights in Redis, a rollout's):
        the versions of a run only rise. ``adopt``: the core now holds that version's weights, so it is that
        version."""
        self.version = max(self.version, version if adopt else version + 1)

    def publish_weights(self, publish: Publisher) -> None:
        """Hand the current version's weights and spec to ``publish``; the core goes on from the version they were
        published as (the versions of every driver of a run share one sequence that only rises)."""
        self.version = publish(self.version, self.weights(), self.spec)

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "version": self.version,
            "model": self.model_state(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
