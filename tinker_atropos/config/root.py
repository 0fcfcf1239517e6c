"""``Config``, the whole run config: its sections, the checks across them, and its YAML as a run prints it."""

from __future__ import annotations

import yaml
from pydantic import Field, PrivateAttr, model_validator

from tinker_atropos.config.atropos import AtroposSection
from tinker_atropos.config.env import EnvSection
from tinker_atropos.config.rollout import RolloutSection
from tinker_atropos.config.run import RedisSection, RunSection
from tinker_atropos.config.trainer import TrainerSection
from tinker_atropos.sections import Section


class Config(Section):
    run: RunSection = Field(default_factory=RunSection)
    redis: RedisSection = Field(default_factory=RedisSection)
    env: EnvSection = Field(default_factory=EnvSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    atropos: AtroposSection = Field(default_factory=AtroposSection)
    # what the launcher chose for the 'auto' sizes, and why (launcher/sizing.py); None: nothing was 'auto'
    _sizing: str | None = PrivateAttr(None)

    @property
    def sizing(self) -> str | None:
        return self._sizing

    @model_validator(mode="after")
    def _something_to_learn_from(self) -> Config:
        tinker, atropos = self.trainer.tinker, self.atropos
        if (
            tinker.enabled
            and atropos.enabled
            and atropos.port
            and (tinker.host, tinker.port) == (atropos.host, atropos.port)
        ):
            raise ValueError(
                f"trainer.tinker and atropos both bind {atropos.host}:{atropos.port}: give one another port"
            )
        if not (self.trainer.experience_loop or self.trainer.tinker.enabled or self.trainer.atropos.enabled):
            raise ValueError(
                "trainer.experience_loop, trainer.tinker.enabled and trainer.atropos.enabled are all "
                "false: the trainer would learn from nothing; enable one of them"
            )
        if self.trainer.experience_loop and self.trainer.atropos.enabled:
            raise ValueError(
                "trainer.atropos.enabled learns a language model from an Atropos API, "
                "trainer.experience_loop a policy from the env services: set experience_loop false"
            )
        if self.trainer.wandb.enabled and not self.trainer.tensorboard:
            raise ValueError("trainer.wandb.enabled needs trainer.tensorboard: W&B mirrors its event files")
        return self

    def to_yaml(self) -> str:
        """The resolved config as YAML, as it is printed and written to the run folder: a password in
        ``redis.url`` is masked (services get the real URL from ``TA_REDIS_URL``)."""
        from tinker_atropos.state.connection import masked

        data = self.model_dump(mode="json")
        if data["redis"]["url"]:
            data["redis"]["url"] = masked(data["redis"]["url"])
        return yaml.safe_dump(data, sort_keys=False)
