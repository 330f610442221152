"""ZeroMQ sockets for psrt: this package (with :mod:`psrt.transport.curve`) is the only code that imports zmq.

Shards own a ROUTER socket (:class:`RouterChannel`); a worker's client owns one DEALER socket per shard
(:class:`DealerChannel`). Never REQ/REP: a dead peer would lock it up forever. The options set here answer the
known ZeroMQ pitfalls of a parameter server:

- ``ROUTER_MANDATORY``: a reply to a departed peer raises instead of vanishing; the server counts the drop.
- explicit high-water marks and ``SNDTIMEO``: a full queue is an error after a deadline, not a silent drop
  or a hang.
- ``ROUTER_HANDOVER``: a worker that reconnects with the same identity takes over its old connection.
- Dead TCP peers are detected by what their kernel acknowledges, never by how long a message takes:
  ``TCP_MAXRT`` (``TCP_USER_TIMEOUT``) drops a connection whose bytes stay unacknowledged for
  :data:`DEAD_AFTER_S`, and TCP keepalives (``TCP_KEEPALIVE*``) probe an idle one, answered by the peer's kernel
  without waking its process. No ZMTP heartbeats: their pong queues behind the data the peer sends first, so on a
  slow or congested link (a message that takes longer to cross than the timeout) a live connection was dropped,
  again at every try of the message; and their pings woke both processes' I/O threads every interval on every
  connection (thousands a second with a thousand workers).
- The scheduler's ROUTER watches its connections (``watch_connections``, a socket monitor and each message's
  ``SRCFD``): a killed peer's kernel closes them at once, which names it sooner than its silence would.
- ``LINGER=0``: closing never blocks on unsent messages.
- Between a worker and a shard of one host (a shared-memory lane proves it), requests and replies leave ZeroMQ
  for a Unix socket of their own once the worker asked for one (:mod:`psrt.transport.local`): the
  :class:`DealerChannel` and :class:`RouterChannel` of the pair carry them there, and nothing above them changes.
- Frames of at least :data:`ZERO_COPY_BYTES` are sent with ``copy=False`` (smaller ones are cheaper to copy);
  the caller must not mutate such a buffer until the send is done, which it can learn from the returned
  ``zmq.MessageTracker``.
- ``MAXMSGSIZE`` from the decode limits: a peer sending a frame no valid message can hold is disconnected
  before the frame is buffered whole.
- One context for every client of a process (:func:`acquire_context`), as ZeroMQ advises: a process hosting
  hundreds of workers (``psrt worker --clients N``) then runs one I/O thread for them, not two threads each, and
  ``MAX_SOCKETS`` is raised to what the process's file limit allows (each client holds a few sockets per shard).
- CURVE, when a process has keys (:mod:`psrt.control.security`): serving sockets are CURVE servers with a ZAP domain
  and ``ZAP_ENFORCE_DOMAIN`` (CURVE fails open without a ZAP handler; with it, a missing handler fails
  closed), and their context runs a ZAP handler that accepts only the job's client key. Connecting sockets
  carry a handshake monitor: ZeroMQ keeps a refused handshake from the application, so the monitor turns it
  into an :class:`~psrt.errors.AuthenticationError` at the next wait instead of a timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import resource
import secrets
import select
import struct
import threading
import time
from collections import deque
from typing import Any, Optional, Sequence

import zmq

from psrt.checks import check_endpoint
from psrt.errors import (
    AuthenticationError,
    BindError,
    ConnectionLostError,
    ProtocolError,
    ResourceLimitError,
    ShardTimeoutError,
)
from psrt.transport import curve, local
from psrt.transport.curve import ZAP_DOMAIN, JobKeys, create_certificates, read_certificate

log = logging.getLogger("psrt.transport")

__all__ = ["ZERO_COPY_BYTES", "DEAD_AFTER_S", "ZAP_DOMAIN", "new_context", "acquire_context", "release_context",
           "RouterChannel", "DealerChannel", "Poller", "monitor_event", "SendDropped", "peer_address",
           "create_certificates", "read_certificate", "on_this_host", "wait_readable"]

#: Below this many bytes a copy costs less than avoiding it: smaller frames are copied into ZeroMQ's messages
#: (pyzmq copies them anyway), and a call moving fewer bytes to a shard stays on the sockets instead of taking a
#: shared-memory lane (:mod:`psrt.shm.lanes`).
ZERO_COPY_BYTES = 1 << 16

#: Seconds a connection's bytes may stay unacknowledged by the peer's kernel before the connection is dropped (a
#: host that is gone, or unreachable): ZeroMQ then connects again, and a client sends again what was not answered.
#: A live peer's kernel acknowledges within a round trip however much data queues ahead of the application, and
#: TCP's own retransmissions give up only after many minutes.
DEAD_AFTER_S = 20.0
#: Seconds of silence before a connection's first keepalive probe, and between probes; probes enough to span
#: DEAD_AFTER_S, so that keepalives never give up sooner than unacknowledged data does.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTVL_S = 5, 2
_KEEPALIVE_CNT = math.ceil((DEAD_AFTER_S - _KEEPALIVE_IDLE_S) / _KEEPALIVE_INTVL_S)

#: Slack over the largest valid frame for MAXMSGSIZE: under CURVE the limit applies to the encrypted frame, which
#: carries a command name, a nonce and a MAC besides the payload (well under this).
_FRAME_SLACK = 1024
_MAX_INT64 = (1 << 63) - 1

# pyzmq's constants are enum flags: ``int & zmq.POLLIN`` builds a new enum member (about a microsecond each), and a
# small message's round trip tests them several times. Plain integers keep the hot paths to the system's work.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_NO_DETAIL = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
#: A received message's property: the file descriptor of the connection it came in on (zmq_msg_get(3)).
_SRCFD = int(zmq.SRCFD)

#: A shard's local connections (:mod:`psrt.transport.local`) at most, and secrets granted and not yet used.
_MAX_LOCAL = 4096
_MAX_GRANTS = 4096
#: Bytes of replies a local connection keeps back before a reply waits (up to the send timeout) for the peer.
_LOCAL_BACKLOG = 64 << 20
#: Seconds a local connection may stay without its greeting (it is closed at the next connection after that).
_GREET_S = 10.0

#: Handshakes in a row that a keyless socket sees end without detail before it takes them for a refusal: a secured
#: peer drops a keyless one at every attempt (ZeroMQ retries every 0.1 s or so), a busy one misses one greeting.
UNFINISHED_HANDSHAKES = 3

#: A monitor event's first frame (zmq_socket_monitor(3)): the event as uint16, its value as uint32, no padding.
#: Read here rather than by ``zmq.utils.monitor``, which imports ``zmq.asyncio`` (and asyncio, some 40 ms) into
#: every process at import.
_MONITOR_EVENT = struct.Struct("=HI")


def monitor_event(frames: Sequence[bytes]) -> tuple[int, int]:
    """The ``(event, value)`` of a message from a socket monitor.

    Raises
    ------
    ProtocolError
        When the message does not have a monitor event's shape (two frames, the first of 6 bytes).
    """
    if len(frames) != 2 or len(frames[0]) != _MONITOR_EVENT.size:
        raise ProtocolError(f"not a socket monitor event: {len(frames)} frames")
    event, value = _MONITOR_EVENT.unpack(frames[0])
    return event, value

#: ZeroMQ takes milliseconds as a C int: a longer wait (or ``inf``, the user's "no limit") is its -1, "forever".
_MAX_MS = (1 << 31) - 1

#: Seconds between reads of a :class:`Poller`'s handshake monitors while its sockets keep it busy.
MONITOR_INTERVAL = 0.05


def on_this_host(endpoint: str) -> bool:
    """Whether ``endpoint`` is reached without a network: ``ipc://``, ``inproc://``, or TCP to a loopback address.

    A worker's messages to such a shard are not cut for pipelining (:meth:`psrt.partition.PartitionMap.messages`):
    with no link to keep busy both ways, more messages would only cost more.
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: resolving it here would be a network wait


