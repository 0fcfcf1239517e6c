"""Fuzzing the config loader: any values, any trainer fields and any file text validate and round-trip or are a
ConfigError naming the field, and a config that validates can be printed without its secrets."""

from __future__ import annotations

import copy
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz import fuzz
from tests.support.running import REPO
from tinker_atropos.algorithms import base as algorithms
from tinker_atropos.config import Config, ConfigError, load_config, parse_config

# -- the config loader (the config package) ------------------------------------------------------------------------
CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))
BASE_CONFIGS = [yaml.safe_load(path.read_text()) for path in CONFIG_FILES]
SECTIONS = {name: field.annotation for name, field in Config.model_fields.items()}
SECTIONS |= {
    f"trainer.{name}": field.annotation
    for name, field in SECTIONS["trainer"].model_fields.items()
    if isinstance(field.annotation, type) and field.annotation.__module__ == Config.__module__
}
SECTIONS["trainer.ppo"] = algorithms.algorithm("ppo").hyperparameters
# No ':' (a 'module:name' algorithm is imported while validating), '@' or brackets (a URL that masks differently)
plain_text = st.text(st.characters(blacklist_characters=":@[]", blacklist_categories=("Cs",)), max_size=12)
config_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | plain_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain_text, inner, max_size=3),
    max_leaves=6,
)
special_values = st.sampled_from(
    [
        0,
        -1,
        1,
        2**63,
        1e308,
        float("nan"),
        float("inf"),
        "",
        "cpu",
        "cuda:0",
        "auto",
        "ppo",
        "grpc",
        "drop",
        "mujoco",
        "CartPole-v1",
        [],
        {},
        True,
        "hyperparameters",
    ]
)


@st.composite
def config_dicts(draw: st.DrawFn) -> dict:
    """A shipped config with a field or two set to odd values, a section replaced or removed, or a field added
    that is no field of it (one or two edits, so that many still validate and are printed back)."""
    data = copy.deepcopy(draw(st.sampled_from(BASE_CONFIGS)))
    for _ in range(draw(st.integers(1, 2))):
        section = draw(st.sampled_from(sorted(SECTIONS)))
        *parents, last = section.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        op = draw(st.sampled_from(["field", "field", "section", "delete", "unknown", "unknown"]))
        if op == "section":
            node[last] = draw(config_values)
            continue
        if op == "delete":
            node.pop(last, None)
            continue
        if not isinstance(node.get(last), dict):
            node[last] = {}
        if op == "field":
            name = draw(st.sampled_from(sorted(SECTIONS[section].model_fields)))
        else:  # what a confused writer adds: a field of another section, a renamed or internal one, anything
            name = draw(
                st.sampled_from(["hyperparameters", "chunks_per_update", "ppo", "id", "url"]) | plain_text
            )
        node[last][name] = draw(special_values | config_values)
    return data


def check_config(data: dict) -> None:
    """The property: a ConfigError, or a Config that prints (`up` writes it to the run folder, and every service
    re-reads that file) and validates again, the same."""
    try:
        config = parse_config(data)
    except ConfigError:
        return
    assert parse_config(yaml.safe_load(config.to_yaml())) == config


@fuzz(250)
@given(data=config_dicts())
def test_a_config_of_any_values_validates_or_is_a_config_error_and_round_trips(data: dict) -> None:
    """Every section and field of the shipped configs, edited."""
    check_config(data)


TRAINER_NAMES = [*SECTIONS["trainer"].model_fields, "ppo", "chunks_per_update", "hyperparameters"]


@fuzz(150)
@given(
    trainer=st.dictionaries(
        st.sampled_from(TRAINER_NAMES) | plain_text, special_values | config_values, max_size=4
    )
)
def test_a_trainer_section_of_any_fields_validates_or_is_a_config_error_and_round_trips(
    trainer: dict,
) -> None:
    """The trainer section has the one hand-written validator (the algorithm's own section, renamed and internal
    fields): any mix of its fields and others."""
    check_config({"trainer": trainer})


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("configs")


YAML_CHARS = ":[]{}-&*!|>'\"#%@`,? \n\t" + string.ascii_letters[:6] + string.digits


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A shipped config file with characters replaced, inserted or deleted (YAML syntax among them)."""
    text = list(draw(st.sampled_from(CONFIG_FILES)).read_text())
    for _ in range(draw(st.integers(1, 6))):
        if not text:
            break
        at = draw(st.integers(0, len(text) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        if op == "replace":
            text[at] = draw(st.sampled_from(YAML_CHARS))
        elif op == "insert":
            text[at:at] = draw(st.text(st.sampled_from(YAML_CHARS), min_size=1, max_size=4))
        elif op == "delete":
            del text[at : at + draw(st.integers(1, 6))]
        else:
            del text[at:]
    return "".join(text) or draw(
        st.sampled_from(["", "[", "- 1", "{{", "\t", "!!python/object:os.system {}"])
    )


@fuzz(250)
@given(text=config_texts())
def test_a_config_file_of_any_text_loads_or_is_a_config_error(config_dir: Path, text: str) -> None:
    """What the loader promises on the command line: a Config, or a ConfigError that names the problem."""
    path = config_dir / "run.yaml"
    path.write_text(text)
    try:
        config = load_config(path)
    except ConfigError as error:
        assert str(error).startswith(("invalid config", "config", "cannot read config"))
        return
    assert isinstance(yaml.safe_load(config.to_yaml()), dict)


def test_config_inputs_the_fuzzer_found_are_config_errors(config_dir: Path) -> None:
    """Found by the fuzzer: deep YAML nesting raised RecursionError; a `hyperparameters` key in the trainer
    section validated into a config whose printing raised; an alias bomb made an error message of 10^7 items."""
    path = config_dir / "deep.yaml"
    path.write_text("run: " + "[" * 3000 + "]" * 3000)
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(path)
    for value in (None, {}, {"gamma": 0.5}):
        with pytest.raises(ConfigError, match="trainer.hyperparameters: unknown field"):
            parse_config({"trainer": {"hyperparameters": value}})
    bomb = ["x"] * 10
    for _ in range(7):
        bomb = [bomb] * 10  # 10^8 leaves, all the same list: cheap to hold, not to print
    with pytest.raises(
        ConfigError, match=r"run.name: Input should be a valid string \(got \[\[\["
    ) as refused:
        parse_config({"run": {"name": bomb}})
    assert len(str(refused.value)) < 500  # shown bounded, not all 10^8 leaves


def test_a_redis_url_the_config_accepts_can_be_printed() -> None:
    """A config that validates is printed by `up` and written to the run folder."""
    for url in ("redis://user:secret@host:port/0", "redis://user:secret@[::1"):
        try:
            config = parse_config({"redis": {"url": url}})
        except ConfigError:  # refused where it is validated: as good a fix
            continue
        assert "secret" not in config.to_yaml()
