"""Env backends are chosen like algorithms: a registered name (the built-ins register themselves) or
``module:Class`` for a third party's, built from a ``BatchSetup``; what is neither is refused by the config, and a
name nobody registered where the env is checked, before anything starts, naming the registered ones."""

from __future__ import annotations

import pytest

from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.environment.backends.base import BatchSetup, make_env_batch
from tinker_atropos.environment.backends.gymnasium_batch import GymnasiumBatch
from tinker_atropos.environment.check import check_env
from tinker_atropos.errors import EnvError


class Recorded(GymnasiumBatch):
    """A third party's backend: here the reference one, remembering what it was built from."""

    built: list[BatchSetup] = []

    def __init__(self, setup: BatchSetup) -> None:
        Recorded.built.append(setup)
        super().__init__(setup)


def test_a_third_party_backend_is_named_module_class_and_built_from_its_setup() -> None:
    batch = make_env_batch(f"{__name__}:Recorded", "CartPole-v1", {"max_episode_steps": 9}, 2, 3)
    assert isinstance(batch, Recorded) and batch.reset(0).shape == (2, 4)
    assert Recorded.built[-1] == BatchSetup("CartPole-v1", {"max_episode_steps": 9}, 2, 3)
    config = parse_config({"env": {"id": "CartPole-v1", "backend": f"{__name__}:Recorded"}})
    assert check_env(config.env).observation_space.shape == (4,)
    assert Recorded.built[-1] == BatchSetup("CartPole-v1", {}, 1, 1)


def test_a_backend_that_is_no_name_nor_module_class_is_refused_and_one_that_does_not_import_says_so() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"env": {"backend": "bullet/physics"}})
    assert "env.backend: neither a registered backend's name" in str(error.value)
    unknown = parse_config({"env": {"id": "CartPole-v1", "backend": "bullet"}})
    with pytest.raises(EnvError) as refused:
        check_env(unknown.env)
    assert str(refused.value) == (
        "env.backend 'bullet' is not a registered backend; registered: 'gymnasium', "
        "'mujoco', or 'module:Class' for a third party's"
    )
    config = parse_config({"env": {"id": "CartPole-v1", "backend": "no_such_module:Batch"}})
    with pytest.raises(
        EnvError, match="env.backend 'no_such_module:Batch' does not import: ModuleNotFoundError"
    ):
        check_env(config.env)
