"""`auto` sizes (launcher/sizing.py): the run sized from the cores and the measured cost of an env step, the
config's own numbers kept, and `up` saying what it chose."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml

from tests.support.running import REPO, cli, config_file, leftovers
from tinker_atropos.config import ConfigError, parse_config
from tinker_atropos.launcher import sizing
from tinker_atropos.launcher.cli import read_config
from tinker_atropos.launcher.sizing import size_run

HUMANOID = {"id": "Humanoid-v5", "backend": "mujoco", "threads": 1}
AUTO = {"services": "auto", "instances": "auto"}


def sized(cores: float, step_us: float, env: dict | None = None, rollout: dict | None = None):
    config = parse_config(
        {"env": {**HUMANOID, **AUTO, **(env or {})}, "rollout": {"replicas": "auto", **(rollout or {})}}
    )
    result = size_run(config, cores, step_us, config.rollout.sessions_per_env)
    return result.services, result.instances, result.replicas


def test_humanoid_fills_two_cores_as_measured_best_and_a_sixteen_core_box_with_it() -> None:
    assert sized(2, 450) == (2, 9, 1)  # configs/humanoid.yaml's measured best on 2 cores: 2 services of 8
    assert sized(16, 450) == (13, 9, 3)  # one core left to the trainer and Valkey
    assert sized(16, 545) == (13, 7, 3)  # at the 16-core box's own cost per step
    assert sized(1, 450) == (1, 9, 1)


def test_a_cheap_env_gets_big_batches_and_more_of_the_cpu_for_acting() -> None:
    services, instances, replicas = sized(16, 10)
    assert instances == sizing.MAX_INSTANCES
    assert replicas > sized(16, 450)[2], "acting is a bigger share of a cheap step"
    assert services + replicas <= 16
    assert sized(2, 5000)[1] == sizing.MIN_INSTANCES


def test_numbers_in_the_config_are_kept_and_the_rest_sized_around_them() -> None:
    assert sized(16, 450, env={"instances": 4}) == (12, 4, 5)  # smaller batches: acting costs more per step
    assert sized(16, 450, env={"services": 3})[0] == 3
    assert sized(16, 450, env={"services": 1}, rollout={"sessions_per_env": 2})[2] == 2, (
        "no more than the slots"
    )
    assert sized(16, 450, rollout={"replicas": 7})[2] == 7
    assert sized(16, 450, env={"threads": 2})[0] == 7  # a service of 2 simulation threads takes 2 cores


def test_the_cores_are_the_affinity_capped_by_a_cgroup_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing.os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setattr(sizing, "_cgroup_quota", lambda: 6.5)
    assert sizing.usable_cores() == 6.5
    monkeypatch.setattr(sizing, "_cgroup_quota", lambda: None)
    assert sizing.usable_cores() == 16


def test_auto_is_refused_where_a_number_is_out_of_range_and_named_otherwise() -> None:
    with pytest.raises(ConfigError, match=r"env\.services.*'auto'"):
        parse_config({"env": {"services": "many"}})
    with pytest.raises(ConfigError, match=r"rollout\.replicas"):
        parse_config({"rollout": {"replicas": -1}})


def test_a_config_read_by_any_command_has_its_auto_sizes_measured_here(tmp_path: Path) -> None:
    path = config_file(tmp_path, "cartpole.yaml", env=AUTO, rollout={"replicas": "auto"})
    config = read_config(path)
    assert isinstance(config.env.services, int) and isinstance(config.rollout.replicas, int)
    assert config.env.instances == sizing.MAX_INSTANCES  # a CartPole step is far below 4 ms / 64
    assert config.sizing.startswith("sized for ") and "µs of CPU" in config.sizing
    written = yaml.safe_load(config.to_yaml())  # what `up` writes for the services it starts
    assert (written["env"]["services"], written["env"]["instances"], written["rollout"]["replicas"]) == (
        config.env.services,
        config.env.instances,
        config.rollout.replicas,
    )

    bad = config_file(tmp_path, "cartpole.yaml", env={**AUTO, "id": "tests.support.envs:NoSuchEnv"})
    with pytest.raises(typer.Exit):
        read_config(bad)


@pytest.mark.integration
def test_up_prints_what_it_sized_and_runs_it(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "configs" / "pendulum.yaml").read_text())
    config["env"] |= {"services": "auto"}
    config["rollout"] = {**config.get("rollout", {}), "replicas": "auto"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    result = cli("up", str(path), "--run-dir", str(run_dir), "--total-steps", "2000", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("auto: sized for "))
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    services, replicas = written["env"]["services"], written["rollout"]["replicas"]
    assert (
        f"{services} env service(s) of {written['env']['instances']} instances and {replicas} rollout(s)"
        in line
    )
    assert len(list((run_dir / "logs").glob("env-[0-9]*.log"))) == services
    assert len(list((run_dir / "logs").glob("rollout-*.log"))) == replicas
    assert leftovers(run_dir) == ""
