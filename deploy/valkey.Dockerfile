# A Valkey image for compose.yaml where Docker Hub (valkey/valkey) cannot be reached: Debian's Valkey package, from
# bookworm-backports, on the Debian base make compose-check makes (BASE). It runs as compose.yaml runs the public
# image: as uid 999 in /data, `valkey-server` and `valkey-cli` on the PATH.
#
#   docker build -f deploy/valkey.Dockerfile --build-arg BASE=tinker-atropos-base/debian:bookworm \
#       -t tinker-atropos-base/valkey:8.0 deploy
#   VALKEY_IMAGE=tinker-atropos-base/valkey:8.0 docker compose up

ARG BASE=debian:bookworm-slim

FROM ${BASE}
# policy-rc.d: the package's scripts must not start a server during the build.
# hadolint ignore=DL3008
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && echo "deb http://deb.debian.org/debian bookworm-backports main" > /etc/apt/sources.list.d/backports.list \
    && apt-get update \
    && apt-get install -y --no-install-recommends -t bookworm-backports valkey-server valkey-tools \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && install -d -o 999 -g 999 /data
WORKDIR /data
USER 999:999
EXPOSE 6379
CMD ["valkey-server"]
