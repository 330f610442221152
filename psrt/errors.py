"""The one error tree of psrt.

Every error is a :class:`PsrtError` and also the builtin that matches its meaning, so ``except ValueError``
keeps working for callers that do not know psrt.
"""

from __future__ import annotations

__all__ = [
    "PsrtError",
    "ConfigError",
    "PsrtTypeError",
    "KernelArgumentError",
    "KernelTypeError",
    "ProtocolError",
    "ServerError",
    "PsrtTimeoutError",
    "ShardTimeoutError",
    "ConnectionLostError",
    "BindError",
    "ResourceLimitError",
    "PeerFailedError",
    "AuthenticationError",
    "RequestRefused",
    "refusal",
]


class PsrtError(Exception):
    """Base class of every error psrt raises."""


class ConfigError(PsrtError, ValueError):
    """A configuration value or argument is invalid; the message says which and what to use instead."""


class PsrtTypeError(PsrtError, TypeError):
    """An argument has the wrong type or dtype; the message says what to pass instead."""


class KernelArgumentError(PsrtError, ValueError):
    """A kernel was called with arrays of the wrong shape, length, layout or writability."""


class KernelTypeError(PsrtTypeError):
    """A kernel was called with arrays of an unsupported or mismatched dtype."""


class ProtocolError(PsrtError, ValueError):
    """A message broke the wire protocol: bad framing, header, schema, dtype, shape or byte count."""


class ServerError(PsrtError, RuntimeError):
    """A shard answered a request with an error reply.

    Attributes
    ----------
    shard : str
        The endpoint of the shard that answered.
    code : str
        The machine-readable error code from the reply (``"protocol"``, ``"unknown_key"``, ...).
    """

    def __init__(self, message: str, *, shard: str = "", code: str = "error") -> None:
        super().__init__(message)
        self.shard = shard
        self.code = code


class PsrtTimeoutError(PsrtError, TimeoutError):
    """A wait ran past its deadline."""


class ShardTimeoutError(PsrtTimeoutError):
    """A shard did not answer in time; ``shard`` names it."""

    def __init__(self, message: str, *, shard: str = "") -> None:
        super().__init__(message)
        self.shard = shard


class ConnectionLostError(PsrtError, ConnectionError):
    """A socket could not send or receive: the peer is gone or the client was closed."""


class BindError(PsrtError, OSError):
    """A socket could not bind its endpoint (address in use, no such interface, ...); the message names it."""


class ResourceLimitError(PsrtError, OSError):
    """The process ran out of what the operating system lends it (open files: every socket is one); the message
    says which limit and what to change."""


class PeerFailedError(PsrtError, ConnectionError):
    """A process of the job died or stopped answering: the job cannot go on.

    Attributes
    ----------
    peer : str
        Who failed, e.g. ``"worker 2 (10.0.0.3, pid 4242)"`` or ``"the scheduler at tcp://10.0.0.1:5700"``.
    """

    def __init__(self, message: str, *, peer: str = "") -> None:
        super().__init__(message)
        self.peer = peer


class AuthenticationError(PsrtError, PermissionError):
    """A peer refused this process's security handshake (CURVE keys that are not the job's, or none).

    The message names the endpoint and says to set ``PSRT_KEYS`` (or ``--keys``) to the job's key directory.

    Attributes
    ----------
    endpoint : str
        The endpoint whose handshake failed.
    """

    def __init__(self, message: str, *, endpoint: str = "") -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RequestRefused(Exception):
    """A shard refuses a well-formed request; ``code`` goes into its error reply.

    Raised and caught inside a shard only (the worker sees a :class:`ServerError` carrying the code), so it is
    not a :class:`PsrtError`.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def refusal(endpoint: str, op: str, code: str, message: str) -> PsrtError:
    """The error a client raises for a shard's error reply (``code``, ``message``) to ``op``: a
    :class:`ServerError` carrying the code, but where the code says something more precise."""
    if code == "peer_finished":  # a sync round waits on a worker that finished: the job cannot go on
        return PeerFailedError(f"shard {endpoint} cannot answer {op}: {message}",
                               peer=message.split(" finished", 1)[0])
    if code == "not_a_shard":  # the address the client was given is the scheduler's
        return ConfigError(f"server endpoint {endpoint}: {message}")
    return ServerError(f"shard {endpoint} refused {op}: [{code}] {message}", shard=endpoint, code=code)
