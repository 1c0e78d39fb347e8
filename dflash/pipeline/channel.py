"""The control plane: length-prefixed pickled messages over TCP sockets, apart from every collective.

The coordinator listens; every rank (the coordinator's own drafter rank too) connects once and says
who it is (:class:`~dflash.pipeline.messages.Hello`). Messages are the small typed dataclasses of
:mod:`dflash.pipeline.messages` (item ids, shapes, counts), never tensors, so they cannot interleave
with the DDP all-reduces or the point-to-point rounds of the data plane. Each end accepts only the
messages that travel its way; an unknown or malformed one is a ProtocolError naming the sender. Every
wait has a timeout, and a timeout or a closed peer names the rank at the other end.
"""

from __future__ import annotations

import contextlib
import pickle
import selectors
import socket
import struct
import threading
import time

from dflash.pipeline.messages import TO_COORDINATOR, TO_RANK, Hello, Message, ProtocolError, decode, encode

_HEADER = struct.Struct("!Q")


class ChannelError(RuntimeError):
    """A peer closed its end, or nothing came within the timeout (the message names the peer)."""


class LostRank(ChannelError):
    """The coordinator's read from ``rank`` failed (its end closed, or it went silent mid-message): the
    message is the channel's own; the rank lets the coordinator tell a vanished rank from one that left
    with a reason (dflash.pipeline.service)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class Channel:
    """One end of a connection. ``send`` is thread-safe; ``recv`` belongs to one reader thread."""

    def __init__(self, sock: socket.socket, peer: str, accepts: tuple[type, ...]) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.accepts = accepts  # the message classes that travel towards this end
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        data = pickle.dumps(encode(msg), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            except OSError as exc:
                raise ChannelError(f"control channel to {self.peer} is closed ({exc})") from exc

    def recv(self, timeout: float | None) -> Message:
        """The next message; ChannelError after ``timeout`` seconds without one or when the peer is gone,
        ProtocolError when it is not a message this end accepts."""
        self.sock.settimeout(timeout)
        try:
            (n,) = _HEADER.unpack(self._exact(_HEADER.size, timeout))
            self.sock.settimeout(None if timeout is None else max(timeout, 30.0))  # the rest is already on its way
            data = self._exact(n, timeout)
        except TimeoutError as exc:
            raise ChannelError(f"no control message from {self.peer} within {timeout} s") from exc
        try:
            wire = pickle.loads(data)
        except Exception as exc:  # any unpickling failure is a malformed message
            raise ProtocolError(f"malformed control message from {self.peer}: {type(exc).__name__}: {exc}") from exc
        return decode(wire, self.peer, self.accepts)

    def _exact(self, n: int, timeout: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ChannelError(f"{self.peer} closed its control channel")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Hub:
    """The coordinator's end: a listening socket, one :class:`Channel` per rank, a poll over all of them."""

    def __init__(self, host: str = "0.0.0.0") -> None:
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.channels: dict[int, Channel] = {}
        self._selector = selectors.DefaultSelector()

    def accept(self, ranks: list[int], timeout: float) -> None:
        """Wait for every rank in ``ranks`` to connect and say its rank."""
        deadline = time.monotonic() + timeout
        while len(self.channels) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(ranks) - set(self.channels))
                raise ChannelError(f"ranks {missing} did not connect to the coordinator within {timeout} s")
            self.server.settimeout(left)
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            ch = Channel(sock, "a rank", TO_COORDINATOR)
            hello = ch.recv(left)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"a rank connected and sent {type(hello).__name__} before saying who it is")
            rank = hello.rank
            ch.peer = f"rank {rank}"
            self.channels[rank] = ch
            self._selector.register(sock, selectors.EVENT_READ, rank)

    def poll(self, timeout: float) -> list[tuple[int, Message]]:
        """Every message that is ready now (waiting up to ``timeout`` for the first)."""
        out = []
        for key, _ in self._selector.select(timeout):
            rank = key.data
            try:
                out.append((rank, self.channels[rank].recv(30.0)))
            except ChannelError as exc:
                raise LostRank(rank, str(exc)) from exc
        return out

    def retire(self, rank: int) -> None:
        """``rank`` said its last word (bye): it may now exit, and its closed end is no longer an error.

        Without this, a rank that leaves while its peers are still finishing (a drafter whose bye came
        before the host drafter's on a loaded machine) made the next poll read its EOF and fail the run.
        """
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self.channels[rank].sock)

    def send(self, rank: int, msg: Message) -> None:
        self.channels[rank].send(msg)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self._selector.close()
        self.server.close()


def connect(host: str, port: int, rank: int, timeout: float) -> Channel:
    """A rank's end of the control channel to the coordinator at ``host:port``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ChannelError(f"rank {rank} could not reach the coordinator at {host}:{port} ({exc})") from exc
            time.sleep(0.05)
    ch = Channel(sock, "the coordinator", TO_RANK)
    ch.send(Hello(rank))
    return ch
