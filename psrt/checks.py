"""Values a user gives psrt, checked before use: endpoints, ports and numbers of seconds.

ZeroMQ turns some mistakes into a raw ``ZMQError`` (``http://...``: "Protocol not supported") and silently
accepts others: a TCP port above 65535 wraps around, so ``tcp://127.0.0.1:99999`` would serve on 34463. Every
endpoint a user gives psrt (command line, ``Client(servers=...)``, ``ServerConfig.bind``, ``PSRT_SCHEDULER``)
goes through :func:`check_endpoint` first, and every port through :func:`check_port`. A number of seconds
(:func:`check_seconds`) may be ``inf`` for "no limit", which the transport turns into ZeroMQ's "forever".
"""

from __future__ import annotations

import re

from psrt.errors import ConfigError

__all__ = ["check_endpoint", "check_port", "check_seconds", "endpoint_error", "MAX_PORT"]

MAX_PORT = 65535

_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]+|\*)")


def check_port(port: object, what: str = "port") -> int:
    """``port`` as an int in ``[1, 65535]``, else a :class:`ConfigError` naming ``what`` and the value."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= MAX_PORT:
        raise ConfigError(f"{what} must be a TCP port in 1..{MAX_PORT}, got {port!r}")
    return port


def endpoint_error(text: object, bind: bool = False) -> str:
    """Why ``text`` is not a usable endpoint ("" when it is one).

    Parameters
    ----------
    text : object
        The candidate: ``tcp://HOST:PORT``, ``tcp://HOST:*`` (``bind`` only) or ``ipc:///PATH``.
    bind : bool
        Whether the endpoint is to be bound (then ``*`` picks a free port).
    """
    shapes = "tcp://HOST:PORT, tcp://HOST:* or ipc:///PATH" if bind else "tcp://HOST:PORT or ipc:///PATH"
    if isinstance(text, str):
        if text.startswith("ipc://") and len(text) > len("ipc://"):
            return ""
        m = _TCP.fullmatch(text)
        if m and m.group(2) == "*":
            if bind:
                return ""
        elif m:
            port = int(m.group(2))
            if not 1 <= port <= MAX_PORT:
                free = ", or * for a free one" if bind else ""
                return f"{text!r}: port {port} is out of range (1..{MAX_PORT}{free})"
            return ""
    return f"{text!r} is not an endpoint such as {shapes}"


def check_endpoint(text: object, bind: bool = False, what: str = "endpoint") -> str:
    """Return ``text`` if it is a usable endpoint, else raise a :class:`ConfigError` starting with ``what``."""
    problem = endpoint_error(text, bind)
    if problem:
        raise ConfigError(f"{what}: {problem}")
    return text  # type: ignore[return-value]


def check_seconds(value: object, name: str, zero: bool = False) -> float:
    """``value`` if it is a number of seconds > 0 (>= 0 with ``zero``; ``inf``: no limit), else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        bound = ">= 0" if zero else "> 0"
        raise ConfigError(f"{name} must be a number of seconds {bound} (inf: no limit), got {value!r}")
    return float(value)
