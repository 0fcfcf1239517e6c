"""What `make compose-check` runs inside containers of the image on the Compose project's network, where the
services are (no port is published on the host). Prints JSON lines on stdout.

    python compose_probe.py watch RUN             the run's registry and counters, a line every second, forever
    python compose_probe.py intrude HOST:PORT...  Redis and each gRPC port, tried without the run's secrets

`watch` reads Redis as the services do (TA_REDIS_URL, TA_REDIS_PASSWORD_FILE). `intrude` is a client on the network
without the password or the token: it tries Redis without AUTH, and each gRPC port in plaintext, over TLS without a
client certificate, and over mutual TLS (where TA_TLS_* name a certificate) without the token.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import grpc
import redis

from tinker_atropos.launcher.progress import RETURN_WINDOW
from tinker_atropos.state.connection import connect
from tinker_atropos.state.experience import read_stats, recent_episodes
from tinker_atropos.state.registry import live_services
from tinker_atropos.state.weights import published_version

# A method no service serves: the token check answers before the method is looked up, so every port refuses it
# with UNAUTHENTICATED where the transport let the call through.
UNSERVED = "/tinker_atropos.compose_check.v1.Probe/Unauthenticated"


def watch(run: str, interval_s: float = 1.0) -> None:
    client = connect(os.environ["TA_REDIS_URL"])
    while True:
        try:
            episodes = recent_episodes(client, run, RETURN_WINDOW)
            line = {
                "t": time.time(),
                "policy_version": published_version(client, run) or 0,
                "env_steps": read_stats(client, run).get("env_steps", 0),
                "mean_return": (
                    sum(e["return"] for e in episodes) / len(episodes)
                    if len(episodes) == RETURN_WINDOW
                    else None
                ),
                "services": [
                    {
                        "kind": record.kind,
                        "name": record.name,
                        "address": record.address,
                        "incarnation": record.incarnation,
                        "steps": record.figures.get("steps"),
                        "sessions": record.figures.get("sessions"),
                    }
                    for record in live_services(client, run)
                ],
            }
        except redis.RedisError as error:  # Redis restarting: say so, and go on
            line = {"t": time.time(), "error": str(error)}
        print(json.dumps(line), flush=True)
        time.sleep(interval_s)


def refused(address: str, credentials: grpc.ChannelCredentials | None) -> str | None:
    """The status code a call to ``address`` without the token gets (None when it succeeds)."""
    options = [("grpc.ssl_target_name_override", os.environ.get("TA_TLS_SERVER_NAME", "tinker-atropos"))]
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=options)
    )
    with channel:
        call = channel.unary_unary(UNSERVED, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=5)
        except grpc.RpcError as error:
            return error.code().name
    return None


def intrude(addresses: list[str]) -> None:
    host, port = os.environ.get("TA_REDIS_HOST", "redis"), int(os.environ.get("TA_REDIS_PORT", "6379"))
    try:
        redis.Redis(host=host, port=port, socket_timeout=5).ping()
        answer = "PONG"
    except redis.RedisError as error:
        answer = f"{type(error).__name__}: {error}"
    print(json.dumps({"target": f"{host}:{port}", "how": "redis without AUTH", "answer": answer}), flush=True)
    ca = Path(os.environ["TA_TLS_CA"]).read_bytes()
    ways: dict[str, grpc.ChannelCredentials | None] = {
        "plaintext": None,
        "TLS without a client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
    }
    if os.environ.get("TA_TLS_CERT"):
        cert, key = (Path(os.environ[name]).read_bytes() for name in ("TA_TLS_CERT", "TA_TLS_KEY"))
        ways["mutual TLS without the token"] = grpc.ssl_channel_credentials(ca, key, cert)
    for address in addresses:
        for how, credentials in ways.items():
            answer = refused(address, credentials) or "OK"
            print(json.dumps({"target": address, "how": how, "answer": answer}), flush=True)


if __name__ == "__main__":
    mode, *arguments = sys.argv[1:]
    if mode == "watch":
        watch(arguments[0])
    elif mode == "intrude":
        intrude(arguments)
    else:
        sys.exit(f"unknown mode {mode!r}: watch RUN or intrude HOST:PORT...")
