"""Acting with published weights, knowing nothing of the algorithm that learned them: what a rollout calls on
every step. The spec published with the weights names the model (``spec["model"]``) and its shape; the policy
gives actions, their log-probabilities and, when it has a critic, values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tinker_atropos.models.array_library import ArrayLibrary
from tinker_atropos.models.spec import (
    LOG_STD_MAX,
    LOG_STD_MIN,
    MODEL,
    RMS_EPSILON,
    action_layout,
    mlp_state_shapes,
    squash_bounds,
)
from tinker_atropos.models.weight_bytes import load_weights, state_arrays, weights_from_bytes

if TYPE_CHECKING:
    import torch

    from tinker_atropos.models.mlp import ActorCritic


class InferencePolicy:
    """One version of a policy frozen for acting: what a rollout calls on every step.

    Built from the spec and the state dict as numpy arrays, the built-in MLP runs in the frozen form below; a user
    network (an ActorCritic subclass, ``models.networks``) or one with observation encoders runs as its own
    ``module``, in torch.

    A rollout runs the network on a few instances at a time, where the fixed cost per op outweighs the
    arithmetic, so the frozen form does fewer ops: actor and critic (if any) run as one MLP (first layers
    stacked, the others block-diagonal), the normalisers' statistics are cast once, and a Gaussian's log-prob comes from its
    standard-normal draw. On a CPU it computes with numpy, and torch is never imported: a rollout acts once per
    env round trip, after idling while the physics ran, and there a torch call costs about 3x a numpy one (483
    against 166 µs for 16 Humanoid instances). Elsewhere it keeps torch tensors on the device. One forward serves
    both: it uses only operations numpy and torch spell alike. Results equal the module's up to float rounding (a
    test compares them, for both libraries).
    """

    def __init__(
        self,
        spec: dict[str, Any],
        state: Mapping[str, np.ndarray],
        device: str | torch.device = "cpu",
        rng: np.random.Generator | None = None,
        library: Literal["numpy", "torch"] | None = None,
        module: ActorCritic | None = None,
    ) -> None:
        self.device = str(device)
        library = "torch" if module is not None else library or ("numpy" if self.device == "cpu" else "torch")
        self.arrays = ArrayLibrary(library, self.device, rng or np.random.default_rng())
        self.xp: Any = self.arrays.xp
        self.module = None if module is None else module.to(self.device).eval()
        action = action_layout(spec)
        self.discrete, self.action_start, self.squashed = action.discrete, action.start, action.squashed
        self.n_out = action.actor_outputs
        self.has_critic = bool(spec.get("critic", True))
        self.layers = [] if module is not None else self._fused_layers(state)
        self.activation = {
            "tanh": self.xp.tanh,
            "relu": lambda x: self.xp.clip(x, 0.0, None),
        }[spec["activation"]]
        self.obs_stats = (
            (self.arrays.parameter(state["obs_rms.mean"]), self.arrays.parameter(_rms_std(state, "obs_rms")))
            if spec["normalize_observations"]
            else None
        )
        self.return_std, self.return_mean = (
            (float(_rms_std(state, "return_rms")), float(state["return_rms.mean"]))
            if spec["normalize_returns"]
            else (1.0, 0.0)
        )
        if self.squashed:  # the actor outputs [mean, log std]; actions are scaled from [-1, 1] to the bounds
            self.action_dim = action.n
            mid, half_range = squash_bounds(spec)
            self.action_mid, self.action_half = self.arrays.parameter(mid), self.arrays.parameter(half_range)
            # log |d env action / d unit action|, and the Gaussian's constant, per draw
            self.log_prob_offset = -(
                float(np.log(half_range).sum()) + self.action_dim * 0.5 * math.log(2 * math.pi)
            )
        elif not self.discrete:
            log_std = np.asarray(state["actor_logstd"], dtype=np.float32).reshape(-1)
            self.action_std = self.arrays.parameter(np.exp(log_std))
            # log N(mean + std * eps | mean, std) = -eps^2 / 2 - log std - log sqrt(2 pi), summed over dimensions
            self.log_prob_offset = -(float(log_std.sum()) + self.n_out * 0.5 * math.log(2 * math.pi))

    @classmethod
    def of_model(
        cls,
        model: ActorCritic,
        device: str | torch.device = "cpu",
        rng: np.random.Generator | None = None,
        library: Literal["numpy", "torch"] | None = None,
    ) -> InferencePolicy:
        """The acting form of a network in memory (the trainer's evaluation, ``eval``, tests)."""
        from tinker_atropos.models.mlp import ActorCritic

        # the fused form knows the built-in MLP only: a user network or encoders act as their modules
        fusable = type(model) is ActorCritic and not model.encoded
        return cls(model.spec, state_arrays(model), device, rng, library, None if fusable else model)

    def _fused_layers(self, state: Mapping[str, np.ndarray]) -> list[tuple[Any, Any]]:
        """(weight, bias) of each layer of the MLP; with a critic, actor and critic as one wider layer."""
        actor = _linear_layers(state, "actor")
        if not self.has_critic:
            return [(self.arrays.parameter(weight.T), self.arrays.parameter(bias)) for weight, bias in actor]
        layers = []
        for depth, ((a, a_bias), (c, c_bias)) in enumerate(
            zip(actor, _linear_layers(state, "critic"), strict=True)
        ):
            weight = np.concatenate([a, c]) if depth == 0 else _block_diagonal(a, c)
            layers.append(
                (self.arrays.parameter(weight.T), self.arrays.parameter(np.concatenate([a_bias, c_bias])))
            )
        return layers

    def _forward(self, obs: Any) -> tuple[Any, Any]:
        """(actor output, value in return units or None without a critic)."""
        if self.module is not None:
            with self.xp.no_grad():
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
        out, value = self._forward(self.arrays.observations(obs))
        if self.discrete:
            z = out - xp.amax(out, axis=1, keepdims=True)
            log_p = z - xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
            if deterministic:
                index = xp.argmax(log_p, axis=1)
            else:  # inverse CDF: the first index whose cumulative probability reaches a uniform draw
                below = xp.cumsum(xp.exp(log_p), axis=1) < self.arrays.uniform((out.shape[0], 1))
                index = xp.clip(xp.sum(below, axis=1), None, self.n_out - 1)  # rounding can leave the sum < 1
            log_prob = log_p[xp.arange(out.shape[0]), index]
            actions = index + self.action_start
        elif self.squashed:
            mean, log_std = out[:, : self.action_dim], out[:, self.action_dim :]
            log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (xp.tanh(log_std) + 1)
            eps = self.arrays.normal(tuple(mean.shape), deterministic)
            unit = xp.tanh(mean + xp.exp(log_std) * eps)
            actions = self.action_mid + self.action_half * unit
            # log N(pre-tanh | mean, std), minus log(1 - tanh^2) and log half-range: the density of the env action
            log_prob = self.log_prob_offset - xp.sum(
                0.5 * eps * eps + log_std + xp.log(1 - unit * unit + 1e-6), axis=1
            )
        else:
            eps = self.arrays.normal(tuple(out.shape), deterministic)
            actions = out + self.action_std * eps
            log_prob = self.log_prob_offset - 0.5 * xp.sum(eps * eps, axis=1)
        return (
            self.arrays.numpy(actions),
            self.arrays.numpy(log_prob),
            None if value is None else self.arrays.numpy(value),
        )

    def value(self, obs: np.ndarray) -> np.ndarray:
        """Values in return units; only for a policy with a critic."""
        value = self._forward(self.arrays.observations(obs))[1]
        if value is None:
            raise ValueError("this policy has no critic")
        return self.arrays.numpy(value)


def _rms_std(state: Mapping[str, np.ndarray], normaliser: str) -> np.ndarray:
    """A running normaliser's standard deviation in float32, as ``RunningMeanStd.std``."""
    return np.sqrt(state[f"{normaliser}.var"] + RMS_EPSILON).astype(np.float32)


def _linear_layers(state: Mapping[str, np.ndarray], head: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight [out, in], bias) of the Linear layers of a head (an ``nn.Sequential``), in order."""
    depths = sorted(
        int(name.split(".")[1]) for name in state if name.startswith(f"{head}.") and name.endswith(".weight")
    )
    return [(state[f"{head}.{depth}.weight"], state[f"{head}.{depth}.bias"]) for depth in depths]


def _block_diagonal(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0] + c.shape[0], a.shape[1] + c.shape[1]), dtype=np.float32)
    out[: a.shape[0], : a.shape[1]], out[a.shape[0] :, a.shape[1] :] = a, c
    return out


def _check_model(spec: dict[str, Any], network: str) -> None:
    """ValueError for weights of a model or network other than this process's config names: refused before
    anything is imported, so that a weights record can never make a rollout import a module of its choice."""
    if spec.get("model", MODEL) != MODEL:
        raise ValueError(
            f"published weights of model {spec.get('model')!r}; this rollout acts with {MODEL!r}"
        )
    if spec.get("network", "mlp") != network:
        raise ValueError(
            f"published weights of network {spec.get('network')!r}; this rollout's trainer.model.network is "
            f"{network!r}"
        )


def load_network(spec: dict[str, Any], blob: bytes, network: str = "mlp") -> ActorCritic:
    """The network of published weights, in torch; ValueError for a model this package does not build, a spec
    that does not build one, or weights that do not load into it (or are not finite). ``network``: the one network
    this process's config names."""
    from tinker_atropos.models.networks import build_network

    _check_model(spec, network)
    try:
        model = build_network(spec)
    except ValueError as error:  # a spec of something else, or a user network that cannot be built
        raise ValueError(f"weights that do not fit their spec: {error}") from None
    load_weights(model, blob)
    return model


def load_policy(
    spec: dict[str, Any],
    blob: bytes,
    device: str | torch.device = "cpu",
    rng: np.random.Generator | None = None,
    network: str = "mlp",
) -> InferencePolicy:
    """The acting form of published weights (``load_network``'s checks and errors). The built-in MLP without
    encoders is read with numpy alone, its state checked name by name and shape by shape against its spec."""
    _check_model(spec, network)
    if network != "mlp" or "obs_layout" in spec:
        return InferencePolicy.of_model(load_network(spec, blob, network), device, rng)
    state = weights_from_bytes(blob)
    expected = mlp_state_shapes(spec)
    shapes = {name: array.shape for name, array in state.items()}
    if shapes != expected:
        wrong = sorted(
            name for name in expected.keys() | shapes.keys() if shapes.get(name) != expected.get(name)
        )
        raise ValueError(
            "weights that do not fit their spec: "
            + ", ".join(
                f"{name} is {shapes.get(name, 'missing')}, expected {expected.get(name, 'none')}"
                for name in wrong[:5]
            )
        )
    try:
        return InferencePolicy(spec, state, device, rng)
    except (KeyError, TypeError, ValueError) as error:  # a spec whose other fields do not fit (an activation)
        raise ValueError(f"a spec this rollout cannot act with: {type(error).__name__}: {error}") from None
