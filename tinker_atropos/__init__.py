"""tinker-atropos: RL training as three services (trainer, rollout, environment) over gRPC and Redis."""

import os

# Our processes fork only to exec another program (a service, Valkey). grpcio >= 1.81's fork handlers can restart
# a poller thread in such a child, which then fails on an epoll fd closed before exec and may never start the
# program (grpc/grpc#43055; seen once in `make test`: a rollout that never started). No gRPC state needs to
# survive a fork here, so the handlers are off unless the environment says otherwise; grpc reads this on import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
