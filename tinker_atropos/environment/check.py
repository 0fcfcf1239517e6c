"""The check every env passes before it is served: one instance built through its backend, reset and closed, its
spaces supported and its first observations finite. ``up`` runs it before anything starts, and the env service at
its start, so that a bad env is one line and exit code 2, not a crash loop."""

from __future__ import annotations

from typing import Any

import numpy as np

from tinker_atropos.environment.backends.base import make_env_batch
from tinker_atropos.environment.envs import EnvSpaces, supported_spaces
from tinker_atropos.errors import EnvError


def check_env(env: Any) -> EnvSpaces:
    """Build, reset and close one instance of the ``env`` config section through its backend; its spaces.

    Raises EnvError with one line naming the problem: the id, the import, the kwargs, the backend or a space.
    """
    try:
        batch = make_env_batch(env.backend, env.id, env.kwargs, 1, 1)
    except EnvError:
        raise
    except Exception as error:  # the env's own constructor: bad kwargs, a missing asset, a backend limit
        raise EnvError(
            f"cannot make {env.id!r} with env.kwargs {env.kwargs} (backend {env.backend!r}): "
            f"{type(error).__name__}: {error}"
        ) from None
    try:
        spaces = supported_spaces(batch.observation_space, batch.action_space)
        spaces = EnvSpaces(spaces.observation_space, spaces.action_space, batch.observation_layout)
        try:
            observations = batch.reset(0)
        except Exception as error:
            raise EnvError(f"{env.id!r} fails on reset: {type(error).__name__}: {error}") from None
        if observations.shape[1:] != spaces.observation_space.shape:
            raise EnvError(
                f"{env.id!r} returns observations of shape {observations.shape[1:]}, its observation space "
                f"says {spaces.observation_space.shape}"
            )
        if not np.isfinite(observations).all():
            raise EnvError(f"{env.id!r} returns a NaN or infinite observation right after reset")
        return spaces
    finally:
        batch.close()
