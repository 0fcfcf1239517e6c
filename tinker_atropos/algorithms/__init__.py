"""Learning algorithms, registered by name for ``trainer.algorithm`` (see ``core``); the built-ins register here."""

from tinker_atropos.algorithms import ppo  # noqa: F401 - registers "ppo"
