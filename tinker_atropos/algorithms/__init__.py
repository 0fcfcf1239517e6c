"""Learning algorithms, registered by name for ``trainer.algorithm`` (see ``core``); the built-ins register here."""

from tinker_atropos.algorithms import appo, ppo, sac  # noqa: F401 - register "appo", "ppo", "sac"
