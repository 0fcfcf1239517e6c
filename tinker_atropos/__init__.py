"""tinker-atropos: RL training as three services (trainer, rollout, environment) over gRPC and Redis."""

import os

# Our processes fork only to exec another program (a service, Valkey). grpcio >= 1.81's fork handlers can restart
# a poller thread in such a child, which then fails on an epoll fd closed before exec and may never start the
# program (grpc/grpc#43055; seen once in `make test`: a rollout that never started). No gRPC state needs to
# survive a fork here, so the handlers are off unless the environment says otherwise; grpc reads this on import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__all__ = ["RemoteSB3VecEnv", "RemoteVectorEnv"]


def __getattr__(name: str) -> object:
    """The Gymnasium and SB3 vector envs, imported on first use: ``import tinker_atropos`` stays light, and
    stable-baselines3 is needed only by whoever asks for ``RemoteSB3VecEnv``."""
    if name == "RemoteVectorEnv":
        from tinker_atropos.environment.vector_env import RemoteVectorEnv

        return RemoteVectorEnv
    if name == "RemoteSB3VecEnv":
        from tinker_atropos.environment.sb3 import RemoteSB3VecEnv

        return RemoteSB3VecEnv
    raise AttributeError(f"module 'tinker_atropos' has no attribute {name!r}")
