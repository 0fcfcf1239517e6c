"""Gymnasium spaces <-> Protobuf ``Space``, and validation of incoming action batches against them."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from tinker_atropos.protocol import tensors
from tinker_atropos.protocol.v1 import environment_pb2


def space_to_proto(space: gym.Space) -> environment_pb2.Space:
    if isinstance(space, gym.spaces.Box):
        return environment_pb2.Space(
            box=environment_pb2.Box(
                shape=space.shape,
                dtype=tensors.dtype_code(space.dtype),
                low=tensors.encode(space.low),
                high=tensors.encode(space.high),
            )
        )
    if isinstance(space, gym.spaces.Discrete):
        return environment_pb2.Space(
            discrete=environment_pb2.Discrete(n=int(space.n), start=int(space.start))
        )
    if isinstance(space, gym.spaces.Dict):
        entries = list(space.spaces.items())
        return environment_pb2.Space(
            dict=environment_pb2.Dict(
                keys=[key for key, _ in entries], spaces=[space_to_proto(entry) for _, entry in entries]
            )
        )
    raise ValueError(f"unsupported space {space}; supported: Box, Discrete, Dict")


def space_from_proto(message: environment_pb2.Space) -> gym.Space:
    kind = message.WhichOneof("kind")
    if kind == "box":
        box = message.box
        dtype = tensors.numpy_dtype(box.dtype)
        return gym.spaces.Box(tensors.decode(box.low), tensors.decode(box.high), tuple(box.shape), dtype)
    if kind == "discrete":
        return gym.spaces.Discrete(message.discrete.n, start=message.discrete.start)
    if kind == "dict":
        entries = message.dict
        if len(entries.keys) != len(entries.spaces) or len(set(entries.keys)) != len(entries.keys):
            raise ValueError("a Dict space needs one space per key and distinct keys")
        if any(entry.WhichOneof("kind") == "dict" for entry in entries.spaces):
            raise ValueError("a Dict space's entries cannot be Dicts")  # nor nest as deep as a sender likes
        # a list of pairs keeps the wire's order (a plain dict would be sorted by key)
        return gym.spaces.Dict(
            [(key, space_from_proto(entry)) for key, entry in zip(entries.keys, entries.spaces, strict=True)]
        )
    raise ValueError(f"unsupported space kind {kind!r}")


class ActionError(ValueError):
    """An action batch that does not fit the action space; the message says what was expected."""


def check_actions(actions: np.ndarray, space: gym.Space, num_instances: int) -> np.ndarray:
    """Validate a decoded action batch and return what the backend steps with (Box actions are clipped)."""
    if isinstance(space, gym.spaces.Box):
        expected = (num_instances, *space.shape)
        if actions.shape != expected:
            raise ActionError(f"actions must have shape {expected}, got {actions.shape}")
        if actions.dtype.kind != "f":
            raise ActionError(f"Box actions must be float32 or float64, got {actions.dtype}")
        if not np.isfinite(actions).all():
            bad = sorted({int(i) for i in np.argwhere(~np.isfinite(actions))[:, 0]})
            raise ActionError(f"actions contain NaN or infinity (instances {bad})")
        return np.clip(actions, space.low, space.high).astype(space.dtype, copy=False)
    if isinstance(space, gym.spaces.Discrete):
        if actions.shape != (num_instances,):
            raise ActionError(f"actions must have shape {(num_instances,)}, got {actions.shape}")
        if actions.dtype.kind not in "iu":
            raise ActionError(f"Discrete actions must be integers, got {actions.dtype}")
        low, high = int(space.start), int(space.start + space.n - 1)
        if actions.size and (actions.min() < low or actions.max() > high):
            raise ActionError(
                f"Discrete actions must lie in [{low}, {high}], got {actions.min()}..{actions.max()}"
            )
        return actions.astype(np.int64, copy=False)
    raise ActionError(f"unsupported action space {space}")
