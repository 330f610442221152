"""ZeroMQ sockets for psrt: the only module that imports zmq.

Shards own a ROUTER socket (:class:`RouterChannel`); a worker's client owns one DEALER socket per shard
(:class:`DealerChannel`). Never REQ/REP: a dead peer would lock it up forever. The options set here answer the
known ZeroMQ pitfalls of a parameter server:

- ``ROUTER_MANDATORY``: a reply to a departed peer raises instead of vanishing; the server counts the drop.
- explicit high-water marks and ``SNDTIMEO``: a full queue is an error after a deadline, not a silent drop
  or a hang.
- ``ROUTER_HANDOVER``: a worker that reconnects with the same identity takes over its old connection.
- ZMTP heartbeats (``HEARTBEAT_IVL``/``HEARTBEAT_TIMEOUT``/``HEARTBEAT_TTL``): dead TCP peers are detected.
- ``LINGER=0``: closing never blocks on unsent messages.
- Frames of at least :data:`ZERO_COPY_BYTES` are sent with ``copy=False`` (smaller ones are cheaper to copy);
  the caller must not mutate such a buffer until the send is done, which it can learn from the returned
  ``zmq.MessageTracker``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import zmq

from psrt.errors import BindError, ConnectionLostError, ShardTimeoutError

__all__ = ["ZERO_COPY_BYTES", "new_context", "RouterChannel", "DealerChannel", "Poller", "SendDropped",
           "peer_address"]

#: Frames at least this large go zero-copy (pyzmq copies smaller frames anyway).
ZERO_COPY_BYTES = 1 << 16

_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 10000


class SendDropped(Exception):
    """A ROUTER reply could not be queued: the peer is gone or its queue stayed full past the send timeout."""


def new_context() -> zmq.Context:
    """A fresh ZeroMQ context (its I/O thread starts here, never at import)."""
    return zmq.Context()


def _common(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, _HEARTBEAT_TIMEOUT_MS)


def _send_frames(sock: zmq.Socket, frames: Sequence[Any], track: bool) -> list[Optional[zmq.MessageTracker]]:
    trackers: list[Optional[zmq.MessageTracker]] = []
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = zmq.SNDMORE if i < last else 0
        if len(frame) >= ZERO_COPY_BYTES:
            tracker = sock.send(frame, flags, copy=False, track=track)
            trackers.append(tracker if track else None)
        else:
            sock.send(frame, flags, copy=True)
            trackers.append(None)  # copied: the caller's buffer is free at once
    return trackers


def _bind_advice(endpoint: str, exc: zmq.ZMQError) -> str:
    """A one-line explanation of a failed bind that says what to do instead."""
    message = f"cannot bind {endpoint}: {zmq.strerror(exc.errno)}"
    if exc.errno == zmq.EADDRINUSE and endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        return f"{message} (another process holds it); use another port, or tcp://{host}:* for a free one"
    if exc.errno == zmq.EADDRNOTAVAIL:
        return f"{message}; the host part must be an address of this machine (or * for all of them)"
    return message


def peer_address(frame: Any) -> str:
    """The IP address a received frame came from ("" for ipc/inproc peers or a copied frame)."""
    try:
        return str(frame.get("Peer-Address"))
    except (AttributeError, zmq.ZMQError):
        return ""


class RouterChannel:
    """A shard's ROUTER socket, bound to ``endpoint`` (``tcp://HOST:*`` picks a free port).

    Parameters
    ----------
    context : zmq.Context
        The ZeroMQ context.
    endpoint : str
        Where to bind.
    hwm : int
        High-water marks, in messages.
    send_timeout : float
        Seconds a reply may block on a full peer queue before it is dropped and counted.

    Raises
    ------
    BindError
        When the endpoint cannot be bound (e.g. the port is taken); the message names it and says what to do.
    """

    def __init__(self, context: zmq.Context, endpoint: str, hwm: int, send_timeout: float) -> None:
        self.sock = context.socket(zmq.ROUTER)
        _common(self.sock, hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout * 1000)))
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:
            # Close the socket now: a context cannot terminate while one of its sockets is open, so a caller
            # cleaning up after this error would otherwise hang and swallow it.
            self.sock.close(linger=0)
            raise BindError(_bind_advice(endpoint, exc)) from None
        last = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an incoming message."""
        return bool(self.sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN))

    def recv(self) -> Optional[tuple[bytes, list[zmq.Frame]]]:
        """Receive one message without blocking: ``(identity, frames)``, or None when nothing is queued.

        Frames are received zero-copy and are read-only.
        """
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return parts[0].bytes, parts[1:]

    def send(self, identity: bytes, frames: Sequence[Any],
             track: bool = False) -> list[Optional[zmq.MessageTracker]]:
        """Send a reply to ``identity``; returns one entry per frame: its tracker when it went zero-copy and
        ``track`` is set (the buffer must not change until ``tracker.done``), else None (the buffer is free).

        Raises
        ------
        SendDropped
            When the peer is unknown or departed, or its queue stayed full past the send timeout.
        """
        try:
            self.sock.send(identity, zmq.SNDMORE)
            return _send_frames(self.sock, frames, track)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise SendDropped(str(exc)) from None
            raise

    def close(self, linger: float = 0.0) -> None:
        """Close the socket, giving queued messages at most ``linger`` seconds to leave."""
        self.sock.close(linger=int(linger * 1000))


