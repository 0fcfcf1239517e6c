"""An env service as a careless or hostile client meets it: started as a process, and a Session stream that sends
raw bytes."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc

from tests.support.processes import Processes, wait_for
from tests.support.running import config_file
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.state.registry import ServiceRecord, live_services

RUN = "hostile"
SESSION = "/tinker_atropos.v1.Environment/Session"


def start_env(tmp_path: Path, processes: Processes, url: str, redis_client, **env: object) -> ServiceRecord:
    config = config_file(tmp_path, run={"name": RUN}, env={"instances": 4, **env})
    processes.start("env", "--config", str(config), "--redis-url", url, "--port", "0", name="env")
    return wait_for(lambda: next(iter(live_services(redis_client, RUN, "env")), None), 60, "the env service")


class RawStream:
    """A Session stream that sends whatever bytes it is given, when it is given them, and keeps what ends it."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        call = channel.stream_stream(
            SESSION, request_serializer=bytes, response_deserializer=pb.SessionResponse.FromString
        )
        self.responses = call(iter(self.requests.get, None))
        self.ended: grpc.RpcError | None = None
        self.received: list[pb.SessionResponse] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self.responses:
                self.received.append(response)
        except grpc.RpcError as error:
            self.ended = error

    def send(self, data: bytes) -> None:
        self.requests.put(data)

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
