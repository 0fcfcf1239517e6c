"""Acting with published weights, knowing nothing of the algorithm that learned them: what a rollout calls on
every step. The spec published with the weights names the model (``spec["model"]``) and its shape; the policy
gives actions, their log-probabilities and, when it has a critic, values.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tinker_atropos.models.mlp import LOG_STD_MAX, LOG_STD_MIN, MODEL, ActorCritic
from tinker_atropos.models.networks import build_network
from tinker_atropos.models.weights import weights_from_bytes


class InferencePolicy:
    """One version of an ActorCritic frozen for acting: what a rollout calls on every step.

    A user network (an ActorCritic subclass, ``models.networks``) or one with observation encoders runs as its
    own modules, in torch; the built-in MLP runs in the frozen form below.

    A rollout runs the network on a few instances at a time, where the fixed cost per op outweighs the
    arithmetic, so the frozen form does fewer ops: actor and critic (if any) run as one MLP (first layers
    stacked, the others block-diagonal), the normalisers' statistics are cast once, and a Gaussian's log-prob comes from its
    standard-normal draw. On a CPU it computes with numpy: a rollout acts once per env round trip, after
    idling while the physics ran, and there a torch call costs about 3x a numpy one (483 against 166 µs for
    16 Humanoid instances). Elsewhere it keeps torch tensors on the device. One forward serves both: it uses
    only operations numpy and torch spell alike. Results equal the module's up to float rounding (a test
    compares them, for both libraries).
    """

    @torch.no_grad()
    def __init__(
        self,
        model: ActorCritic,
        device: torch.device,
        rng: np.random.Generator | None = None,
        library: Literal["numpy", "torch"] | None = None,
    ) -> None:
        spec = model.spec
        self.discrete, self.action_start, self.device = model.discrete, model.action_start, device
        # the fused form knows the built-in MLP only: a user network or encoders act as their modules
        fusable = type(model) is ActorCritic and not model.encoded
        self.module = None if fusable else model.to(device).eval()
        if self.module is not None:
            library = "torch"
        self.xp: Any = {"numpy": np, "torch": torch}[
            library or ("numpy" if device.type == "cpu" else "torch")
        ]
        self.rng = rng or np.random.default_rng()
        self.has_critic = model.has_critic
        self.n_out = model.actor_outputs
        self.layers = [] if self.module is not None else self._fused_layers(model)
        self.activation = {
            "tanh": self.xp.tanh,
            "relu": lambda x: self.xp.clip(x, 0.0, None),
        }[spec["activation"]]
        self.obs_stats = (
            (self._array(model.obs_rms.mean), self._array(model.obs_rms.std()))
            if spec["normalize_observations"]
            else None
        )
        ret_std, ret_mean = (
            (model.return_rms.std().item(), model.return_rms.mean.item())
            if spec["normalize_returns"]
            else (1.0, 0.0)
        )
        self.return_std, self.return_mean = ret_std, ret_mean
        self.squashed = model.squashed
        if self.squashed:  # the actor outputs [mean, log std]; actions are scaled from [-1, 1] to the bounds
            self.action_dim = self.n_out // 2
            self.action_mid, self.action_half = (
                self._array(model.action_mid),
                self._array(model.action_half_range),
            )
            # log |d env action / d unit action|, and the Gaussian's constant, per draw
            self.log_prob_offset = -(
                model.action_half_range.log().sum().item() + self.action_dim * 0.5 * math.log(2 * math.pi)
            )
        elif not self.discrete:
            log_std = model.actor_logstd.reshape(-1)
            self.action_std = self._array(log_std.exp())
            # log N(mean + std * eps | mean, std) = -eps^2 / 2 - log std - log sqrt(2 pi), summed over dimensions
            self.log_prob_offset = -(log_std.sum().item() + self.n_out * 0.5 * math.log(2 * math.pi))

    def _fused_layers(self, model: ActorCritic) -> list[tuple[Any, Any]]:
        """(weight, bias) of each layer of the MLP; with a critic, actor and critic as one wider layer."""
        actor = [m for m in model.actor if isinstance(m, nn.Linear)]
        if not self.has_critic:
            return [(self._array(a.weight.T), self._array(a.bias)) for a in actor]
        critic = [m for m in model.critic if isinstance(m, nn.Linear)]
        layers = []
        for depth, (a, c) in enumerate(zip(actor, critic, strict=True)):
            weight = torch.cat([a.weight, c.weight]) if depth == 0 else torch.block_diag(a.weight, c.weight)
            layers.append((self._array(weight.T), self._array(torch.cat([a.bias, c.bias]))))
        return layers

    def _array(self, tensor: torch.Tensor) -> Any:
        """A float32 parameter in this policy's library, contiguous, on its device; detached, so acting records
        no autograd graph and needs no inference_mode around it (a cost on every step)."""
        tensor = tensor.detach().float().contiguous()
        return tensor.numpy().copy() if self.xp is np else tensor.to(self.device)

    def _input(self, obs: np.ndarray) -> Any:
        if self.xp is np:
            return np.asarray(obs, dtype=np.float32)
        return torch.as_tensor(obs, dtype=torch.float32, device=self.device)

    def _output(self, array: Any) -> np.ndarray:
        return array if self.xp is np else array.cpu().numpy()

    def _noise(self, shape: tuple[int, ...], deterministic: bool) -> Any:
        """A Gaussian's standard-normal draw; zeros (its mean) when acting deterministically."""
        if self.xp is np:
            return (
                np.zeros(shape, np.float32)
                if deterministic
                else self.rng.standard_normal(shape, dtype=np.float32)
            )
        return (torch.zeros if deterministic else torch.randn)(shape, device=self.device)

    def _uniform(self, shape: tuple[int, ...]) -> Any:
        if self.xp is np:
            return self.rng.random(shape, dtype=np.float32)
        return torch.rand(shape, device=self.device)

    def _forward(self, obs: Any) -> tuple[Any, Any]:
        """(actor output, value in return units or None without a critic)."""
        if self.module is not None:
            with torch.no_grad():
                module, normalised = self.module, self.module.normalize_obs(obs)
                value = (
                    module.denormalize_value(module.normalized_value(normalised)) if self.has_critic else None
                )
                return module.actor(normalised), value
        xp = self.xp
        x = obs.reshape(obs.shape[0], -1)
        if self.obs_stats is not None:
            mean, std = self.obs_stats
            x = xp.clip((x - mean) / std, -10.0, 10.0)
        *hidden, (last_weight, last_bias) = self.layers
        for weight, bias in hidden:
            x = self.activation(x @ weight + bias)
        out = x @ last_weight + last_bias
        if not self.has_critic:
            return out, None
        return out[:, : self.n_out], out[:, self.n_out] * self.return_std + self.return_mean

    def act(
        self, obs: np.ndarray, deterministic: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Sample actions; returns numpy (actions, behaviour log-probs, values in return units or None).
        ``deterministic``: the distribution's mode instead (the most likely class, the Gaussian's mean, or
        tanh of it scaled to the bounds), as evaluation acts; the log-probs are then those of the mode."""
        xp = self.xp
        out, value = self._forward(self._input(obs))
        if self.discrete:
            z = out - xp.amax(out, axis=1, keepdims=True)
            log_p = z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
            if deterministic:
                index = xp.argmax(log_p, axis=1)
            else:  # inverse CDF: the first index whose cumulative probability reaches a uniform draw
                below = xp.cumsum(xp.exp(log_p), axis=1) < self._uniform((out.shape[0], 1))
                index = xp.clip(xp.sum(below, axis=1), None, self.n_out - 1)  # rounding can leave the sum < 1
            log_prob = log_p[xp.arange(out.shape[0]), index]
            actions = index + self.action_start
        elif self.squashed:
            mean, log_std = out[:, : self.action_dim], out[:, self.action_dim :]
            log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (xp.tanh(log_std) + 1)
            eps = self._noise(tuple(mean.shape), deterministic)
            unit = xp.tanh(mean + xp.exp(log_std) * eps)
            actions = self.action_mid + self.action_half * unit
            # log N(pre-tanh | mean, std), minus log(1 - tanh^2) and log half-range: the density of the env action
            log_prob = self.log_prob_offset - xp.sum(
                0.5 * eps * eps + log_std + xp.log(1 - unit * unit + 1e-6), axis=1
            )
        else:
            eps = self._noise(tuple(out.shape), deterministic)
            actions = out + self.action_std * eps
            log_prob = self.log_prob_offset - 0.5 * xp.sum(eps * eps, axis=1)
        return self._output(actions), self._output(log_prob), None if value is None else self._output(value)

    def value(self, obs: np.ndarray) -> np.ndarray:
        """Values in return units; only for a policy with a critic."""
        value = self._forward(self._input(obs))[1]
        if value is None:
            raise ValueError("this policy has no critic")
        return self._output(value)


def load_network(spec: dict[str, Any], blob: bytes, network: str = "mlp") -> ActorCritic:
    """The network of published weights; ValueError for a model this package does not build, a spec that does
    not build one, or weights that do not load into it (or are not finite). ``network``: the one network this
    process's config names; a spec naming another is refused before anything is imported, so that a weights
    record can never make a rollout import a module of its choice."""
    if spec.get("model", MODEL) != MODEL:
        raise ValueError(
            f"published weights of model {spec.get('model')!r}; this rollout acts with {MODEL!r}"
        )
    if spec.get("network", "mlp") != network:
        raise ValueError(
            f"published weights of network {spec.get('network')!r}; this rollout's trainer.model.network is "
            f"{network!r}"
        )
    try:
        model = build_network(spec)
    except (
        ValueError
    ) as error:  # a spec of something else, or a user network that cannot be imported or built
        raise ValueError(f"weights that do not fit their spec: {error}") from None
    try:
        model.load_state_dict(weights_from_bytes(blob))
    except (KeyError, TypeError, RuntimeError) as error:  # a spec or state dict of something else
        raise ValueError(f"weights that do not fit their spec: {type(error).__name__}: {error}") from None
    return model


def load_policy(
    spec: dict[str, Any],
    blob: bytes,
    device: torch.device,
    rng: np.random.Generator | None = None,
    network: str = "mlp",
) -> InferencePolicy:
    """The acting form of published weights (``load_network``'s checks and errors)."""
    return InferencePolicy(load_network(spec, blob, network), device, rng)
