"""The environment service's simulation backends (``base``: the interface and the registry ``env.backend`` names);
the built-ins register here, by reference: naming one imports neither MuJoCo nor a backend's module."""

from tinker_atropos.environment.backends.base import register

register("gymnasium", "tinker_atropos.environment.backends.gymnasium_batch:GymnasiumBatch")
register("mujoco", "tinker_atropos.environment.backends.mujoco_batch:MujocoBatch")
