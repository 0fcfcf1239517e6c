"""The links between the trainer (rank 0) and its learner replicas on one machine: a socket pair per replica, made
by the trainer before it starts the replica, which inherits its end. Nothing listens, so no other process, of this
user or another, can connect to a learner, flood it or take a replica's place; only the two processes hold the
pair's ends, which is why what crosses it may be pickled (gloo's listener on 127.0.0.1 let any local user crash the
trainer with a connection flood, or join the group and have its pickles run).

A collective (``Group``'s all-reduce) is a star through rank 0: each replica sends its tensor, rank 0 adds them in
rank order and sends every replica the same sum, so that every learner steps the same parameters. Every wait
within a collective lasts ``TIMEOUT_S`` at most: past it (a hung learner) the trainer stops with an error and
restarts with new replicas, as when one is lost."""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
from collections.abc import Iterator
from typing import Any

import torch

HEADER = struct.Struct("!Q")  # every frame's length
TIMEOUT_S = 60.0  # the longest a learner waits for another within a collective


class LearnerLost(RuntimeError):
    """A learner gone (its end of the pair closed) or hung (no answer within ``TIMEOUT_S``)."""


class Channel:
    """One end of a socket pair between rank 0 and a replica: pickled messages and tensors' bytes, each a frame."""

    def __init__(self, connection: socket.socket, peer: str) -> None:
        self.connection, self.peer = connection, peer

    @classmethod
    def pair(cls, peer: str) -> tuple[Channel, socket.socket]:
        """This process's channel to ``peer``, and the other end, for the child process it starts to inherit."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(mine, peer), theirs

    def send(self, message: Any) -> None:
        self._send(memoryview(pickle.dumps(message, protocol=5)))

    def receive(self, timeout: float | None = TIMEOUT_S) -> Any:
        """The next message; ``timeout`` None waits as long as the peer lives (a replica between two updates)."""
        with self._lost():
            self.connection.settimeout(timeout)
            data = bytearray(self._length())
            self._fill(memoryview(data))
        return pickle.loads(data)

    def send_tensor(self, flat: torch.Tensor) -> None:
        self._send(_raw(flat))

    def receive_tensor(self, into: torch.Tensor) -> None:
        """The peer's tensor of ``into``'s size and type, written into it (a flat CPU tensor)."""
        raw = _raw(into)
        with self._lost():
            self.connection.settimeout(TIMEOUT_S)
            if (length := self._length()) != raw.nbytes:
                raise LearnerLost(f"{self.peer} sent {length} bytes for a tensor of {raw.nbytes}")
            self._fill(raw)

    def close(self) -> None:
        self.connection.close()

    def _send(self, data: memoryview) -> None:
        with self._lost():
            self.connection.settimeout(TIMEOUT_S)
            self.connection.sendall(HEADER.pack(data.nbytes))
            self.connection.sendall(data)

    def _length(self) -> int:
        header = bytearray(HEADER.size)
        self._fill(memoryview(header))
        return HEADER.unpack(header)[0]

    def _fill(self, view: memoryview) -> None:
        while view.nbytes:
            got = self.connection.recv_into(view)
            if got == 0:
                raise LearnerLost(f"the connection to {self.peer} was lost: it closed its end")
            view = view[got:]

    @contextlib.contextmanager
    def _lost(self) -> Iterator[None]:
        try:
            yield
        except TimeoutError:
            raise LearnerLost(f"{self.peer} did not answer within {TIMEOUT_S:.0f} s") from None
        except OSError as error:  # a peer killed mid-message: EPIPE, ECONNRESET
            raise LearnerLost(f"the connection to {self.peer} was lost: {error}") from None


def _raw(flat: torch.Tensor) -> memoryview:
    """A flat CPU tensor's bytes, in place."""
    return memoryview(flat.view(torch.uint8).numpy())


class Star:
    """The learners' all-reduce (a sum, in place) over channels through rank 0: rank 0 holds one to each replica,
    a replica its one to rank 0. Tensors on a GPU go through the CPU (learners that share GPUs; those with a GPU
    each use NCCL, ``learner_replicas.Replicas``)."""

    def __init__(self, channels: list[Channel], root: bool) -> None:
        self.channels, self.root = channels, root

    def __call__(self, tensor: torch.Tensor) -> None:
        host = tensor.cpu()
        flat = host.view(-1)
        if self.root:
            other = torch.empty_like(flat)
            for channel in self.channels:
                channel.receive_tensor(other)
                flat += other
            for channel in self.channels:
                channel.send_tensor(flat)
        else:
            (channel,) = self.channels
            channel.send_tensor(flat)
            channel.receive_tensor(flat)
        if host is not tensor:
            tensor.copy_(host)
