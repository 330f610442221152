"""Every knob of psrt, as dataclasses; the only module that reads environment variables.

Environment variables only feed defaults: a value passed explicitly (argument or command-line flag) wins.

=========================  ==========================================  =================
variable                   meaning                                     default
=========================  ==========================================  =================
``PSRT_MODE``              ``sync`` (BSP) or ``async`` update mode      ``sync``
``PSRT_NUM_WORKERS``       number of workers W                          1
``PSRT_TIMEOUT``           seconds any single network wait may take     60
``PSRT_PARTITION_BYTES``   tensors larger than this are split           4194304 (4 MiB)
``PSRT_NONFINITE``         ``reject`` or ``allow`` NaN/Inf gradients    ``reject``
=========================  ==========================================  =================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from psrt.errors import ConfigError

__all__ = ["WireLimits", "ServerConfig", "ClientConfig", "MODES"]

MODES = ("sync", "async")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be a number") from None


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _positive(name: str, value: object, kind: type = int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ConfigError(f"{name} must be a positive {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class WireLimits:
    """Decode limits for untrusted messages (msgpack header and buffer frames).

    Parameters
    ----------
    max_header_bytes : int
        Largest header frame accepted.
    max_tensors : int
        Most tensor entries one message may carry.
    max_name_len : int
        Longest tensor name.
    max_dims : int
        Most dimensions of one tensor.
    max_tensor_bytes : int
        Largest single buffer frame.
    """

    max_header_bytes: int = 1 << 20
    max_tensors: int = 1 << 16
    max_name_len: int = 1024
    max_dims: int = 32
    max_tensor_bytes: int = 1 << 34

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_tensors", "max_name_len", "max_dims", "max_tensor_bytes"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True)
class ServerConfig:
    """Configuration of one shard server.

    Parameters
    ----------
    bind : str
        ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:5701``; ``tcp://HOST:*`` binds an ephemeral port.
    num_workers : int
        W: the number of pushes that complete a sync round.
    mode : str
        ``"sync"``: sum a round's W pushes and step once; ``"async"``: apply every push on arrival.
    nonfinite : str
        ``"reject"`` answers a push holding NaN or Inf with an error and applies nothing; ``"allow"`` applies it.
    hwm : int
        ZeroMQ send/receive high-water marks, in messages.
    send_timeout : float
        Seconds a reply may wait to be queued before it is counted as dropped.
    poll_interval : float
        Seconds between housekeeping checks (stop requests) while idle.
    limits : WireLimits
        Decode limits for incoming messages.
    """

    bind: str = "tcp://127.0.0.1:5701"
    num_workers: int = field(default_factory=lambda: _env_int("PSRT_NUM_WORKERS", 1))
    mode: str = field(default_factory=lambda: _env_str("PSRT_MODE", "sync"))
    nonfinite: str = field(default_factory=lambda: _env_str("PSRT_NONFINITE", "reject"))
    hwm: int = 100_000
    send_timeout: float = 10.0
    poll_interval: float = 0.1
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        if not isinstance(self.bind, str) or "://" not in self.bind:
            raise ConfigError(f"bind must be a ZeroMQ endpoint such as tcp://127.0.0.1:5701, got {self.bind!r}")
        _positive("num_workers", self.num_workers)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.nonfinite not in ("reject", "allow"):
            raise ConfigError(f"nonfinite must be 'reject' or 'allow', got {self.nonfinite!r}")
        _positive("hwm", self.hwm)
        _positive("send_timeout", self.send_timeout, float)
        _positive("poll_interval", self.poll_interval, float)


@dataclass(frozen=True)
class ClientConfig:
    """Configuration of a worker's :class:`psrt.Client`.

    Parameters
    ----------
    timeout : float
        Seconds any single wait for a shard may take before :class:`~psrt.errors.ShardTimeoutError`.
    partition_bytes : int
        Tensors larger than this are split into contiguous chunks of at most this many bytes.
    hwm : int
        ZeroMQ send/receive high-water marks, in messages.
    limits : WireLimits
        Decode limits for replies.
    """

    timeout: float = field(default_factory=lambda: _env_float("PSRT_TIMEOUT", 60.0))
    partition_bytes: int = field(default_factory=lambda: _env_int("PSRT_PARTITION_BYTES", 4 << 20))
    hwm: int = 100_000
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        _positive("timeout", self.timeout, float)
        _positive("partition_bytes", self.partition_bytes)
        if self.partition_bytes < 8:
            raise ConfigError(f"partition_bytes must be at least 8, got {self.partition_bytes}")
        _positive("hwm", self.hwm)
