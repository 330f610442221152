"""CURVE for psrt's sockets: the job's keys on every socket, a ZAP handler that admits only the job's client key,
and advice when a handshake fails. Part of the transport: with it, the only code that touches ZeroMQ.

Serving sockets are CURVE servers with a ZAP domain and ``ZAP_ENFORCE_DOMAIN`` (CURVE fails open without a ZAP
handler; with it, a missing handler fails closed), and their context runs a ZAP handler (one thread, only when
keys are on) that accepts only the job's client key. Connecting sockets carry the server's public key and the
client pair.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from typing import Any, Optional, Union

import zmq
import zmq.auth
import zmq.utils.z85

__all__ = ["ZAP_DOMAIN", "Context", "create_certificates", "read_certificate", "authenticate", "serve_securely",
           "connect_securely", "handshake_advice", "HANDSHAKE_EVENTS"]

log = logging.getLogger("psrt.auth")

#: A :class:`psrt.control.security.JobKeys` (not imported here: security builds on the transport, not the reverse).
JobKeys = Any

#: The ZAP domain of psrt's serving sockets.
ZAP_DOMAIN = "psrt"

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: What a connecting socket's monitor reports: only handshakes, so it is silent in the steady state.
HANDSHAKE_EVENTS = _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class Context(zmq.Context):
    """A context that stops its ZAP handler, when it runs one, before terminating (else ``term`` would hang on
    the handler's socket)."""

    _authenticator: Any = None

    def term(self) -> None:
        auth, self._authenticator = self._authenticator, None
        if auth is not None:
            auth.stop()
        super().term()


def create_certificates(directory: Union[str, os.PathLike], name: str) -> None:
    """Write a new CURVE key pair as ``name.key`` and ``name.key_secret`` (ZeroMQ certificate format)."""
    zmq.auth.create_certificates(os.fspath(directory), name)


def read_certificate(path: Union[str, os.PathLike]) -> tuple[bytes, Optional[bytes]]:
    """The z85 public key and secret key (None in a public certificate) of a certificate file.

    Raises
    ------
    OSError
        When the file cannot be read.
    ValueError
        When it holds no key.
    """
    return zmq.auth.load_certificate(os.fspath(path))


class _OnlyKey:
    """ZAP credentials check: the job's client key and no other; each refused key is logged once."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed
        self._refused: set[bytes] = set()

    def __call__(self, key: bytes) -> bool:
        if hmac.compare_digest(key, self.allowed):
            return True
        if key not in self._refused and len(self._refused) < 64:  # a retrying peer must not flood the log
            self._refused.add(key)
            log.warning("refused a connection with CURVE client key %s: it is not the job's client key",
                        key.decode("ascii", "replace"))
        return False


#: Where ZeroMQ asks a context's ZAP handler (RFC 27).
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"


class ZapHandler:
    """A context's ZAP handler (ZeroMQ RFC 27): one thread that admits CURVE peers in :data:`ZAP_DOMAIN` whose
    client key passes ``check``, and refuses every other CURVE or PLAIN peer.

    Written here rather than taken from ``zmq.auth.thread``, which runs an asyncio loop on its thread and reaches
    ZeroMQ's edge-triggered descriptors through it: a plain blocking poll has no missed wake-up to fear, answers
    each handshake at once, and imports no asyncio into a process that only wants its keys checked.
    """

    def __init__(self, context: zmq.Context, check: Any) -> None:
        self._check = check
        # The handler's socket is bound before the thread starts: no serving socket may handshake before it.
        self._zap = context.socket(zmq.ROUTER)  # libzmq's side is a REQ-shaped pipe: identity, empty, request
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._wake_endpoint = f"inproc://psrt.zap.stop.{id(self)}"
        self._wake = context.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_endpoint)
        self._stop = context.socket(zmq.PAIR)
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.connect(self._wake_endpoint)
        self._thread = threading.Thread(target=self._run, name="psrt-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())  # ZeroMQ's own wait: stop() wakes it
                if self._wake in events:
                    return
                while True:
                    try:
                        request = self._zap.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self.answer(request)
                    if reply is not None:
                        self._zap.send_multipart(reply)
        except zmq.ZMQError:
            return  # the context is going away
        finally:
            self._zap.close(linger=0)
            self._wake.close(linger=0)

    def answer(self, request: list[bytes]) -> Optional[list[bytes]]:
        """The reply frames to one ZAP request (routing prefix included); None for frames no ZeroMQ would send."""
        try:
            empty = request.index(b"")
        except ValueError:
            return None
        route, body = request[:empty + 1], request[empty + 1:]
        if len(body) < 6:
            return None
        version, request_id, domain, _address, _identity, mechanism = body[:6]
        credentials = body[6:]
        if version != _ZAP_VERSION:
            return [*route, _ZAP_VERSION, request_id, b"400", b"unsupported ZAP version", b"", b""]
        if mechanism == b"NULL":
            # Only sockets without CURVE ask this (none of psrt's serving sockets when keys are on); ZeroMQ's own
            # default without a handler is to admit them.
            return [*route, version, request_id, b"200", b"OK", b"", b""]
        if (mechanism == b"CURVE" and domain == ZAP_DOMAIN.encode() and len(credentials) == 1
                and len(credentials[0]) == 32 and self._check(zmq.utils.z85.encode(credentials[0]))):
            return [*route, version, request_id, b"200", b"OK", b"", b""]
        return [*route, version, request_id, b"400", b"not the job's client key", b"", b""]

    def stop(self) -> None:
        """End the thread (its sockets closed with it); call before terminating the context."""
        if self._thread.is_alive():
            try:
                self._stop.send(b"")
            except zmq.ZMQError:
                pass
            self._thread.join(5)
        self._stop.close(linger=0)


def authenticate(context: zmq.Context, keys: JobKeys) -> None:
    """Run the context's ZAP handler (one thread), accepting only the job's client key in :data:`ZAP_DOMAIN`."""
    if not isinstance(context, Context):
        raise TypeError("serving with keys needs a context from psrt.transport.new_context()")
    if context._authenticator is not None:
        return
    context._authenticator = ZapHandler(context, _OnlyKey(keys.client_public))


def serve_securely(sock: zmq.Socket, keys: JobKeys) -> None:
    if keys.server_secret is None:
        raise ValueError("serving with keys needs the server's secret key")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def connect_securely(sock: zmq.Socket, keys: JobKeys) -> None:
    if keys.client_secret is None:
        raise ValueError("connecting with keys needs the client's secret key")
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def _protocol_error_name(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name[len("PROTOCOL_ERROR_"):].lower()
    return f"{value:#x}"


def handshake_advice(event: int, value: int, endpoint: str, keys_dir: Optional[str]) -> str:
    """What a failed handshake with ``endpoint`` means, and what to set."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        cause = (f"{endpoint} refused this process's CURVE client key (ZAP status {value}): it is not the "
                 "job's client key")
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        cause = f"the security handshake with {endpoint} failed ({_protocol_error_name(value)})"
    else:
        cause = (f"the security handshake with {endpoint} failed (keys of another job, or keys on one "
                 "side only)")
    mine = (f"this process uses the keys in {keys_dir}" if keys_dir
            else "this process runs without keys")
    return (f"{cause}; {mine}. Every process of a job must use the job's keys: set PSRT_KEYS (or --keys) to "
            "the job's key directory (`psrt keygen DIR` makes one)")
