from pathlib import Path

import pytest

from tests.support.running import REPO
from tinker_atropos.config import ConfigError, load_config, parse_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    config = load_config(path)
    assert parse_config(config.model_dump()) == config  # the resolved form reads back identically


def test_unknown_env_id_names_the_field_and_suggests() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"env": {"id": "Humanoid-v9"}}, "run.yaml")
    message = str(error.value)
    assert "run.yaml" in message
    assert "env.id: unknown Gymnasium env id 'Humanoid-v9'" in message
    assert "Humanoid-v5" in message


def test_invalid_values_name_each_field_and_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"env": {"backend": "bul let", "instances": 0}, "rollout": {"device": "tpu"}})
    message = str(error.value)
    assert (
        "env.backend: neither a registered backend's name (such as 'gymnasium', 'mujoco') nor 'module:Class' (got 'bul let')"
        in message
    )
    assert "env.instances: Input should be greater than or equal to 1, or 'auto' (got 0)" in message
    assert "rollout.device: allowed devices: cpu, cuda, cuda:N, auto (got 'tpu')" in message


@pytest.mark.parametrize("name", [".", "..", "../etc", "a/b", ""])
def test_a_run_name_is_one_folder_under_runs(name: str) -> None:
    """runs/.. would be the folder holding runs/: checkpoints, secrets and logs beside the code."""
    with pytest.raises(ConfigError, match=r"run\.name: "):
        parse_config({"run": {"name": name}})
    assert parse_config({"run": {"name": "pendulum.v2-seed_1"}}).run.name == "pendulum.v2-seed_1"


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.ppo\.learning_rat: unknown field"):
        parse_config({"trainer": {"ppo": {"learning_rat": 0.1}}})


def test_unreadable_and_non_mapping_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_defaults_fill_every_field() -> None:
    config = parse_config({})
    assert config.env.id == "Pendulum-v1"
    assert config.redis.url is None
    assert config.trainer.algorithm == "ppo" and config.trainer.hyperparameters.clip_coef == 0.2


def _field_paths(model, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    paths = []
    for name, field in model.model_fields.items():
        if field.exclude:  # trainer.hyperparameters: written as trainer.<algorithm>
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths += _field_paths(field.annotation, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def test_the_configuration_reference_documents_every_field() -> None:
    """The site's configuration reference is generated from the schema at each build (scripts/mkdocs_hooks.py):
    every field of the config and of each built-in algorithm's section has its row, with its default."""
    from scripts.mkdocs_hooks import config_reference, config_rows
    from tinker_atropos.algorithms import base as algorithms
    from tinker_atropos.config import Config

    page = config_reference()
    paths = _field_paths(Config)
    for name in algorithms.names():  # every built-in algorithm's section
        paths += _field_paths(algorithms.algorithm(name).hyperparameters, f"trainer.{name}.")
    missing = [p for p in paths if f"| `{p}` |" not in page]
    assert not missing, f"the configuration reference lacks {missing}"
    rows = {row[0]: row for _, section in config_rows() for row in section}
    assert len(rows) == len(paths)
    assert rows["env.instances"][1:4] == ("int | 'auto'", "16", "≥ 1; ≤ 4096; `auto`")
    assert rows["rollout.flow_control"][3] == "`pause`, `drop`"
    assert rows["trainer.device"][3] == "cpu, cuda, cuda:N, auto"  # what its validator refuses others with
    assert rows["trainer.ppo.target_kl"][1:3] == ("float | null", "null")
    assert rows["trainer.appo.update_epochs"][2] == "2"  # each algorithm's own defaults


def test_an_algorithm_is_chosen_by_name_and_its_section_validated_by_its_own_model() -> None:
    config = parse_config({"trainer": {"algorithm": "ppo", "ppo": {"clip_coef": 0.1}}})
    assert config.trainer.hyperparameters.clip_coef == 0.1
    assert parse_config(config.model_dump()) == config  # written back as trainer.ppo
    assert config.model_dump()["trainer"]["ppo"]["clip_coef"] == 0.1
    with pytest.raises(ConfigError) as error:
        parse_config({"trainer": {"algorithm": "sacc", "ppo": {"clip_coef": -1}}}, "run.yaml")
    message = str(error.value)
    assert "trainer.algorithm: unknown algorithm 'sacc'; registered: appo, ppo, sac" in message
    with pytest.raises(ConfigError, match=r"trainer\.ppo\.clip_coef: Input should be greater than 0"):
        parse_config({"trainer": {"ppo": {"clip_coef": -1}}})


def test_total_instances_counts_every_env_service_that_up_starts() -> None:
    config = parse_config({"run": {"name": "t"}, "env": {"id": "Pendulum-v1", "instances": 8, "services": 3}})

    assert config.env.total_instances == 24


def test_a_yaml_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("run:\n  name: x\nenv:\n  id: [Pendulum-v1\n")
    with pytest.raises(ConfigError) as error:
        load_config(bad)
    assert str(error.value).startswith(f"config {bad}:5:1 is not valid YAML: ")
    assert "<unicode string>" not in str(error.value)


def test_a_misspelt_field_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"trainer": {"samples_per_updat": 10, "ppo": {"learning_rat": 0.1}}, "envv": {}})
    message = str(error.value)
    assert "trainer.samples_per_updat: unknown field; did you mean 'samples_per_update'?" in message
    assert "trainer.ppo.learning_rat: unknown field; did you mean 'learning_rate'?" in message
    assert "envv: unknown field; did you mean 'env'?" in message