def _ms(seconds: float, floor: int = 0) -> int:
    """ZeroMQ's milliseconds for a wait of ``seconds`` (at least ``floor``); -1 for inf or beyond a C int."""
    if seconds * 1000 >= _MAX_MS:
        return -1
    return max(floor, int(seconds * 1000))


class SendDropped(Exception):
    """A ROUTER reply could not be queued: the peer is gone or its queue stayed full past the send timeout."""


def new_context() -> zmq.Context:
    """A fresh ZeroMQ context (its I/O thread starts here, never at import)."""
    return curve.Context()


_shared_lock = threading.Lock()
_shared: Optional[tuple[int, zmq.Context]] = None  # (the pid that made it, the context)
_shared_users = 0


def acquire_context() -> zmq.Context:
    """The context the clients of this process share: made by the first (never at import), with one I/O thread
    per two cores (up to four) and ``MAX_SOCKETS`` raised to the process's open-file limit; each
    :func:`acquire_context` is paired with a :func:`release_context`, and the last one terminates it.

    A child made by ``fork`` does not inherit it: it makes its own (a context does not survive a fork).
    """
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            context = new_context()
            context.set(zmq.IO_THREADS, min(4, max(1, (os.cpu_count() or 1) // 2)))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            limit = context.get(zmq.SOCKET_LIMIT)
            context.set(zmq.MAX_SOCKETS, max(1023, limit if soft == resource.RLIM_INFINITY else min(limit, soft)))
            _shared, _shared_users = (os.getpid(), context), 0
        _shared_users += 1
        return _shared[1]


def release_context(context: zmq.Context) -> None:
    """Give back a context from :func:`acquire_context`; the last user's release terminates it (its sockets must be
    closed by then, else this waits for them)."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or _shared[1] is not context:
            return  # made before a fork, or released already
        _shared_users -= 1
        if _shared_users > 0:
            return
        _shared = None
    context.term()


def wait_readable(sockets: Sequence[zmq.Socket], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for a message on any of ``sockets``; True when one is waiting."""
    return bool(zmq.zmq_poll([(s, _POLLIN) for s in sockets], _ms(timeout)))


def _max_frame(sock: zmq.Socket, max_frame: Optional[int]) -> None:
    if max_frame is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, min(max_frame + _FRAME_SLACK, _MAX_INT64))


def _common(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # Liveness is the peer kernel's acknowledgement: of the bytes sent (TCP_MAXRT), or on an idle connection of
    # keepalive probes (sent after _KEEPALIVE_IDLE_S of silence, every _KEEPALIVE_INTVL_S; TCP_MAXRT also bounds
    # how long they may go unanswered).
    sock.setsockopt(zmq.TCP_MAXRT, int(DEAD_AFTER_S * 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, _KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, _KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, _KEEPALIVE_CNT)


#: pyzmq's compiled ``Socket.send``, called on a socket directly: the ``zmq.Socket`` subclass wraps it in a Python
#: method (for draft-API arguments psrt never passes), which costs more than the send of a small frame itself.
_SEND = zmq.backend.Socket.send
#: The compiled ``Socket.get`` (see ``_SEND``): an option read without the enum member ``getsockopt`` makes.
_GET = zmq.backend.Socket.get


def _send_frames(sock: zmq.Socket, frames: Sequence[Any], track: bool) -> list[Optional[zmq.MessageTracker]]:
    trackers: list[Optional[zmq.MessageTracker]] = []
    last = len(frames) - 1
    send = _SEND
    for i, frame in enumerate(frames):
        flags = _SNDMORE if i < last else 0
        if len(frame) >= ZERO_COPY_BYTES:
            tracker = send(sock, frame, flags, False, track)
            trackers.append(tracker if track else None)
        else:
            send(sock, frame, flags, True, False)
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
    keys : JobKeys, optional
        Serve with CURVE (and start the context's ZAP handler); None: no security.
    max_frame : int, optional
        The largest frame a valid message holds (:attr:`psrt.config.WireLimits.max_frame_bytes`); a peer
        sending a larger one is disconnected. None: no limit.
    watch_connections : bool
        Note the connection each message came in on (:attr:`source`) and report the connections that close
        (:meth:`closed`): a peer process that dies closes them at once (its kernel does), well before its silence
        tells. False: neither (the shards' sockets, whose reads this would slow).

    Raises
    ------
    BindError
        When the endpoint cannot be bound (e.g. the port is taken); the message names it and says what to do.
    ConfigError
        When ``endpoint`` is not one (a TCP port outside 1..65535, another scheme).
    """

    def __init__(self, context: zmq.Context, endpoint: str, hwm: int, send_timeout: float, *,
                 keys: Optional[JobKeys] = None, max_frame: Optional[int] = None,
                 watch_connections: bool = False) -> None:
        check_endpoint(endpoint, bind=True, what="cannot bind")  # ZeroMQ would wrap a port above 65535 around
        if keys is not None:
            curve.authenticate(context, keys)  # before the socket exists: no handshake may precede the handler
        self.sock = context.socket(zmq.ROUTER)
        _common(self.sock, hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, _ms(send_timeout, 1))
        _max_frame(self.sock, max_frame)
        if keys is not None:
            curve.serve_securely(self.sock, keys)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:
            # Close the socket now: a context cannot terminate while one of its sockets is open, so a caller
            # cleaning up after this error would otherwise hang and swallow it.
            self.sock.close(linger=0)
            raise BindError(_bind_advice(endpoint, exc)) from None
        last = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = last.decode() if isinstance(last, bytes) else str(last)
        self._poll_items = [(self.sock, _POLLIN)]
        #: The connection (its file descriptor) the last message :meth:`recv` returned came in on; -1 when unknown
        #: (an inproc peer) or when connections are not watched.
        self.source = -1
        self._closes: Optional[zmq.Socket] = None
        self._wait_items = self._poll_items
        if watch_connections:
            self._closes = self.sock.get_monitor_socket(_DISCONNECTED)
            self._wait_items = [*self._poll_items, (self._closes, _POLLIN)]
        #: Small replies kept back (:meth:`hold`), each with its frames' copies; None: every reply goes at once.
        self._held: Optional[list[tuple[bytes, list[bytes]]]] = None
        self._hold_most = 0
        self._dropped: list[tuple[int, str]] = []
        self._max_frame = max_frame
        self._send_timeout = send_timeout
        # Local connections (psrt.transport.local): the listener, made at the first grant; the secrets granted
        # (secret -> identity); every connection accepted, by descriptor; those a worker has sent a request over,
        # by identity (its replies go there); and the messages read from them, in arrival order.
        self._listener: Optional[local.LocalListener] = None
        self._grants: dict[bytes, bytes] = {}
        self._conns: dict[int, local.LocalConn] = {}
        self._by_identity: dict[bytes, local.LocalConn] = {}
        self._arrived: deque[tuple[bytes, list[Any]]] = deque()
        # What a wait polls once a listener exists (the ZeroMQ sockets and an epoll set of the listener and the
        # connections), that set, the connections with replies kept back (polled for room too), and whether the
        # last wait found the ZeroMQ socket readable (else a receive does not try it: a receive that finds nothing
        # costs pyzmq an exception).
        self._local_items: list[Any] = []
        self._epoll: Optional[select.epoll] = None
        self._epoll_fd = -1
        self._pending: set[local.LocalConn] = set()
        self._zmq_waiting = True
        # With local connections a shard waits on its epoll set alone, the ZeroMQ socket's descriptor in it (see
        # _poll_local): that descriptor, and whether the socket was used since its events were last read (a use
        # may take in the notice of a message that then waits unsignalled, so the next wait reads them first).
        self._zmq_fd = -1
        self._zmq_used = True
        #: Messages received over local connections (greetings aside).
        self.local_messages = 0

    def poll(self, timeout: float, also: Sequence[zmq.Socket] = ()) -> bool:
        """Wait up to ``timeout`` seconds for an incoming message (or, when watched, a connection's close); ``also``:
        sockets whose message ends the wait too (True only when this channel has one)."""
        if self._listener is not None:
            return self._poll_local(timeout, also)
        if not also:
            return bool(zmq.zmq_poll(self._wait_items, _ms(timeout)))
        got = zmq.zmq_poll([*self._wait_items, *((s, _POLLIN) for s in also)], _ms(timeout))
        return any(s is self.sock or s is self._closes for s, _ in got)

    def readable(self) -> bool:
        """True when a message is waiting (never waits)."""
        # A poll without timeout reads the socket's event flags as getsockopt(EVENTS) does, without the enum member
        # pyzmq makes of getsockopt's answer.
        self._zmq_used = True
        return bool(zmq.zmq_poll(self._poll_items, 0))

    def closed(self) -> list[int]:
        """The connections (file descriptors, as in :attr:`source`) that closed since the last call; never waits.

        A descriptor is reused by a later connection: the caller takes a close for a hint about whoever last spoke
        on it, to be confirmed by that peer's silence, never for proof of a death.
        """
        fds: list[int] = []
        if self._closes is None:
            return fds
        while self._closes.poll(0):
            try:
                event, value = monitor_event(self._closes.recv_multipart(_NOBLOCK))
            except (zmq.Again, ProtocolError):
                break
            if event == _DISCONNECTED:
                fds.append(value)
        return fds

    def recv(self) -> Optional[tuple[bytes, list[zmq.Frame]]]:
        """Receive one message without blocking: ``(identity, frames)``, or None when nothing is queued.

        Frames are received zero-copy and are read-only; the first, a header, comes as ``bytes`` when it is under
        :data:`ZERO_COPY_BYTES`.
        """
        if self._listener is not None:
            if self._arrived:
                return self._arrived.popleft()
            if not self._zmq_waiting:
                return None
        recv = self.sock.recv
        try:
            identity = recv(_NOBLOCK)  # a few bytes: a copy costs less than a zmq.Frame
        except zmq.Again:
            # (Nothing queued, and ZeroMQ now signals the descriptor at the next message: no events to read.)
            self._zmq_waiting = self._zmq_used = False
            return None
        self._zmq_used = True
        # A ROUTER puts the peer's identity before every message, which has at least one frame. Each zmq.Frame
        # knows whether more follow: cheaper than recv_multipart's RCVMORE query per frame.
        frame = recv(_NOBLOCK, False)
        if self._closes is not None:
            try:
                self.source = frame.get(_SRCFD)
            except zmq.ZMQError:  # an inproc peer has no descriptor (ZeroMQ says EINVAL)
                self.source = -1
        # The first frame is a header, which every reader wants as bytes: a small one is copied (once).
        frames = [frame.bytes if len(frame) < ZERO_COPY_BYTES else frame]
        while frame.more:
            frame = recv(_NOBLOCK, False)
            frames.append(frame)
        return identity, frames

    def hold(self, most: int) -> None:
        """Keep small replies back from now on, and send them together, ``most`` at a time and at :meth:`release`.

        A reply costs the I/O thread a wake-up when it finds it idle, which a shard that works on a message longer
        than the thread takes to send the last reply does at every reply; sent together, they share one. A reply
        of small frames (each under :data:`ZERO_COPY_BYTES`) is copied when it is given (the caller may change its
        buffers at once, as after a send) and counts as sent; a reply with a larger frame goes at once, after those
        held, so that every peer gets its replies in order.
        """
        self._held = []
        self._hold_most = max(1, most)

    def flush(self) -> None:
        """Send the replies held now, and go on holding."""
        self._flush()

    def release(self) -> list[tuple[int, str]]:
        """Send the replies held, stop holding; returns ``(bytes, why)`` of each that could not be sent (the peer
        departed, or its queue stayed full past the send timeout), since :meth:`hold`."""
        self._flush()
        self._held = None
        dropped, self._dropped = self._dropped, []
        return dropped

    def _flush(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        sock = self.sock
        self._zmq_used = True
        for identity, frames in held:
            try:
                _SEND(sock, identity, _SNDMORE, True, False)
                last = len(frames) - 1
                for i, frame in enumerate(frames):
                    _SEND(sock, frame, _SNDMORE if i < last else 0, True, False)
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    raise
                self._dropped.append((sum(map(len, frames)), str(exc)))

    def send(self, identity: bytes, frames: Sequence[Any],
             track: bool = False) -> list[Optional[zmq.MessageTracker]]:
        """Send a reply to ``identity``; returns one entry per frame: its tracker when it went zero-copy and
        ``track`` is set (the buffer must not change until ``tracker.done``), else None (the buffer is free).

        Raises
        ------
        SendDropped
            When the peer is unknown or departed, or its queue stayed full past the send timeout (a reply held
            back is reported by :meth:`release` instead).
        """
        if self._by_identity:
            conn = self._by_identity.get(identity)
            if conn is not None and self._send_local(conn, frames):
                return [None] * len(frames)
        held = self._held
        if held is not None:
            for frame in frames:
                if len(frame) >= ZERO_COPY_BYTES:
                    self._flush()  # first those before it
                    break
            else:
                if len(frames) == 2:  # a header (bytes) and one buffer, the usual answer
                    head, body = frames
                    held.append((identity, [head if type(head) is bytes else bytes(head), bytes(body)]))
                else:
                    held.append((identity, [f if type(f) is bytes else bytes(f) for f in frames]))
                if len(held) >= self._hold_most:
                    self._flush()
                return [None] * len(frames)
        sock = self.sock
        self._zmq_used = True
        try:
            _SEND(sock, identity, _SNDMORE, True, False)
            if len(frames) == 2 and len(frames[1]) < ZERO_COPY_BYTES:  # a small reply (a header and one buffer)
                _SEND(sock, frames[0], _SNDMORE, True, False)
                _SEND(sock, frames[1], 0, True, False)
                return [None, None]
            return _send_frames(sock, frames, track)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise SendDropped(str(exc)) from None
            raise

    def close(self, linger: float = 0.0) -> None:
        """Close the socket, giving queued messages at most ``linger`` seconds to leave."""
        if self._closes is not None:
            self.sock.disable_monitor()
            self._closes.close(linger=0)
        self.sock.close(linger=_ms(linger))
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self._by_identity.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    # ------------------------------------------------------------------ local connections
    def grant_local(self, identity: bytes) -> tuple[str, str]:
        """Let the peer ``identity`` (a worker of this host: it read the beacon) connect locally; returns the
        listener's name and the secret it is to present (:mod:`psrt.transport.local`).

        Raises
        ------
        OSError
            When this platform has no abstract sockets or the listener cannot be made.
        """
        if self._listener is None:
            listener = local.LocalListener()
            try:
                self._epoll = select.epoll()
            except OSError:
                listener.close()
                raise
            self._epoll.register(listener.fd, select.EPOLLIN)
            self._epoll_fd = self._epoll.fileno()
            if self._closes is None:  # (a socket with a monitor to read, a scheduler's, keeps zmq_poll)
                self._zmq_fd = self.sock.getsockopt(zmq.FD)
                self._epoll.register(self._zmq_fd, select.EPOLLIN)
            self._listener = listener
            self._local_items = [*self._wait_items, (self._epoll.fileno(), _POLLIN)]
        for secret, who in list(self._grants.items()):
            if who == identity:
                del self._grants[secret]  # (one at a time per peer)
        while len(self._grants) >= _MAX_GRANTS:
            del self._grants[next(iter(self._grants))]
        secret = secrets.token_hex(16)
        self._grants[secret.encode()] = identity
        return self._listener.name, secret

    @property
    def local_peers(self) -> int:
        """Peers whose requests come over a local connection."""
        return len(self._by_identity)

    def _poll_local(self, timeout: float, also: Sequence[zmq.Socket]) -> bool:
        # One poll of the ZeroMQ sockets and of an epoll set holding the listener and every connection, so a wait
        # costs the same with a thousand local peers as with one (a poll of a thousand descriptors: ~85 us).
        if self._arrived:
            timeout = 0.0
        listener, epoll = self._listener, self._epoll
        assert listener is not None and epoll is not None
        if self._zmq_fd >= 0 and not self._pending and not also:
            return self._poll_epoll(timeout, listener, epoll)
        items = self._local_items
        if self._pending or also:
            items = [*items, *((c.fd, _POLLOUT) for c in self._pending), *((s, _POLLIN) for s in also)]
        mine = ready = False
        for s, _ in zmq.zmq_poll(items, _ms(timeout)):
            if type(s) is not int:
                mine = mine or s is self.sock or s is self._closes
            elif s == self._epoll_fd:
                ready = True
            else:  # a connection with replies kept back now takes more
                conn = self._conns.get(s)
                if conn is None:
                    continue
                try:
                    if conn.flush():
                        self._pending.discard(conn)
                except ConnectionError:
                    self._forget_local(conn)
        if ready:
            mine = self._take_ready(epoll.poll(0, _MAX_LOCAL), listener) or mine
        self._zmq_used = True  # (zmq_poll read its events, and the wait may end with messages left unsignalled)
        self._zmq_waiting = mine
        return mine or bool(self._arrived)

    def _poll_epoll(self, timeout: float, listener: local.LocalListener, epoll: select.epoll) -> bool:
        """:meth:`_poll_local` as one epoll wait, the ZeroMQ socket's descriptor in the set: a request over a local
        connection then costs the shard one system call to wait and none for ZeroMQ's socket (through zmq_poll,
        five more: its first pass, and a ``getpid`` and a ``poll`` of the socket before and after the wait).

        ZeroMQ signals that descriptor when the socket has news (a message after its queue ran empty, among
        others), which reading its event flags takes in; a message may therefore wait unsignalled after the
        socket was used (:attr:`_zmq_used`), and the flags are read first then.
        """
        mine = False
        if self._zmq_used:
            mine = bool(_GET(self.sock, _EVENTS) & _POLLIN)
            self._zmq_used = False
            if mine:
                timeout = 0.0
        events = epoll.poll(-1 if timeout * 1000 >= _MAX_MS else max(0.0, timeout), _MAX_LOCAL)  # (as _ms: < 0 is 0)
        mine = self._take_ready(events, listener) or mine
        self._zmq_waiting = mine
        return mine or bool(self._arrived)

    def _take_ready(self, events: list[tuple[int, int]], listener: local.LocalListener) -> bool:
        """Take in what the epoll set reported (connections to accept, messages to read); True when ZeroMQ's
        socket has a message (its descriptor among ``events``)."""
        mine = False
        for fd, _ in events:
            if fd == self._zmq_fd:
                mine = mine or bool(_GET(self.sock, _EVENTS) & _POLLIN)  # (which takes the signal in)
            elif fd == listener.fd:
                self._accept_local(listener)
            else:
                conn = self._conns.get(fd)
                if conn is None:
                    continue
                conn.fill()  # (a closed connection reads as such)
                self._take_local(conn)
                if not conn.open:
                    self._forget_local(conn)
        return mine

    def _accept_local(self, listener: local.LocalListener) -> None:
        accepted = listener.accept()
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.identity is None and now - conn.since > _GREET_S:
                self._forget_local(conn)
                conn.close()  # (never greeted: a stranger holding a descriptor)
        for sock in accepted:
            conn = local.LocalConn(sock, self._max_frame)
            if len(self._conns) >= _MAX_LOCAL:
                conn.close()
                continue
            self._conns[conn.fd] = conn
            assert self._epoll is not None
            self._epoll.register(conn.fd, select.EPOLLIN)

    def _take_local(self, conn: local.LocalConn) -> None:
        """Move what ``conn`` received to the messages :meth:`recv` returns; its first message is the greeting."""
        messages = conn.messages
        while messages:
            frames = messages.popleft()
            if conn.identity is None:
                identity = self._grants.pop(bytes(frames[1]), None) if len(frames) == 2 and frames[0] == local.AUTH \
                    else None
                if identity is None:
                    conn.close()  # (no secret of ours: a stranger, or a worker whose grant was replaced)
                    return
                conn.identity = identity
                try:
                    conn.send([local.AUTH, b"ok"])
                except ConnectionError:
                    return
                continue
            if self._by_identity.get(conn.identity) is not conn:
                # The worker's first request over it: its replies go this way from now on (it sends nothing more
                # over ZeroMQ, and has no reply to come from there).
                old = self._by_identity.get(conn.identity)
                if old is not None:
                    self._forget_local(old)
                    old.close()
                self._by_identity[conn.identity] = conn
            self._arrived.append((conn.identity, frames))
            self.local_messages += 1

    def _forget_local(self, conn: local.LocalConn) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
            if self._epoll is not None:
                try:
                    self._epoll.unregister(conn.fd)
                except (OSError, ValueError):
                    pass  # (closed already: the kernel took it out of the set)
        self._pending.discard(conn)
        if conn.identity is not None and self._by_identity.get(conn.identity) is conn:
            del self._by_identity[conn.identity]  # (its replies go over ZeroMQ again)

    def _send_local(self, conn: local.LocalConn, frames: Sequence[Any]) -> bool:
        """Send a reply over ``conn``; False when it broke (the reply then goes over ZeroMQ).

        Raises
        ------
        SendDropped
            When the peer has taken nothing for the send timeout while more than :data:`_LOCAL_BACKLOG` bytes wait.
        """
        try:
            conn.send(frames)
            if conn.pending > _LOCAL_BACKLOG:
                deadline = time.monotonic() + self._send_timeout
                while not conn.flush():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SendDropped(f"a local peer took no reply for {self._send_timeout:g}s")
                    zmq.zmq_poll([(conn.fd, _POLLOUT)], _ms(min(left, 0.1), 1))
            if conn.pending:
                self._pending.add(conn)  # (the next waits poll for room and send the rest)
        except ConnectionError:
            self._forget_local(conn)
            return False
        return True


def _out_of_sockets(exc: zmq.ZMQError, endpoint: str) -> Exception:
    """The error for a socket ZeroMQ could not open: out of file descriptors (or of the context's sockets) says
    what to change; anything else is ZeroMQ's own error."""
    if exc.errno != errno.EMFILE:
        return exc
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return ResourceLimitError(
        f"cannot open a socket to {endpoint}: {exc.strerror} (this process may open {soft} files, and each "
        "client holds a socket and a handshake monitor per shard and for the scheduler, each a file, and more for "
        "their connections): raise the limit (ulimit -n), or run fewer workers per process (--clients)")


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
    keys : JobKeys, optional
        Connect with CURVE; None: no security.
    max_frame : int, optional
        The largest frame a valid reply holds; a peer sending a larger one is disconnected. None: no limit.
    """

    def __init__(self, context: zmq.Context, endpoint: str, hwm: int, *, keys: Optional[JobKeys] = None,
                 max_frame: Optional[int] = None) -> None:
        self.endpoint = endpoint
        #: Whether the shard is reached without a network (:func:`on_this_host`).
        self.local = on_this_host(endpoint)
        self._keys_dir = None if keys is None else str(keys.directory)
        self._sndtimeo = -1
        self._send_timeout: Optional[float] = None  # the seconds SNDTIMEO was set from
        self._more: Optional[bool] = False  # whether the last frame received has more after it; None: unknown
        try:
            self.sock = context.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise _out_of_sockets(exc, endpoint) from None
        _common(self.sock, hwm)
        _max_frame(self.sock, max_frame)
        if keys is not None:
            curve.connect_securely(self.sock, keys)
        # Watched with or without keys: a process without keys meeting a secured peer deserves the same advice.
        try:
            self.monitor = self.sock.get_monitor_socket(curve.HANDSHAKE_EVENTS)
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            raise _out_of_sockets(exc, endpoint) from None
        # The last handshake's failure, kept until one succeeds: ZeroMQ does not retry a connection refused by
        # ZAP, so every later wait must fail the same way instead of running into its timeout.
        self._failure: Optional[str] = None
        self._unfinished = 0  # keyless: handshakes in a row that ended without detail
        #: Handshakes that succeeded: more than one means the peer went away and came back (a restarted shard).
        self.connections = 0
        #: The Poller that waits on this channel: told whenever a monitor report is taken in, by whichever call
        #: reads it (a send, a receive, a wait), so that its owner compares connection counts then and only then.
        self.watcher: Optional[Poller] = None
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._max_frame = max_frame
        # A local connection (psrt.transport.local): attached and waiting for no request to be outstanding
        # (_ready), then in use (_conn); the message being read from it and its next frame.
        self._ready: Optional[local.LocalConn] = None
        #: A local connection greeted and not yet answered, with the time it is given up at.
        self._greeting: Optional[tuple[local.LocalConn, float]] = None
        self._conn: Optional[local.LocalConn] = None
        self._cur: Optional[list[Any]] = None
        self._cur_i = 0
        #: Whether a local connection was asked for since the peer was last (re)started; see :meth:`attach_local`.
        self.local_tried = False
        # Socket buffers are left to the kernel's autotuning: setting SO_SNDBUF/SO_RCVBUF turns autotuning off and
        # is capped by net.core.[rw]mem_max (often 208 KiB), which would starve a high bandwidth-delay link.
        self.sock.connect(endpoint)

    def check_handshake(self) -> None:
        """Take in the monitor's reports; raise if the latest handshake with the peer failed. Never blocks.

        Raises
        ------
        AuthenticationError
            Naming the endpoint, the cause ZeroMQ gives, and what to set.
        """
        took = False
        while True:
            try:
                event, value = monitor_event(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            took = True
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failure = None
                self._unfinished = 0
                self.connections += 1
            elif event == _NO_DETAIL and self._keys_dir is None and self._unfinished + 1 < UNFINISHED_HANDSHAKES:
                # Without keys a handshake that fails with no detail did not finish: the peer was too busy to greet
                # within the handshake interval, or dropped the connection. ZeroMQ connects again. Only a peer that
                # keeps dropping it (a secured one: keys on one side only) is a refusal.
                self._unfinished += 1
                continue
            else:
                self._failure = curve.handshake_advice(event, value, self.endpoint, self._keys_dir)
        if took and self.watcher is not None:
            self.watcher.heard = True  # (after the counts moved: whoever reads the flag reads them as they are)
        if self._failure is not None:
            raise AuthenticationError(self._failure, endpoint=self.endpoint)

    @property
    def refused(self) -> bool:
        """True while the latest handshake with the peer failed (as far as the monitor has been read)."""
        return self._failure is not None

    def send(self, frames: Sequence[Any], timeout: float) -> None:
        """Queue a request; blocks at most ``timeout`` seconds when the send queue is full.

        Raises
        ------
        AuthenticationError
            When the handshake with the peer failed (see :meth:`check_handshake`).
        ShardTimeoutError
            When the request could not be queued in time.
        ConnectionLostError
            When the socket is closed.
        """
        # A refused handshake leaves no connection to queue on (ZAP refusals are not retried): say so now rather
        # than after the send timeout. Once a handshake succeeded there is a queue, and every wait reads the
        # monitor (Poller), so only a channel that never connected pays for reading its event flags per send.
        if self._failure is not None or (not self.connections and self.monitor.getsockopt(_EVENTS) & _POLLIN):
            self.check_handshake()
        if self._conn is not None and self._send_local(frames, timeout):
            return
        if timeout != self._send_timeout:  # (a client sends with the same timeout every time)
            timeout_ms = _ms(timeout, 1)
            if timeout_ms != self._sndtimeo:
                self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
                self._sndtimeo = timeout_ms
            self._send_timeout = timeout
        try:
            if len(frames) == 2 and len(frames[1]) < ZERO_COPY_BYTES:  # a small request (a header and one buffer)
                _SEND(self.sock, frames[0], _SNDMORE, True, False)
                _SEND(self.sock, frames[1], 0, True, False)
            else:
                _send_frames(self.sock, frames, track=False)
        except zmq.Again:
            self.check_handshake()  # the handshake may have failed while the send waited
            raise ShardTimeoutError(
                f"shard {self.endpoint} did not accept a request within {timeout:.1f}s (send queue full)",
                shard=self.endpoint,
            ) from None
        except zmq.ZMQError as exc:
            raise ConnectionLostError(f"cannot send to shard {self.endpoint}: {exc}") from None

    def repoint(self, endpoint: str) -> None:
        """Connect to ``endpoint`` instead (the peer restarted there); requests still queued for the old one are
        dropped, and the handshake with the new one counts in :attr:`connections` as a reconnection does."""
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # never connected there, or already gone
        self.endpoint, self._failure = endpoint, None
        self.local = on_this_host(endpoint)
        self.reset_local()
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ConnectionLostError(f"cannot connect to shard {endpoint}: {exc}") from None

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message to arrive.

        Raises
        ------
        AuthenticationError
            When the handshake with the peer failed (see :meth:`check_handshake`).
        """
        if self._failure is not None:
            self.check_handshake()
        if self._conn is not None and self._local_waiting():
            return True
        events = dict(self._poller.poll(_ms(timeout)))
        if self.monitor in events:
            self.check_handshake()
        return self.sock in events

    def readable(self) -> bool:
        """True when a message is waiting (no system call beyond reading the socket's event flags)."""
        if self._conn is not None and self._local_waiting():
            return True
        return bool(self.sock.getsockopt(_EVENTS) & _POLLIN)

    def recv_frame(self) -> bytes:
        """Receive the next frame (the header of a reply); a message must be ready (see :class:`Poller`)."""
        if self._conn is not None and self._local_waiting():
            return self._local_head()
        frame = self.sock.recv(_NOBLOCK, copy=False)
        self._more = frame.more  # a received zmq.Frame knows; asking the socket costs a getsockopt
        self._cur = None
        return frame.bytes

    def try_recv_frame(self, look: bool = False) -> Optional[bytes]:
        """The next message's first frame (a reply's header) if one is queued, else None; never waits.

        Cheaper than a poll when a message is there (no system call), dearer when none is (pyzmq's exception
        costs three times a read of the socket's event flags: its message is looked up and built). ``look``: read
        the flags first, for a caller that expects to find nothing more often than something.
        """
        conn = self._conn
        if conn is not None:
            if conn.messages or (not look and self._local_waiting()):
                return self._local_head()  # (``look``: what has arrived and not been read waits for the next poll)
            if self._conn is not None:
                # Its replies come over the local connection. The ZeroMQ socket brings only the reply to a request
                # sent that way before the connection formed (one sent again after a shard's restart) or a late
                # one to an abandoned call: rare, and the Poller's full read of the sockets, every
                # MONITOR_INTERVAL, takes it in (a look at it here would cost every call two system calls).
                return None
        if look and not _GET(self.sock, _EVENTS) & _POLLIN:
            return None
        try:
            frame = self.sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._more = frame.more
        self._cur = None
        return frame.bytes

    def more(self) -> bool:
        """True when the current message has further frames."""
        if self._cur is not None:
            return self._cur_i < len(self._cur)
        more = self._more
        if more is None:
            more = self._more = bool(self.sock.getsockopt(_RCVMORE))
        return more

    def recv_into(self, buffer: Any) -> int:
        """Receive the next frame of the current message into ``buffer`` (a writable bytes-like object; as much of
        the frame as fits); returns the frame's size."""
        # As a zmq.Frame, copied once into the buffer: the frame says whether more follow, which pyzmq's own
        # recv_into does not, and asking the socket (RCVMORE) costs more than the frame (pyzmq looks every option
        # up in an enum). The frame is ZeroMQ's message itself, so the bytes are copied once either way.
        if self._cur is not None:
            data = self._cur[self._cur_i]
            self._cur_i += 1
            data = data if type(data) is memoryview else memoryview(data)
        else:
            frame = self.sock.recv(_NOBLOCK, copy=False)
            self._more = frame.more
            data = frame.buffer
        size = len(data)
        view = buffer if type(buffer) is memoryview and buffer.format == "B" else memoryview(buffer).cast("B")
        if size == view.nbytes:
            view[:] = data
        else:
            fits = min(size, view.nbytes)
            view[:fits] = data[:fits]
        return size

    def recv_buffer(self) -> memoryview:
        """Receive the next frame of the current message, zero-copy: its bytes as a memoryview of ZeroMQ's message
        (to read, not to write; it keeps the message alive while it is held)."""
        if self._cur is not None:
            data = self._cur[self._cur_i]
            self._cur_i += 1
            return data if type(data) is memoryview else memoryview(data)
        frame = self.sock.recv(_NOBLOCK, copy=False)
        self._more = frame.more
        return frame.buffer

    def discard_rest(self) -> None:
        """Drop the remaining frames of the current message."""
        if self._cur is not None:
            self._cur_i = len(self._cur)
            return
        while self.more():
            self._more = self.sock.recv(_NOBLOCK, copy=False).more

    # ------------------------------------------------------------------ local connection
    def attach_local(self, name: str, secret: str, timeout: float) -> None:
        """Connect to the shard's local listener ``name`` and greet it with ``secret`` (its ``local`` answer),
        without waiting for its answer: once it accepts (:attr:`local_ready`, within ``timeout`` seconds, else the
        connection is given up), requests take that connection from the moment the caller, with none outstanding,
        says :meth:`switch_local` (:mod:`psrt.transport.local`).

        Raises
        ------
        OSError
            When the listener cannot be reached (the requests stay on ZeroMQ).
        """
        self.local_tried = True
        conn = local.begin(name, secret, self._max_frame, connect_s=min(timeout, 1.0))
        for old in self._local_conns():
            if old is not self._conn:  # (the one in use stays until the switch)
                old.close()
        self._ready, self._greeting = None, (conn, time.monotonic() + timeout)

    def _local_conns(self) -> list[local.LocalConn]:
        """The local connections this channel holds: attached, greeted and not yet answered, in use."""
        greeting = self._greeting[0] if self._greeting is not None else None
        return [c for c in (self._ready, greeting, self._conn) if c is not None]

    @property
    def local_connected(self) -> bool:
        """Whether requests now take a local connection."""
        return self._conn is not None

    @property
    def local_ready(self) -> bool:
        """Whether a local connection is attached, accepted, and waits for :meth:`switch_local` (reads the
        shard's answer to the greeting if it was not in yet; never waits)."""
        if self._ready is None and self._greeting is not None:
            conn, deadline = self._greeting
            try:
                if local.greeted(conn):
                    self._ready, self._greeting = conn, None
                elif time.monotonic() > deadline:
                    raise OSError("no answer to the greeting")
            except OSError as exc:
                conn.close()
                self._greeting = None
                log.info("%s: no local connection (%s); requests stay on ZeroMQ", self.endpoint, exc)
        return self._ready is not None

    def switch_local(self) -> None:
        """Send the requests from now on over the attached local connection. The caller has no request to the
        peer outstanding, so every reply to what went over ZeroMQ is in and nothing sent over the two can cross
        (a late reply to an abandoned call may still come over ZeroMQ: a wait reads both)."""
        if self._ready is not None:
            self._conn, self._ready = self._ready, None
            if self.watcher is not None:
                self.watcher.relocal()

    def reset_local(self) -> None:
        """Stop using the local connection (the peer restarted or moved): requests go over ZeroMQ, and a new one
        may be asked for (:attr:`local_tried` is False again)."""
        for conn in self._local_conns():
            conn.close()
        had = self._conn is not None
        self._ready = self._conn = self._cur = self._greeting = None
        self.local_tried = False
        if had and self.watcher is not None:
            self.watcher.relocal()

    def _lost_local(self) -> None:
        """The local connection broke: from now on requests go over ZeroMQ again (those in flight on it are
        answered only if the shard restarts and they are sent again, as after any restart)."""
        conn, self._conn, self._cur = self._conn, None, None
        if conn is not None:
            conn.close()
            if self.watcher is not None:
                self.watcher.relocal()

    def _local_waiting(self) -> bool:
        """Whether a whole message from the local connection waits (reading what arrived if none does)."""
        conn = self._conn
        assert conn is not None
        if conn.messages:
            return True
        if not conn.fill():
            self._lost_local()
            return False
        return bool(conn.messages)

    def _local_head(self) -> bytes:
        conn = self._conn
        assert conn is not None
        self._cur = conn.messages.popleft()
        self._cur_i = 1
        return self._cur[0]

    def _send_local(self, frames: Sequence[Any], timeout: float) -> bool:
        """Send a request over the local connection; False when it broke (the request then goes over ZeroMQ).

        Raises
        ------
        ShardTimeoutError
            When more than :data:`_LOCAL_BACKLOG` bytes stayed unsent for ``timeout`` seconds.
        """
        conn = self._conn
        assert conn is not None
        try:
            conn.send(frames)
            if conn.pending > _LOCAL_BACKLOG:
                # Wait for the shard to take them, reading its replies meanwhile (it may be waiting for room to
                # send them).
                deadline = time.monotonic() + timeout
                while not conn.flush():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ShardTimeoutError(f"shard {self.endpoint} did not accept a request within "
                                                f"{timeout:.1f}s (local connection full)", shard=self.endpoint)
                    zmq.zmq_poll([(conn.fd, _POLLIN | _POLLOUT)], _ms(min(left, 0.1), 1))
                    if not conn.fill():
                        raise ConnectionError("closed")
        except ConnectionError:
            self._lost_local()
            return False
        return True

    def close(self) -> None:
        """Close the socket (and its monitor) without lingering."""
        for conn in self._local_conns():
            conn.close()
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


class Poller:
    """Waits on several DEALER channels (and their handshake monitors) at once.

    The monitors are read at most every :data:`MONITOR_INTERVAL` seconds, and by every wait that blocks longer:
    a handshake happens once per connection, while a worker that keeps many calls in flight polls its sockets
    several times per reply, and with a socket and a monitor per shard the monitors were half of every poll's
    cost (a poll without a wait over 16 channels: 25 us with the monitors, 13-15 us without, here). A refused
    handshake or a shard that came back is therefore heard within that interval, and at once by a wait that has
    nothing else to do.

    :attr:`heard` is set whenever any call takes in a monitor's report of one of these channels (a send that finds
    the first handshake, a wait): a count that moved unseen would make a shard's return look like its first
    connection, and what it never answered would never be sent again.
    """

    def __init__(self, channels: Sequence[DealerChannel]) -> None:
        # zmq_poll on fixed item lists: zmq.Poller would rebuild nothing less but adds a call per wait.
        self._sockets: list[tuple[zmq.Socket, int]] = []
        self._items: list[tuple[zmq.Socket, int]] = []
        self._by_sock: dict[zmq.Socket, int] = {}
        self._monitors: dict[zmq.Socket, DealerChannel] = {}
        for index, ch in enumerate(channels):
            self._sockets.append((ch.sock, _POLLIN))
            self._items.append((ch.sock, _POLLIN))
            self._by_sock[ch.sock] = index
            self._items.append((ch.monitor, _POLLIN))
            self._monitors[ch.monitor] = ch
            ch.watcher = self
        self._channels = list(channels)
        self._watch_at = 0.0  # when the monitors are next read (time.monotonic)
        #: Set when a monitor's report was taken in (a handshake came or failed), by a wait or by any other call on
        #: a channel: the caller's connection counts may have moved. The caller clears it.
        self.heard = False
        #: The channels whose requests take a local connection: ``(index, channel)``, and their descriptors.
        self._locals: list[tuple[int, DealerChannel]] = []
        self._by_fd: dict[int, int] = {}
        self._local_items: list[Any] = []  # what _wait_local polls (each connection with requests kept back: +POLLOUT)
        # What it polls between two reads of the monitors: the sockets of the channels still on ZeroMQ, and the
        # local connections (whose channels' ZeroMQ sockets bring only what was asked that way before the
        # connection formed, or a late reply to an abandoned call: read with the monitors).
        self._quiet_socks: list[Any] = []
        self._quiet_items: list[Any] = []

    def relocal(self) -> None:
        """A channel started or stopped using a local connection: wait on its descriptor, or no longer."""
        self._locals = [(i, ch) for i, ch in enumerate(self._channels) if ch._conn is not None]
        self._by_fd = {ch._conn.fd: i for i, ch in self._locals}  # type: ignore[union-attr]
        fds = [(fd, _POLLIN) for fd in self._by_fd]
        self._local_items = [*self._items, *fds]
        self._quiet_socks = [(ch.sock, _POLLIN) for ch in self._channels if ch._conn is None]
        self._quiet_items = [*self._quiet_socks, *fds]

    def wait(self, timeout: float) -> list[int]:
        """Indices of the channels with a reply ready, after waiting at most ``timeout`` seconds.

        Raises
        ------
        AuthenticationError
            When the handshake with one of the peers failed.
        """
        for ch in self._channels:
            if ch._failure is not None:
                ch.check_handshake()
        if self._locals:
            return self._wait_local(timeout)
        now = time.monotonic()
        if now < self._watch_at:
            # The monitors were read a moment ago: the sockets alone, until they are due again.
            if timeout <= 0:
                return [self._by_sock[s] for s, _ in zmq.zmq_poll(self._sockets, 0)]
            slice_ = min(timeout, self._watch_at - now)
            ready = [self._by_sock[s] for s, _ in zmq.zmq_poll(self._sockets, max(0, int(slice_ * 1000)))]
            if ready or slice_ >= timeout:
                return ready
            timeout -= time.monotonic() - now  # nothing yet, and the wait goes on: the monitors too
        ready = []
        ms = -1 if timeout * 1000 >= _MAX_MS else max(0, int(timeout * 1000))  # _ms, inline: a wait per reply
        for s, _ in zmq.zmq_poll(self._items, ms):
            ch = self._monitors.get(s)
            if ch is not None:
                ch.check_handshake()  # (which sets heard)
            else:
                ready.append(self._by_sock[s])
        self._watch_at = time.monotonic() + MONITOR_INTERVAL
        return ready

    def _wait_local(self, timeout: float) -> list[int]:
        """:meth:`wait` with local connections: their whole messages count, a partial one waits for its rest."""
        ready = [i for i, ch in self._locals if ch._conn is not None and ch._conn.messages]
        if ready:
            return ready
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            # Once a channel's requests take its local connection, its replies come that way: its ZeroMQ socket
            # and every monitor are read every MONITOR_INTERVAL only (what a poll of them costs: a getpid and a
            # poll per ZeroMQ socket after every wake-up, 16 system calls with 4 shards; with a wait per reply,
            # most of what a call to 4 shards costs its caller in system calls).
            quiet = now < self._watch_at
            if any(ch._conn is not None and ch._conn.pending for _, ch in self._locals):
                fds = [(ch._conn.fd, _POLLIN | (_POLLOUT if ch._conn.pending else 0))
                       for _, ch in self._locals if ch._conn is not None]
                items = [*(self._quiet_socks if quiet else self._items), *fds]
            else:
                items = self._quiet_items if quiet else self._local_items
            left = deadline - now
            if quiet:
                left = min(left, self._watch_at - now)  # (then the full poll)
            else:
                self._watch_at = now + MONITOR_INTERVAL
            lost = []
            for s, events in zmq.zmq_poll(items, _ms(max(0.0, left))):
                if type(s) is int:
                    index = self._by_fd.get(s)
                    if index is None:
                        continue
                    ch = self._channels[index]
                    conn = ch._conn
                    if conn is None:
                        continue
                    try:
                        if events & _POLLOUT:
                            conn.flush()
                    except ConnectionError:
                        pass
                    if not conn.fill() and not conn.messages:
                        lost.append(ch)
                    elif conn.messages:
                        ready.append(index)
                    continue
                ch = self._monitors.get(s)
                if ch is not None:
                    ch.check_handshake()  # (which sets heard)
                else:
                    ready.append(self._by_sock[s])
            for ch in lost:
                ch._lost_local()
            if ready or lost or time.monotonic() >= deadline:
                return ready