class DealerChannel:
    """A worker's DEALER socket to one shard.

    Parameters
    ----------
    context : zmq.Context
        The ZeroMQ context.
    endpoint : str
        The shard's endpoint.
    hwm : int
        High-water marks, in messages.
    """

    def __init__(self, context: zmq.Context, endpoint: str, hwm: int) -> None:
        self.endpoint = endpoint
        self._sndtimeo = -1
        self.sock = context.socket(zmq.DEALER)
        _common(self.sock, hwm)
        # Socket buffers are left to the kernel's autotuning: setting SO_SNDBUF/SO_RCVBUF turns autotuning off and
        # is capped by net.core.[rw]mem_max (often 208 KiB), which would starve a high bandwidth-delay link.
        self.sock.connect(endpoint)

    def send(self, frames: Sequence[Any], timeout: float) -> None:
        """Queue a request; blocks at most ``timeout`` seconds when the send queue is full.

        Raises
        ------
        ShardTimeoutError
            When the request could not be queued in time.
        ConnectionLostError
            When the socket is closed.
        """
        timeout_ms = max(1, int(timeout * 1000))
        if timeout_ms != self._sndtimeo:
            self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._sndtimeo = timeout_ms
        try:
            _send_frames(self.sock, frames, track=False)
        except zmq.Again:
            raise ShardTimeoutError(
                f"shard {self.endpoint} did not accept a request within {timeout:.1f}s (send queue full)",
                shard=self.endpoint,
            ) from None
        except zmq.ZMQError as exc:
            raise ConnectionLostError(f"cannot send to shard {self.endpoint}: {exc}") from None

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message to arrive."""
        return bool(self.sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN))

    def readable(self) -> bool:
        """True when a message is waiting (no system call beyond reading the socket's event flags)."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def recv_frame(self) -> bytes:
        """Receive the next frame (the header of a reply); a message must be ready (see :class:`Poller`)."""
        return self.sock.recv(zmq.NOBLOCK)

    def more(self) -> bool:
        """True when the current message has further frames."""
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def recv_into(self, buffer: Any) -> int:
        """Receive the next frame of the current message straight into ``buffer``; returns the frame's size."""
        return self.sock.recv_into(buffer, flags=zmq.NOBLOCK)

    def discard_rest(self) -> None:
        """Drop the remaining frames of the current message."""
        while self.more():
            self.sock.recv(zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        """Close the socket without lingering."""
        self.sock.close(linger=0)


class Poller:
    """Waits on several DEALER channels at once."""

    def __init__(self, channels: Sequence[DealerChannel]) -> None:
        self._poller = zmq.Poller()
        self._by_sock = {}
        for index, ch in enumerate(channels):
            self._poller.register(ch.sock, zmq.POLLIN)
            self._by_sock[ch.sock] = index

    def wait(self, timeout: float) -> list[int]:
        """Indices of the channels with a reply ready, after waiting at most ``timeout`` seconds."""
        events = self._poller.poll(max(0, int(timeout * 1000)))
        return [self._by_sock[s] for s, _ in events]
