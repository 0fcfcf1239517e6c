"""What protects the gRPC links: TLS (optionally mutual) and the run's shared token on every call.

TLS comes from files named by environment variables, read by every service and client of the image:
``TA_TLS_CERT`` and ``TA_TLS_KEY`` (this process's certificate: a server serves TLS with it, a client presents it
for mutual TLS), ``TA_TLS_CA`` (the CA a client verifies servers against; set, every channel is TLS),
``TA_TLS_CLIENT_CA`` (set on a server, it requires client certificates signed by that CA) and
``TA_TLS_SERVER_NAME`` (the name a client checks in server certificates, for services that advertise pod IPs).
``tinker-atropos secrets`` makes a CA, a certificate and the token for a deployment.

The token: a server interceptor checks ``authorization: Bearer <token>``, a client interceptor sends it. It
comes from a file named by ``TA_TOKEN_FILE`` (``up`` writes one per run, mode 0600, and passes its path to the
services it starts) or from ``TA_TOKEN``; never from the YAML config, which is printed back. It also keys the
HMACs that sign experience and weights in Redis (``signing_key``). Without either, calls are not authenticated (a service bound to loopback, as tests and
single-user machines run them).

Health checks are left open on purpose: Kubernetes' gRPC probes cannot send metadata, and a health answer
reveals nothing. Every other call without the token is refused with UNAUTHENTICATED and counted.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from tinker_atropos.errors import FatalError
from tinker_atropos.logs import CountedWarnings, peer_host

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes of the methods served without the token


def _read(variable: str) -> bytes | None:
    """The file named by ``variable``; None when unset. FatalError (one line) when it cannot be read."""
    path = os.environ.get(variable)
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise FatalError(f"{variable} {path}: {error.strerror}") from None
    if not data.strip():
        raise FatalError(f"{variable} {path} is empty")
    return data


def _own_certificate() -> tuple[bytes, bytes] | None:
    cert, key = _read("TA_TLS_CERT"), _read("TA_TLS_KEY")
    if (cert is None) != (key is None):
        raise FatalError(
            "TA_TLS_CERT and TA_TLS_KEY go together: set both (certificate and its key) or neither"
        )
    return None if cert is None or key is None else (cert, key)


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS for a server with ``TA_TLS_CERT``/``TA_TLS_KEY``, requiring client certificates signed by
    ``TA_TLS_CLIENT_CA`` when that is set; None (plaintext) without a certificate."""
    own, client_ca = _own_certificate(), _read("TA_TLS_CLIENT_CA")
    if own is None:
        if client_ca is not None:
            raise FatalError(
                "TA_TLS_CLIENT_CA (mutual TLS) needs the server's own TA_TLS_CERT and TA_TLS_KEY"
            )
        return None
    cert, key = own
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def open_channel(address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``address`` as this process must reach the run's services: TLS when ``TA_TLS_CA`` is set
    (presenting ``TA_TLS_CERT`` for mutual TLS, checking ``TA_TLS_SERVER_NAME`` when set), the token on every
    call when there is one."""
    options = list(options or [])
    ca = _read("TA_TLS_CA")
    if ca is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        own = _own_certificate()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=own[1] if own else None,
            certificate_chain=own[0] if own else None,
        )
        name = os.environ.get("TA_TLS_SERVER_NAME")
        if name:
            options.append(("grpc.ssl_target_name_override", name))
        channel = grpc.secure_channel(address, credentials, options=options)
    return with_token(channel, service_token())


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port on this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, insecure: bool) -> str | None:
    """Refuse (FatalError) to bind a non-loopback ``host`` without the token and TLS, unless ``insecure``;
    returns the warning to print when ``insecure`` lets such a bind through."""
    if is_loopback(host):
        return None
    needed = {
        "a token (TA_TOKEN_FILE or TA_TOKEN)": service_token() is not None,
        "TLS (TA_TLS_CERT and TA_TLS_KEY)": _own_certificate() is not None,
    }
    missing = [name for name, present in needed.items() if not present]
    if not missing:
        return None
    what = " and ".join(missing)
    if insecure:
        return (
            f"--insecure: serving on {host} without {what}; anyone who reaches the port can use the service"
        )
    raise FatalError(
        f"refusing to serve on {host} without {what}: any host that reaches the port could use it. Make them "
        "with `tinker-atropos secrets DIR` and point TA_TOKEN_FILE, TA_TLS_CERT, TA_TLS_KEY (and TA_TLS_CA for "
        "the clients) at its files, bind 127.0.0.1, or pass --insecure on a network you trust"
    )


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


def signing_key(purpose: str) -> bytes | None:
    """The key that signs ``purpose`` records in Redis (``experience``, ``weights``), derived from the run's
    token, so that a process that reaches Redis but lacks the token can neither inject experience nor replace
    the weights; None without a token (records then go unsigned and are not checked)."""
    token = service_token()
    return None if token is None else derive_key(token, purpose)


def derive_key(token: str, purpose: str) -> bytes:
    """The key of ``purpose`` for the run whose token is ``token`` (one key per purpose: a signature made for
    one kind of record is never valid for another)."""
    return hmac.new(token.encode(), f"tinker-atropos/{purpose}/v1".encode(), hashlib.sha256).digest()


def signature(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed so that no two different splits sign alike."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def signed_by(key: bytes, given: bytes | None, *parts: bytes) -> bool:
    """Whether ``given`` is ``key``'s signature of ``parts`` (compared in constant time)."""
    return given is not None and hmac.compare_digest(given, signature(key, *parts))


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call but health without ``authorization: Bearer <token>`` (compared in constant time). The
    refusals are logged by peer and reason at most once every 10 s each, with their count: a client that retries
    in a loop does not fill the disk with one line per call."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()
        self.refused = 0
        self.warnings = CountedWarnings("calls refused for want of the run's token")
        self._lock = threading.Lock()

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHODS):
            return continuation(details)
        given = next((v for k, v in details.invocation_metadata if k == "authorization"), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return continuation(details)
        with self._lock:
            self.refused += 1
        refuse = functools.partial(self._refuse, "no token" if not given else "a wrong token", details.method)
        handler = continuation(details)
        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)

    def _refuse(self, why: str, method: str, request: Any, context: grpc.ServicerContext) -> None:
        """Where the peer is known: count and (rate-limited) log the refusal, then answer it."""
        with self._lock:
            self.warnings.add(f"{why} from {peer_host(context.peer())}", method)
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


