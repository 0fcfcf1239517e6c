# syntax=docker/dockerfile:1
#
# One image for every service; the sub-command picks the role:
#   docker run tinker-atropos:0.1.0 env|rollout|trainer|status ...
#
# Targets:
#   runtime (default)  CPU build of torch. Runs env, rollout and trainer.
#   trainer-cuda       CUDA build of torch, for a trainer (or rollout) on an NVIDIA GPU node. The torch wheels
#                      bundle the CUDA runtime, so the host only needs the driver and the NVIDIA container toolkit.
#
#   docker build -t tinker-atropos:0.1.0 .
#   docker build --target trainer-cuda -t tinker-atropos:0.1.0-cuda .

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1


# The dependency list alone, read from pyproject.toml: installing it in its own layer means that a code change
# rebuilds only the small layer with our wheel, not the one with torch.
FROM python AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt


FROM python AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY tinker_atropos ./tinker_atropos
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .


# PyPI's Linux x86_64 torch wheel is the CUDA build (several GB); the CPU index serves "2.13.0+cpu", which pip
# prefers over "2.13.0" for the same "torch==2.13.0" pin.
FROM python AS venv-cpu
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu -r /tmp/requirements.txt
COPY --from=wheel /wheels /tmp/wheels
# pip check fails the build if pyproject's dependencies changed in a way the requirements layer missed.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && /opt/venv/bin/pip check


FROM python AS venv-cuda
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/requirements.txt
COPY --from=wheel /wheels /tmp/wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && /opt/venv/bin/pip check


# What both final images share: an unprivileged user with a numeric id (Kubernetes' runAsNonRoot can only
# verify a numeric USER) and /runs, owned by that user, so that a fresh named volume mounted there is writable.
FROM python AS runtime-base
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
    && install -d -o app -g app /runs
# TA_HOST: in a container the services must listen on every interface, not only on loopback.
ENV PATH=/opt/venv/bin:$PATH \
    TA_HOST=0.0.0.0
WORKDIR /home/app
USER 10001:10001
# env, rollout, trainer, atropos-api (gRPC, the CLI's default ports); 8000 the Tinker API or the Atropos trajectory
# API (HTTP), 8001 the trainer's inference endpoint for Atropos environments
EXPOSE 50051 50052 50053 50054 8000 8001
ENTRYPOINT ["tinker-atropos"]
CMD ["--help"]


FROM runtime-base AS trainer-cuda
COPY --from=venv-cuda /opt/venv /opt/venv


# Last, so that a plain "docker build ." produces the CPU image.
FROM runtime-base AS runtime
COPY --from=venv-cpu /opt/venv /opt/venv
