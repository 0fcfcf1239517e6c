"""A real trainer process serving the Tinker API, for tests that drive it through the official SDK, and the raw
HTTP requests the SDK sends, for what the SDK itself never does (retrying a number, leaving a gap)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import yaml
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.support.processes import Processes, wait_for
from tinker_atropos.processes import free_port

KEY = "tml-test-key-0123456789abcdef"


class TinkerTrainer:
    """``tinker-atropos trainer`` with only the Tinker API (no experience loop), on free loopback ports. Restarted,
    it keeps its ports, config, run folder and Redis, as a supervisor's restart would."""

    def __init__(
        self,
        processes: Processes,
        directory: Path,
        redis_url: str,
        run: str,
        scheme: str = "http",
        **tinker: Any,
    ) -> None:
        self.processes, self.directory, self.redis_url, self.scheme = processes, directory, redis_url, scheme
        self.run = run
        self.http_port, self.grpc_port = free_port(), free_port()
        keys = directory / "keys"
        keys.write_text(f"# the test's key\n{KEY}\n")
        config = {
            "run": {"name": run},
            "env": {"id": "Pendulum-v1", "instances": 2},
            "trainer": {
                "experience_loop": False,
                "tinker": {"enabled": True, "port": self.http_port, "api_keys_file": str(keys), **tinker},
            },
        }
        self.config = directory / "run.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.run_dir = directory / "run"
        self.starts = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    @property
    def name(self) -> str:
        return f"trainer-{self.starts}"

    def start(self, timeout_s: float = 60) -> None:
        self.starts += 1
        self.process = self.processes.start(
            "trainer",
            "--config",
            str(self.config),
            "--redis-url",
            self.redis_url,
            "--port",
            str(self.grpc_port),
            "--run-dir",
            str(self.run_dir),
            name=self.name,
        )
        wait_for(self._healthy, timeout_s, f"the Tinker API of {self.name} at {self.url}")

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"{self.name} exited ({self.process.returncode}):\n{self.log()}")
        try:
            return (
                httpx.get(f"{self.url}/api/v1/healthz", headers={"X-API-Key": KEY}, timeout=2).status_code
                == 200
            )
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as when the machine or the container goes away."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

    def log(self) -> str:
        return self.processes.log(self.name)


@contextlib.contextmanager
def serving(directory: Path, redis_url: str, run: str, **tinker_section: Any) -> Iterator[TinkerTrainer]:
    """A started ``TinkerTrainer`` (``trainer.tinker`` settings given), stopped at the end."""
    processes = Processes(directory)
    server = TinkerTrainer(processes, directory, redis_url, run, **tinker_section)
    try:
        server.start()
        yield server
    finally:
        processes.stop_all()


@contextlib.contextmanager
def sdk_session(trainer: TinkerTrainer) -> Iterator[tinker.ServiceClient]:
    """The SDK's service client of ``trainer``; closed at the end, which finishes its session (models unloaded)."""
    client = tinker.ServiceClient(base_url=trainer.url, api_key=KEY)
    try:
        yield client
    finally:
        client.close("success").result(timeout=30)


class Raw:
    """The Tinker API over plain HTTP, with the bodies built the way the SDK builds them."""

    def __init__(self, url: str, key: str = KEY) -> None:
        self.client = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30)

    def close(self) -> None:
        self.client.close()

    def forward_backward(
        self, model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str, forward_only: bool = False
    ) -> str:
        """POST /forward_backward (Protobuf, as the SDK sends it); the future's request id."""
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
            model_id=model_id,
            seq_id=seq_id,
        )
        message = forward_backward_request_to_proto(request)
        message.forward_only = forward_only
        response = self.client.post(
            "/api/v1/forward_backward",
            content=message.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        response.raise_for_status()
        return response.json()["request_id"]

    def optim_step(self, model_id: str, seq_id: int, adam: types.AdamParams) -> str:
        body = types.OptimStepRequest(optim_params=adam, model_id=model_id, seq_id=seq_id)
        response = self.client.post(
            "/api/v1/optim_step", json=body.model_dump(mode="json", exclude_none=True)
        )
        response.raise_for_status()
        return response.json()["request_id"]

    def poll(self, request_id: str) -> httpx.Response:
        """One POST /retrieve_future: the result, or 408 after the server's long poll."""
        return self.client.post("/api/v1/retrieve_future", json={"request_id": request_id})

    def result(self, request_id: str, timeout_s: float = 30) -> httpx.Response:
        """The future's result, polling past 408s as the SDK does; fails on any other error status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            response = self.poll(request_id)
            if response.status_code != 408:
                response.raise_for_status()
                return response
        pytest.fail(f"request {request_id} still pending after {timeout_s}s")

    def forward_output(self, request_id: str) -> types.ForwardBackwardOutput:
        response = self.result(request_id)
        assert "protobuf" in response.headers["content-type"], response.text
        return deserialize_forward_backward_output(response.content)
