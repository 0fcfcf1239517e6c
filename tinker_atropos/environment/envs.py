"""What ``env.id`` names, resolved once: a registered Gymnasium id, ``module:EnvClass`` or ``module:registered-id``.

Backends build their instances through ``env_maker``; ``check.py`` builds one through the configured backend
before anything starts (``up``, each env service), so a bad id, a module that does not import, bad ``env.kwargs``
or a space the protocol does not carry is one line naming the problem, within seconds, instead of a crash loop or
a run that never steps.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec

from tinker_atropos.config import check_registered
from tinker_atropos.errors import EnvError


def env_maker(env_id: str) -> Callable[..., gym.Env]:
    """A function ``make(**kwargs)`` for ``env_id``, with gymnasium.make's wrappers in every form.

    ``module:EnvClass`` is made from an EnvSpec of the class (gymnasium.make itself would look the class name up
    as a registered id); ``module:registered-id`` imports the module, which registers the id.
    """
    if ":" not in env_id:
        check_registered(env_id)
        return lambda **kwargs: gym.make(env_id, **kwargs)
    module_name, _, name = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raises while it is imported
        raise EnvError(
            f"env.id {env_id!r}: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from None
    target = getattr(module, name, None)
    if isinstance(target, type) and issubclass(target, gym.Env):
        spec = EnvSpec(id=env_id, entry_point=target)
        return lambda **kwargs: gym.make(spec, **kwargs)
    if name in gym.registry:
        return lambda **kwargs: gym.make(name, **kwargs)
    raise EnvError(
        f"env.id {env_id!r}: module {module_name!r} has no gymnasium.Env subclass {name!r} and registers no "
        f"env id {name!r}"
    )


@dataclass(frozen=True)
class EnvSpaces:
    observation_space: gym.spaces.Box  # a Dict env's flat Box
    action_space: gym.spaces.Box | gym.spaces.Discrete
    observation_layout: gym.spaces.Dict | None = None  # the Dict a Dict env observes


def observation_layout(space: gym.Space) -> gym.spaces.Dict | None:
    """The Dict of Box entries an env observes (its observations then travel flattened), None for a Box."""
    if not isinstance(space, gym.spaces.Dict):
        return None
    odd = [key for key, entry in space.spaces.items() if not isinstance(entry, gym.spaces.Box)]
    if odd or not space.spaces:
        raise EnvError(
            f"observation space {space} is not supported: a Dict's entries must be Box spaces "
            f"(not {', '.join(map(repr, odd)) or 'none at all'})"
        )
    return space


def flat_box(layout: gym.spaces.Dict) -> gym.spaces.Box:
    """The float32 Box of a Dict's flattened observations (gymnasium.spaces.flatten, entries in key order)."""
    flat = gym.spaces.flatten_space(layout)
    return gym.spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32), dtype=np.float32)


def supported_spaces(observation_space: gym.Space, action_space: gym.Space) -> EnvSpaces:
    """The spaces the protocol and the policies carry: Box observations (a Dict of Boxes as its flat Box), Box
    or Discrete actions."""
    if not isinstance(observation_space, gym.spaces.Box):
        raise EnvError(f"observation space {observation_space} is not supported; supported: Box, Dict of Box")
    if not isinstance(action_space, gym.spaces.Box | gym.spaces.Discrete):
        raise EnvError(f"action space {action_space} is not supported; supported: Box, Discrete")
    return EnvSpaces(observation_space, action_space)
