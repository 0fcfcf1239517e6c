"""Frames of the local fast path (see ``LocalFrame`` in environment.proto): a 4-byte little-endian length,
then a serialized Protobuf message, over a Unix stream socket in the abstract namespace.

Abstract sockets need no file (nothing is left behind by a killed service) and are scoped to a network
namespace, so a peer in another container, pod or node simply cannot connect and falls back to gRPC.
"""

from __future__ import annotations

import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 256 * 1024 * 1024  # the same bound as the gRPC channels'
# A frame's buffer starts at most this big and doubles as its bytes arrive: a header alone, claiming up to
# MAX_FRAME_BYTES, must not make the receiver commit that much memory.
FIRST_BUFFER_BYTES = 4 * 1024 * 1024
ADDRESS_PREFIX = "unix-abstract:"

M = TypeVar("M", bound=Message)


class FrameError(Exception):
    """The peer closed the socket or sent bytes that are not a frame of the expected message."""


def local_address(name: str) -> str:
    return ADDRESS_PREFIX + name


def socket_name(address: str) -> str:
    """The abstract socket name (leading NUL) of a ``unix-abstract:`` address."""
    if not address.startswith(ADDRESS_PREFIX):
        raise ValueError(f"not a local stream address: {address!r} (expected {ADDRESS_PREFIX}NAME)")
    return "\0" + address[len(ADDRESS_PREFIX) :]


def send(sock: socket.socket, message: Message) -> None:
    data = message.SerializeToString()
    sock.sendall(HEADER.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, size: int) -> bytearray | None:
    """``size`` bytes, or None when the peer closed the stream before sending any of them."""
    buffer, received = bytearray(min(size, FIRST_BUFFER_BYTES)), 0
    while received < size:
        if received == len(buffer):  # full: double it, up to the frame's size
            buffer.extend(bytes(min(len(buffer), size - len(buffer))))
        with memoryview(buffer) as view:
            count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0:
                return None
            raise FrameError(f"the peer closed the stream within a frame ({received} of {size} bytes)")
        received += count
    return buffer


def receive_payload(sock: socket.socket) -> bytearray | None:
    """The bytes of the next frame, or None when the peer closed the stream between frames. FrameError on a
    frame cut short or oversized."""
    header = _receive_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    payload = _receive_exactly(sock, size)
    if payload is None:
        raise FrameError(f"the peer closed the stream after the header of a {size}-byte frame")
    return payload


def receive(sock: socket.socket, message_type: type[M]) -> M | None:
    """The next frame, parsed, or None when the peer closed the stream between frames. FrameError on a
    frame cut short, oversized, or whose bytes are not a ``message_type``."""
    payload = receive_payload(sock)
    if payload is None:
        return None
    message = message_type()
    try:
        message.ParseFromString(payload)
    except DecodeError as error:
        raise FrameError(f"frame is not a {message_type.DESCRIPTOR.name}: {error}") from error
    return message
