"""Same-host connections: a worker and a shard of one host exchange their messages over a Unix socket of their
own, past ZeroMQ's I/O threads.

Over ZeroMQ a message crosses four threads: the sender's I/O thread (woken through its mailbox), the kernel,
the receiver's I/O thread, and the receiver (woken through its mailbox again), and a reply as many back. On a
busy host each wake-up is a context switch, and they, not the bytes, are most of what a small message costs:
a 1 KiB request and its reply between two processes of this 2-core machine took 142-160 us over a DEALER and a
ROUTER (``ipc://`` or loopback TCP alike) and 56-62 us over a bare Unix socket, the client's CPU 70-78 us against
24 us. Between a worker and a shard that share a host, every tensor byte already goes through a shared-memory
lane (:mod:`psrt.shm.lanes`) and the socket carries only headers, so those wake-ups are the whole cost of a
call.

So a worker that shares a host with a shard asks it for a *local connection*, proving where it runs with the
token of the shard's beacon (a file in /dev/shm, :mod:`psrt.shm.lanes`), at its first calls to the shard. The
shard answers, over the authenticated ZeroMQ socket, with the name of its listening socket in Linux's abstract
namespace (which exists only within one kernel and network namespace: a worker elsewhere cannot reach it) and a
secret for this worker; small calls, whose bytes take no lane, then leave ZeroMQ as well. The worker connects
and presents the secret; the shard ties the connection to the worker's ZeroMQ identity. From the first request
the worker sends over it (which it does only with no request outstanding, so nothing sent over the two paths
can cross), everything between the two goes that way, and the replies return on it. The shard waits on all its
local connections through one epoll set, so a wait costs the same with a thousand of them as with one. A
connection that breaks ends its use: the worker's next requests go over ZeroMQ again
(:class:`psrt.transport.DealerChannel`).

A message is framed as ``u32 frame count, u64 length of each frame, the frames``; a reader refuses more than
:data:`MAX_FRAMES` frames or a frame longer than its limit by closing the connection, as ZeroMQ's
``MAXMSGSIZE`` does. Neither end ever blocks on the other: what the kernel does not take at once is copied and
kept (:attr:`LocalConn.pending`) and written when the socket can take it, and a reader takes what has arrived
and splits off the whole messages (:meth:`LocalConn.fill`). Linux only (abstract sockets); elsewhere, and
with ``PSRT_SHM=0``, everything stays on ZeroMQ.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import sys
import time
from collections import deque
from typing import Any, Optional, Sequence

__all__ = ["MAX_FRAMES", "AUTH", "LocalConn", "LocalListener", "begin", "greeted", "connect", "available"]

#: The most frames a message may have (a push of many tensors over a socket has a frame per tensor).
MAX_FRAMES = 1 << 16
#: The first frame of the greeting a worker sends (with the secret) and of the shard's answer (with ``ok``).
AUTH = b"psrt-local-1"
#: The bytes a connection reads at a time; a message longer than half of it is read into a buffer of its own.
_CHUNK = 1 << 18
#: Buffers per ``sendmsg`` (Linux takes at most 1024).
_IOV = 512
_COUNT = struct.Struct("<I")


def available() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


class LocalConn:
    """One end of a local connection: framed messages in both directions, never blocking.

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` stream socket (made non-blocking here).
    max_frame : int, optional
        The longest frame a valid message holds; a longer one closes the connection. None: no limit.
    """

    def __init__(self, sock: socket.socket, max_frame: Optional[int] = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.max_frame = max_frame
        #: Whole messages received and not yet taken, each a list of frames (the first as ``bytes``, the others
        #: read-only memoryviews).
        self.messages: deque[list[Any]] = deque()
        #: False once the peer closed the connection, broke it or sent what no message is.
        self.open = True
        #: Who the shard end found the greeting's secret for (a ZeroMQ identity); None until then.
        self.identity: Optional[bytes] = None
        self._in = bytearray(_CHUNK)
        self._have = 0
        self._big: Optional[bytearray] = None  # a long message being read into its own buffer
        self._big_have = 0
        self._big_lens: tuple[int, ...] = ()
        self._out: deque[bytes] = deque()
        #: Bytes given to :meth:`send` that the kernel has not taken yet.
        self.pending = 0
        #: When it was made (time.monotonic): a shard closes one left without a greeting.
        self.since = time.monotonic()

    # ------------------------------------------------------------------ sending
    def send(self, frames: Sequence[Any]) -> None:
        """Send one message; what the socket does not take now is copied and sent by :meth:`flush`.

        Raises
        ------
        ConnectionError
            When the connection is broken (it is then closed).
        """
        if not self.open:
            raise ConnectionError("the local connection is closed")
        lens = [_nbytes(f) for f in frames]
        n = len(lens)
        head = _COUNT.pack(n) + struct.pack(f"<{n}Q", *lens)
        if self._out:
            self._queue([head, *frames], 0)
            self.flush()
            return
        parts = [head, *frames]
        total = len(head) + sum(lens)
        sent = 0
        try:
            if len(parts) <= _IOV:
                sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.close()
            raise ConnectionError(f"the local connection broke: {exc}") from None
        if sent < total:
            self._queue(parts, sent)
            self.flush()

    def _queue(self, parts: list[Any], skip: int) -> None:
        """Keep copies of ``parts`` after their first ``skip`` bytes (the caller may change its buffers once a send
        returns, as after a ZeroMQ send of a small frame)."""
        for part in parts:
            view = memoryview(part).cast("B") if type(part) is not bytes else part
            size = len(view)
            if skip >= size:
                skip -= size
                continue
            chunk = bytes(view[skip:]) if skip or type(part) is not bytes else part
            skip = 0
            self._out.append(chunk)
            self.pending += len(chunk)

    def flush(self) -> bool:
        """Write what is kept back, as far as the socket takes it now; True when nothing is left.

        Raises
        ------
        ConnectionError
            When the connection is broken (it is then closed).
        """
        out = self._out
        while out:
            batch = [out[i] for i in range(min(len(out), _IOV))]
            try:
                sent = self.sock.sendmsg(batch)
            except BlockingIOError:
                return False
            except OSError as exc:
                self.close()
                raise ConnectionError(f"the local connection broke: {exc}") from None
            self.pending -= sent
            while sent:
                first = out[0]
                if sent >= len(first):
                    sent -= len(first)
                    out.popleft()
                else:
                    out[0] = first[sent:]
                    sent = 0
        return True

    # ------------------------------------------------------------------ receiving
    def fill(self) -> bool:
        """Read what has arrived (never waits) and split off the whole messages into :attr:`messages`; False once
        the connection is closed (by the peer, a failure, or a message no reader may take)."""
        if not self.open:
            return False
        recv_into = self.sock.recv_into
        while True:
            if self._big is not None:
                view = memoryview(self._big)[self._big_have:]
            else:
                if self._have == len(self._in):
                    self._in.extend(bytes(len(self._in)))  # a header longer than the buffer (many frames)
                view = memoryview(self._in)[self._have:]
            want = len(view)
            try:
                got = recv_into(view)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self.close()
                return False
            if got == 0:
                self.close()
                return False
            if self._big is not None:
                self._big_have += got
                if self._big_have == len(self._big):
                    self.messages.append(_frames(self._big, self._big_lens))
                    self._big = None
            else:
                self._have += got
                if not self._split():
                    self.close()
                    return False
            if got < want:
                return True  # (a short read: nothing more has arrived)

    def _split(self) -> bool:
        buf, have, pos = self._in, self._have, 0
        ok = True
        while have - pos >= 4:
            (n,) = _COUNT.unpack_from(buf, pos)
            if not 0 < n <= MAX_FRAMES:
                ok = False
                break
            start = pos + 4 + 8 * n
            if have < start:
                break
            lens = struct.unpack_from(f"<{n}Q", buf, pos + 4)
            if self.max_frame is not None and max(lens) > self.max_frame:
                ok = False
                break
            end = start + sum(lens)
            if end <= have:
                self.messages.append(_frames(bytes(buf[start:end]), lens))
                pos = end
            elif end - start > _CHUNK // 2:
                # Long: read the rest straight into a buffer of its own.
                self._big = bytearray(end - start)
                self._big[:have - start] = buf[start:have]
                self._big_have, self._big_lens = have - start, lens
                pos = have
                break
            else:
                break
        if pos:
            rest = have - pos
            buf[:rest] = buf[pos:have]
            self._have = rest
        return ok

    def close(self) -> None:
        """Close the socket (idempotent); whole messages received stay in :attr:`messages`."""
        if self.open:
            self.open = False
            self._out.clear()
            self.pending = 0
            try:
                self.sock.close()
            except OSError:
                pass


def _frames(body: Any, lens: Sequence[int]) -> list[Any]:
    """A message's frames over one buffer: the first as ``bytes`` (a header, which every reader wants so), the
    others as read-only memoryviews of it."""
    view = memoryview(body).toreadonly()
    frames: list[Any] = []
    at = 0
    for i, size in enumerate(lens):
        frames.append(bytes(view[at:at + size]) if i == 0 else view[at:at + size])
        at += size
    return frames


class LocalListener:
    """A shard's listening socket in the abstract namespace, under a random name; what it accepts are greeted
    by :class:`psrt.transport.RouterChannel`.

    Raises
    ------
    OSError
        When the platform has no abstract sockets or the socket cannot be made.
    """

    def __init__(self) -> None:
        if not available():
            raise OSError("local connections need Linux's abstract Unix sockets")
        self.name = f"psrt-{secrets.token_hex(12)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind("\0" + self.name)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()

    def accept(self) -> list[socket.socket]:
        """The connections waiting (never blocks)."""
        out = []
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out  # (out of descriptors: the peer stays on ZeroMQ)
            out.append(sock)

    def close(self) -> None:
        """Stop listening."""
        self.sock.close()


def begin(name: str, secret: str, max_frame: Optional[int] = None, connect_s: float = 1.0) -> LocalConn:
    """Connect to a shard's listener ``name`` and send the greeting with ``secret``; the shard's answer is then
    read by :func:`greeted` (a worker's call never waits for it: a shard stopped since it granted the secret would
    hold the call).

    Raises
    ------
    OSError
        When the listener cannot be reached within ``connect_s`` seconds (another host or network namespace, or a
        backlog of connections the shard does not take) or the greeting cannot be sent.
    """
    if not available():
        raise OSError("local connections need Linux's abstract Unix sockets")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(connect_s)
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        raise
    conn = LocalConn(sock, max_frame)
    try:
        conn.send([AUTH, secret.encode()])
    except ConnectionError as exc:
        conn.close()
        raise OSError(str(exc)) from None
    return conn


def greeted(conn: LocalConn) -> bool:
    """Whether the shard accepted the greeting :func:`begin` sent over ``conn`` (never waits; False: no answer
    yet).

    Raises
    ------
    OSError
        When the shard refused (it closed the connection) or answered what no greeting does; ``conn`` is closed.
    """
    try:
        if conn.pending:
            conn.flush()
        if not conn.fill() and not conn.messages:
            raise OSError("the shard closed the local connection (refused)")
    except ConnectionError as exc:
        conn.close()
        raise OSError(str(exc)) from None
    except OSError:
        conn.close()
        raise
    if not conn.messages:
        return False
    answer = conn.messages.popleft()
    if len(answer) != 2 or answer[0] != AUTH or bytes(answer[1]) != b"ok":
        conn.close()
        raise OSError("the shard's local listener answered what no greeting does")
    return True


def connect(name: str, secret: str, timeout: float, max_frame: Optional[int] = None) -> LocalConn:
    """Connect to a shard's listener ``name`` and present ``secret``; the connection once the shard accepted it
    (:func:`begin`, then a wait of up to ``timeout`` seconds for :func:`greeted`).

    Raises
    ------
    OSError
        When the listener cannot be reached (another host or network namespace), the shard refused the secret, or
        it did not answer within ``timeout`` seconds.
    """
    conn = begin(name, secret, max_frame, connect_s=timeout)
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(conn.fd, select.POLLIN)
    while not greeted(conn):
        left = deadline - time.monotonic()
        if left <= 0:
            conn.close()
            raise OSError(f"the shard's local listener {name} did not answer within {timeout:.1f}s")
        poller.poll(max(1, int(left * 1000)))
    return conn
