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
#
# No "# syntax=" line: BuildKit's built-in Dockerfile frontend has all this file uses, and the line would make
# every build fetch the frontend's image from Docker Hub, which fails where only a mirror can be reached.
#
# Build arguments, each with the public default:
#   PYTHON_IMAGE   Python 3.11 on Debian; any image with `python` 3.11, its venv module and a CA bundle at
#                  /etc/ssl/certs/ca-certificates.crt (make compose-check makes one with mmdebstrap where Docker
#                  Hub cannot be reached)
#   TORCH_INDEX    the index of the CPU build of torch (empty: none). PyPI's Linux x86_64 torch wheel is the CUDA
#                  build (several GB); the CPU index serves "2.13.0+cpu", which pip prefers over "2.13.0" for the
#                  same "torch==2.13.0" pin. Where that index cannot be reached, put the CPU wheel in
#                  deploy/wheelhouse/ and pass TORCH_INDEX= (make compose-check does).
# and one optional build secret:
#   pip-ca         the CA bundle pip trusts instead of the image's, for a proxy that intercepts TLS:
#                  docker build --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt ...
#                  A secret, not a file of the context, so that it is in no layer.

ARG PYTHON_IMAGE=python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1


# The stages that run pip: it trusts the system's CA bundle, which the secret pip-ca replaces where one is given.
FROM python AS build
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt


# The dependency list alone, read from pyproject.toml, for the dependencies' own layer (below).
FROM python AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt


# The dependencies in /opt/venv, and (stage `app`) the package in /opt/app: two layers of the final image, so that a
# code change rebuilds and ships the package's few MB and never the dependencies' 1.5 GB, which a copy of one venv
# holding both would (its layer changes with any file in it).
#
# The wheelhouse is a folder of the context (only a README where the index serves torch): mounted, not copied, so
# that the wheels are in no layer, and the layer is rebuilt only when its content changes.
FROM build AS deps-cpu
ARG TORCH_INDEX
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=deploy/wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install --find-links /wheelhouse ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        -r /tmp/requirements.txt


FROM build AS deps-cuda
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/requirements.txt


# The package alone, compiled to bytecode (a read-only root filesystem would have every start compile it again),
# with its console script, whose interpreter is /opt/venv/bin/python: the venv made here only to run pip has the
# path of the final images' dependencies. pip fetches the build backend (setuptools) from the index; it is a venv's
# pip because a base image need not have one (Debian's python3 has none).
FROM build AS app
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY tinker_atropos ./tinker_atropos
RUN --mount=type=secret,id=pip-ca,target=/etc/ssl/certs/ca-certificates.crt \
    python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps --target /opt/app .


# What both final images share: an unprivileged user with a numeric id (Kubernetes' runAsNonRoot can only
# verify a numeric USER) and /runs, owned by that user, so that a fresh named volume mounted there is writable.
FROM python AS runtime-base
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app --shell /usr/sbin/nologin app \
    && install -d -o app -g app /runs
# TA_HOST: in a container the services must listen on every interface, not only on loopback.
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/app \
    TA_HOST=0.0.0.0
WORKDIR /home/app
USER 10001:10001
# env, rollout, trainer, atropos-api (gRPC, the CLI's default ports); 8000 the Tinker API or the Atropos trajectory
# API (HTTP), 8001 the trainer's inference endpoint for Atropos environments
EXPOSE 50051 50052 50053 50054 8000 8001
ENTRYPOINT ["tinker-atropos"]
CMD ["--help"]


# pip check: the package's declared dependencies are what the dependencies' venv holds. --help: the console script
# starts (its interpreter, its imports), here rather than in a crash-looping container.
FROM runtime-base AS trainer-cuda
COPY --from=deps-cuda /opt/venv /opt/venv
COPY --from=app /opt/app /opt/app
RUN pip check && tinker-atropos --help > /dev/null


# Last, so that a plain "docker build ." produces the CPU image.
FROM runtime-base AS runtime
COPY --from=deps-cpu /opt/venv /opt/venv
COPY --from=app /opt/app /opt/app
RUN pip check && tinker-atropos --help > /dev/null
