"""Env problems are found before anything starts: every form of `env.id` resolves, and a bad env is one line
and exit code 2 from `up` and from an env service, with no restarts."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import pytest

from tests.support.envs import NAN_PENDULUM_ID
from tests.support.running import cli, config_file
from tinker_atropos.config import parse_config
from tinker_atropos.environment.check import check_env
from tinker_atropos.errors import EnvError
from tinker_atropos.processes import free_port


@pytest.mark.parametrize(
    "env_id",
    ["Pendulum-v1", "tests.support.envs:NaNPendulum", f"tests.support.envs:{NAN_PENDULUM_ID}"],
    ids=["registered", "module:Class", "module:registered-id"],
)
def test_every_documented_form_of_env_id_resolves(env_id: str) -> None:
    spaces = check_env(parse_config({"env": {"id": env_id}}).env)
    assert spaces.observation_space.shape == (3,)
    assert isinstance(spaces.action_space, gym.spaces.Box)


BAD_ENVS = {
    "missing module": (
        {"id": "tests.support.no_such_module:Env"},
        "cannot import 'tests.support.no_such_module': ModuleNotFoundError",
    ),
    "missing class": (
        {"id": "tests.support.envs:NoSuchEnv"},
        "has no gymnasium.Env subclass 'NoSuchEnv' and registers no env id 'NoSuchEnv'",
    ),
    "bad kwargs": (
        {"id": "Pendulum-v1", "kwargs": {"gravity_typo": 9.8}},
        "unexpected keyword argument 'gravity_typo'",
    ),
    "Dict space": (
        {"id": "tests.support.envs:DictPendulum"},
        "a Dict's entries must be Box spaces (not 'mode')",
    ),
    "backend": (
        {"id": "Pendulum-v1", "backend": "mujoco"},
        "the mujoco backend does not implement 'Pendulum-v1'",
    ),
}


@pytest.mark.parametrize(("env", "message"), BAD_ENVS.values(), ids=BAD_ENVS.keys())
def test_check_env_names_the_problem_in_one_line(env: dict, message: str) -> None:
    with pytest.raises(EnvError) as error:
        check_env(parse_config({"env": env}).env)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["missing module", "bad kwargs", "Dict space"])
def test_up_refuses_a_bad_env_in_one_line_before_starting_anything(tmp_path: Path, name: str) -> None:
    env, message = BAD_ENVS[name]
    run_dir = tmp_path / "run"
    result = cli("up", str(config_file(tmp_path, env=env)), "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2, result.stdout[-2000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stdout[-2000:]
    assert result.stdout.strip() == errors[0]  # the one line alone, not after the resolved config
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()  # nothing was started nor written


@pytest.mark.integration
@pytest.mark.parametrize("name", ["missing class", "bad kwargs", "Dict space"])
def test_an_env_service_refuses_a_bad_env_in_one_line(tmp_path: Path, name: str) -> None:
    env, message = BAD_ENVS[name]
    config = config_file(tmp_path, env=env)
    # no Redis listens there: the env is checked before Redis is even looked for
    result = cli("env", "--config", str(config), "--redis-url", "redis://127.0.0.1:1/0", timeout=60)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.integration
@pytest.mark.parametrize("placeholder", ["api_url", "inference_url"])
def test_up_refuses_an_atropos_environment_handed_a_url_without_its_key(
    tmp_path: Path, placeholder: str
) -> None:
    # an older config: the bare URL carries no key, so the environment would exit on 401 until up gave up
    command = [
        "{python}",
        "examples/atropos_env.py",
        "serve",
        "--env.rollout_server_url",
        f"{{{placeholder}}}",
    ]
    config = config_file(
        tmp_path, "atropos-toy.yaml", atropos={"port": free_port(), "environments": [command]}
    )
    run_dir = tmp_path / "run"
    result = cli("up", str(config), "--run-dir", str(run_dir), timeout=60)
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stdout.startswith("error: atropos.environments[0] passes {" + placeholder + "}")
    assert "{atropos_config}" in result.stdout and "--insecure" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not run_dir.exists()  # nothing was started nor written
