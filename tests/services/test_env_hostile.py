"""An env service under careless or hostile clients, as a real process: idle streams, too many streams and
malformed messages harm only their own stream; Describe, health checks and SIGTERM are always served."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.support.processes import Processes, wait_for
from tests.support.raw_env import RUN, RawStream, start_env
from tinker_atropos.protocol import local_stream, tensors
from tinker_atropos.protocol.v1 import environment_pb2 as pb
from tinker_atropos.protocol.v1 import environment_pb2_grpc
from tinker_atropos.service_host import MAX_REQUEST_BYTES, check_health
from tinker_atropos.state.registry import live_services

pytestmark = pytest.mark.integration


def describe(channel: grpc.Channel) -> pb.EnvironmentInfo:
    return environment_pb2_grpc.EnvironmentStub(channel).Describe(pb.DescribeRequest(), timeout=2)


def test_idle_streams_neither_starve_describe_and_health_nor_hold_instances(
    tmp_path: Path, valkey, redis_client, processes: Processes
) -> None:
    env = start_env(
        tmp_path, processes, valkey.url, redis_client, open_timeout_s=2.0, session_idle_timeout_s=2.0
    )
    with grpc.insecure_channel(env.address) as channel:
        idle = [RawStream(channel) for _ in range(24)]  # never send a request: each would hold a worker
        refused = wait_for(
            lambda: [s for s in idle if s.ended] if sum(bool(s.ended) for s in idle) >= 20 else None,
            10,
            "streams past the limit to be refused",
        )
        assert all(s.ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for s in refused)
        assert "4 streams already open, the limit of this env service" in refused[0].ended.details()
        for _ in range(5):  # the 4 admitted idle streams hold no worker that Describe or health need
            assert describe(channel).num_instances == 4
            assert check_health(env.address, timeout_s=2)
        wait_for(lambda: all(s.ended for s in idle), 10, "idle streams to be ended after env.open_timeout_s")

        session = RawStream(channel)  # a real client gets in once the idle ones are gone
        session.send(pb.SessionRequest(open=pb.OpenSession(num_instances=4)).SerializeToString())
        opened = wait_for(lambda: session.received and session.received[0].opened, 10, "the session to open")
        step = pb.StepRequest(
            session_id=opened.session_id, actions=tensors.encode(np.zeros((4, 1), np.float32))
        )
        session.send(pb.SessionRequest(step=step).SerializeToString())
        wait_for(lambda: len(session.received) == 2, 10, "a step")
        assert describe(channel).free_instances == 0
        # then it goes quiet: ended after env.session_idle_timeout_s, its instances freed
        wait_for(lambda: session.ended is not None, 10, "the idle session to be ended")
        wait_for(lambda: describe(channel).free_instances == 4, 5, "its instances to be freed")
        for stream in idle + [session]:
            stream.close()
    figures = wait_for(
        lambda: (
            (r := live_services(redis_client, RUN, "env"))
            and r[0].figures["streams_timed_out"] >= 5
            and r[0].figures
        ),
        10,
        "the figures",
    )
    assert figures["streams_refused"] >= 20
    log = processes.log("env")
    assert "Traceback" not in log
    assert "no 'open' request for 2 s" in log and "no step request for 2 s" in log


def test_a_malformed_message_ends_only_its_stream_and_sigterm_still_drains(
    tmp_path: Path, valkey, redis_client, processes: Processes
) -> None:
    env = start_env(tmp_path, processes, valkey.url, redis_client)
    with grpc.insecure_channel(env.address) as channel:
        bystander = RawStream(channel)
        bystander.send(pb.SessionRequest(open=pb.OpenSession(num_instances=2)).SerializeToString())
        wait_for(lambda: bystander.received, 10, "the bystander's session")
        offender = RawStream(channel)
        offender.send(b"\xff\xff\xff\xff not a request")
        wait_for(lambda: offender.ended, 10, "the malformed stream to end")
        assert offender.ended.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a SessionRequest" in offender.ended.details()
        glutton = RawStream(channel)  # one message over the server's bound: refused, never buffered whole
        glutton.send(b"\0" * (MAX_REQUEST_BYTES + 1))
        wait_for(lambda: glutton.ended, 10, "the oversized stream to end")
        assert glutton.ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        local = describe(channel).local_address  # the same over the local fast path
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(local_stream.socket_name(local))
            raw.sendall(local_stream.HEADER.pack(4) + b"\xff\xff\xff\xff")
            assert local_stream.receive(raw, pb.LocalFrame).status.code == "INVALID_ARGUMENT"
        step = pb.StepRequest(
            session_id=bystander.received[0].opened.session_id,
            actions=tensors.encode(np.zeros((2, 1), np.float32)),
        )
        bystander.send(pb.SessionRequest(step=step).SerializeToString())
        wait_for(lambda: len(bystander.received) == 2, 10, "the bystander to be served on")

        service = processes.started[0]
        started = time.monotonic()
        service.send_signal(signal.SIGTERM)  # with the bystander's session still open
        assert service.wait(timeout=10) == 0
        assert time.monotonic() - started < 10
        bystander.close()
        offender.close()
    log = processes.log("env")
    assert "Traceback" not in log
    warnings = [line for line in log.splitlines() if "WARNING" in line and "not a SessionRequest" in line]
    assert len(warnings) == 2, log  # one per peer (a line every 10 s at most for each), each naming its peer
    assert "(INVALID_ARGUMENT from ipv4:127.0.0.1)" in warnings[0], warnings
    assert "(INVALID_ARGUMENT from unix:pid=" in warnings[1], warnings
