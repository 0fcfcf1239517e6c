"""A TLS endpoint in front of a plaintext TCP port, for ``rediss://`` against the embedded Valkey (whose binary
is built without TLS): it terminates TLS with the certificate of a ``tinker-atropos secrets`` folder and
forwards the bytes both ways."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path


class TlsProxy:
    def __init__(self, secrets: Path, target_port: int) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(secrets / "tls.crt", secrets / "tls.key")
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> int:
        self.thread.start()
        return self.listener.getsockname()[1]

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(5)
            client = self.context.wrap_socket(raw, server_side=True)
            client.settimeout(None)
        except (ssl.SSLError, OSError):  # a client that does not trust our CA aborts the handshake
            raw.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:  # the other direction closed both ends
        return
    finally:
        source.close()
        sink.close()
