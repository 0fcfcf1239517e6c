"""What a published spec says about its network, read with numpy alone: a rollout acting with the built-in MLP on
a CPU never imports torch (2 s of CPU and 180 MB per rollout process), and the model (``models.mlp``) builds
itself from the same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL = "mlp"  # the spec's "model": what ``models.acting`` builds from it
# A squashed Gaussian's log standard deviation, state-dependent, is kept in this range (as CleanRL's SAC)
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
RMS_EPSILON = 1e-8  # a running normaliser's std is sqrt(var + this)


@dataclass(frozen=True)
class ActionLayout:
    """How the actor's outputs map to env actions."""

    discrete: bool
    n: int  # classes, or action dimensions
    start: int  # Discrete(n, start): the env's actions are start..start+n-1, the categorical's 0..n-1
    squashed: bool  # the actor outputs a mean and a log standard deviation per action dimension

    @property
    def actor_outputs(self) -> int:
        return self.n * (2 if self.squashed else 1)


def action_layout(spec: dict[str, Any]) -> ActionLayout:
    action = spec["action"]
    discrete = action["kind"] == "discrete"
    return ActionLayout(
        discrete=discrete,
        n=int(action["n"]) if discrete else math.prod(action["shape"]),
        start=int(action.get("start", 0)) if discrete else 0,
        squashed=bool(action.get("squash", False)),
    )


def squash_bounds(spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A squashed policy's (midpoint, half range) of the action space, float32: env = mid + half * tanh(...)."""
    low, high = (np.asarray(spec["action"][k], dtype=np.float32) for k in ("low", "high"))
    return (high + low) / 2, (high - low) / 2


def mlp_state_shapes(spec: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The state dict of the built-in MLP a spec describes (without observation encoders), name to shape: what
    weights from Redis must hold exactly before a rollout acts with them. ValueError for a spec that describes
    no such network."""
    try:
        obs_dim, layout = math.prod(spec["obs_shape"]), action_layout(spec)
        hidden = [int(width) for width in spec["hidden_sizes"]]
        shapes: dict[str, tuple[int, ...]] = {}
        for normaliser, shape in (("obs_rms", (obs_dim,)), ("return_rms", ())):
            shapes |= {f"{normaliser}.mean": shape, f"{normaliser}.var": shape, f"{normaliser}.count": ()}
        heads = [("actor", layout.actor_outputs)]
        if spec.get("critic", True):
            heads.insert(0, ("critic", 1))
        for head, n_out in heads:  # nn.Sequential of Linear and activation: the Linears at even indices
            sizes = [obs_dim, *hidden, n_out]
            for depth, (n_in, width) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
                shapes |= {f"{head}.{2 * depth}.weight": (width, n_in), f"{head}.{2 * depth}.bias": (width,)}
        if not (layout.discrete or layout.squashed):
            shapes["actor_logstd"] = (1, layout.n)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"a spec that describes no MLP: {type(error).__name__}: {error}") from None
    return shapes