def insecure() -> bool:
    """Whether this process was told to serve without protection (``--insecure``, ``TA_INSECURE``): HTTP
    endpoints without API keys, non-loopback binds without the token and TLS. For a local experiment."""
    return os.environ.get("TA_INSECURE", "").strip().lower() in ("1", "true", "yes", "on")


def read_keys(path: Path, setting: str) -> list[str]:
    """The keys of a keys file, one per line, ``#`` comments skipped; FatalError (naming ``setting``) for a file
    that is missing or holds none."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise FatalError(f"{setting} {path}: {error.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise FatalError(f"{setting} {path} holds no key: nobody could use the endpoint")
    return keys


def write_secret(path: Path, data: str | bytes, *, mode: int = 0o600, replace: bool = False) -> None:
    """``data`` (str: UTF-8) into ``path``, a file made with ``mode`` (0600: this user's only) as it is created, so
    that no other user can open it in between as after ``write_text`` and a chmod. FileExistsError where ``path``
    exists, unless ``replace``: then it is overwritten and given ``mode`` before the data goes in (an existing file
    keeps its own mode otherwise); ``mode`` is exact either way (the umask does not narrow it). The one way the
    run's secrets (token, Redis password, API keys, keys and certificates, files that hold them) are written."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    descriptor = os.open(path, flags, mode)
    with os.fdopen(descriptor, "wb") as file:
        os.fchmod(descriptor, mode)
        file.write(data.encode() if isinstance(data, str) else data)
