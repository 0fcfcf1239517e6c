"""The run's shared token on every gRPC call: a server interceptor checks ``authorization: Bearer <token>``, a
client interceptor sends it. The token comes from a file named by ``TA_TOKEN_FILE`` (``up`` writes one per run,
mode 0600, and passes its path to the services it starts) or from ``TA_TOKEN``; never from the YAML config,
which is printed back. Without either, calls are not authenticated (a service bound to loopback, as tests and
single-user machines run them).

Health checks are left open on purpose: Kubernetes' gRPC probes cannot send metadata, and a health answer
reveals nothing. Every other call without the token is refused with UNAUTHENTICATED and counted.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from tinker_atropos.runtime import FatalError

log = logging.getLogger(__name__)

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes of the methods served without the token


def service_token() -> str | None:
    """The run's token, from ``TA_TOKEN_FILE`` or ``TA_TOKEN``; None when neither is set."""
    path = os.environ.get("TA_TOKEN_FILE")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as error:
            raise FatalError(f"TA_TOKEN_FILE {path}: {error.strerror}") from None
        if not token:
            raise FatalError(f"TA_TOKEN_FILE {path} is empty")
        return token
    return os.environ.get("TA_TOKEN") or None


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer <token>`` (compared in constant time)."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()
        self.refused = 0
        self._lock = threading.Lock()
        self._refuse = grpc.unary_unary_rpc_method_handler(self._abort)
        self._refuse_stream = grpc.stream_stream_rpc_method_handler(self._abort_stream)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHODS):
            return continuation(details)
        given = next((v for k, v in details.invocation_metadata if k == "authorization"), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return continuation(details)
        with self._lock:
            self.refused += 1
        log.warning("refused %s: %s token", details.method, "no" if not given else "a wrong")
        handler = continuation(details)
        return self._refuse_stream if handler is not None and handler.request_streaming else self._refuse

    @staticmethod
    def _abort(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service needs the run's token (TA_TOKEN_FILE)")

    @staticmethod
    def _abort_stream(requests: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service needs the run's token (TA_TOKEN_FILE)")


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """``channel`` sending ``token`` on every call (unchanged without one)."""
    return channel if token is None else grpc.intercept_channel(channel, _SendToken(token))