def test_a_field_nothing_resembles_lists_the_fields_of_its_section() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.zzz: unknown field \(fields here: replicas, "):
        parse_config({"rollout": {"zzz": 1}})


def test_settings_are_dotted_paths_to_yaml_values_over_the_file() -> None:
    pendulum = REPO / "configs" / "pendulum.yaml"
    config = load_config(
        pendulum,
        [
            "trainer.ppo.learning_rate=3e-4",
            "trainer.model.hidden_sizes=[32, 32]",
            "trainer.ppo.target_kl=null",
            "env.kwargs.g=9.81",
            "run.seed=7",
        ],
    )
    hp = config.trainer.hyperparameters
    assert (hp.learning_rate, hp.target_kl, hp.gamma) == (3e-4, None, 0.9)  # gamma: the file's
    assert config.trainer.model.hidden_sizes == [32, 32] and config.env.kwargs == {"g": 9.81}
    assert config.run.seed == 7 and config.run.name == "pendulum"


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        (
            ("--set", "trainer.ppo.learnin_rate=1e-3", "--set", "rollout.flow_control=stop", "--seed", "3"),
            [
                "trainer.ppo.learnin_rate: unknown field; did you mean 'learning_rate'?",
                "rollout.flow_control: Input should be 'pause' or 'drop' (got 'stop')",
            ],
        ),
        (("--set", "run.name.first=x"), ["--set 'run.name.first=x': run.name is a value, not a section"]),
    ],
    ids=["fields", "path"],
)
def test_a_bad_setting_on_up_names_the_field_and_exits_2_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], messages: list[str]
) -> None:
    from tests.support.running import REPO, cli

    run_dir = tmp_path / "run"
    result = cli("up", str(REPO / "configs" / "pendulum.yaml"), "--run-dir", str(run_dir), *args, timeout=60)
    assert result.returncode == 2 and all(m in result.stderr for m in messages), result.stderr
    assert not run_dir.exists()


def test_an_unknown_key_that_is_no_identifier_is_an_unknown_field() -> None:
    """A YAML key such as ``0# a comment: text`` is no union branch of a field: named as an unknown field."""
    with pytest.raises(ConfigError, match=r"  0# a: b: unknown field \(fields here: run, "):
        parse_config({"0# a: b": "text"})


@pytest.mark.parametrize("name", ["tiny-byte-lm", "HuggingFaceTB/SmolLM2-135M-Instruct", "mlp-gaussian/x"])
def test_a_model_folder_cannot_take_a_built_in_models_name(name: str) -> None:
    """Served under SmolLM2's name, a folder replaced the packaged model, while an export of its checkpoint was
    built on the packaged one."""
    with pytest.raises(ConfigError) as error:
        parse_config({"trainer": {"tinker": {"base_models": {name: "/models/mine"}}}})
    assert (
        f"trainer.tinker.base_models: {name!r} names a model this server builds itself (a folder under it would "
        "replace that model); choose another name" in str(error.value)
    )
