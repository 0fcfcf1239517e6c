"""The run configuration: one YAML file per run, validated here, printed back resolved at start.

Every field has a default, so a config only says what differs. Swapping the env, the model or the algorithm's
hyper-parameters is a change of this file, never of code.

Each section lives in the module named after it, and every name is imported from here:

- ``run``: ``run`` and ``redis`` (RunSection, RedisSection);
- ``env``: ``env`` (EnvSection, check_registered);
- ``rollout``: ``rollout`` (RolloutSection);
- ``trainer``: ``trainer`` and the sections of learning in it, ``model``, ``checkpoint``, ``wandb``, ``evaluation``
  (TrainerSection, ModelSection, CheckpointSection, WandbSection, EvaluationSection), and its algorithm's section;
- ``tinker``: ``trainer.tinker`` (TinkerSection) and the language models the trainer builds (TINY_LM, SMOLLM2);
- ``atropos``: ``atropos`` and ``trainer.atropos`` (AtroposSection, AtroposTrainerSection);
- ``root``: the whole config and the checks across its sections (Config);
- ``loading``: reading, ``--set`` and the refusals (load_config, parse_config, apply_settings, ConfigError);
- ``field_types``: the value types several sections share (Device, Transport, Auto);
- ``validation_errors``: the line errors the sections' own checks raise.

An algorithm's hyper-parameters are its own section, in ``algorithms/*/config.py``; every section's base is
``tinker_atropos/sections.py``.
"""

from tinker_atropos.config.atropos import AtroposSection, AtroposTrainerSection
from tinker_atropos.config.env import EnvSection, check_registered
from tinker_atropos.config.field_types import Auto, Device, Transport
from tinker_atropos.config.loading import ConfigError, apply_settings, load_config, parse_config
from tinker_atropos.config.rollout import RolloutSection
from tinker_atropos.config.root import Config
from tinker_atropos.config.run import RedisSection, RunSection
from tinker_atropos.config.tinker import SDK_HEARTBEAT_S, SMOLLM2, TINY_LM, TinkerSection
from tinker_atropos.config.trainer import (
    CheckpointSection,
    EvaluationSection,
    ModelSection,
    TrainerSection,
    WandbSection,
)

__all__ = [
    "SDK_HEARTBEAT_S",
    "SMOLLM2",
    "TINY_LM",
    "AtroposSection",
    "AtroposTrainerSection",
    "Auto",
    "CheckpointSection",
    "Config",
    "ConfigError",
    "Device",
    "EnvSection",
    "EvaluationSection",
    "ModelSection",
    "RedisSection",
    "RolloutSection",
    "RunSection",
    "TinkerSection",
    "TrainerSection",
    "Transport",
    "WandbSection",
    "apply_settings",
    "check_registered",
    "load_config",
    "parse_config",
]
