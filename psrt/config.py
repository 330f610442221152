"""Every knob of psrt, as dataclasses; the only module that reads environment variables.

Environment variables only feed defaults: a value passed explicitly (argument or command-line flag) wins.

=========================  =============================  ==========================================  ==========
variable                   also read                      meaning                                     default
=========================  =============================  ==========================================  ==========
``PSRT_ROLE``              ``DMLC_ROLE``                  scheduler, server or worker (``psrt run``)
``PSRT_SCHEDULER``         ``DMLC_PS_ROOT_URI`` + ``_PORT``  the scheduler's ``tcp://HOST:PORT``
``PSRT_NUM_SERVERS``       ``DMLC_NUM_SERVER``            S
``PSRT_NUM_WORKERS``       ``DMLC_NUM_WORKER``            W                                           1
``PSRT_WORKER_ID``         ``DMLC_WORKER_ID``             a worker's requested rank
``PSRT_NODE_HOST``         ``DMLC_NODE_HOST``             the address this host is reached at
``PSRT_MODE``                                             ``sync`` (BSP), ``async`` or ``ssp``        ``sync``
``PSRT_STALENESS``                                        ``ssp``: pushes a worker may run ahead       0
``PSRT_START_TIMEOUT``                                    seconds for a job to form / a barrier        120
``PSRT_TIMEOUT``                                          seconds any single network wait may take    60
``PSRT_WARN_AFTER``                                       seconds before a slow wait logs a warning   5
``PSRT_COMPRESSION``                                      ``fp16`` or ``bf16`` gradients on the wire    none
``PSRT_HEARTBEAT_INTERVAL``                               seconds between heartbeats to the scheduler  0.5
``PSRT_HEARTBEAT_TIMEOUT``                                silence after which a process is dead        2.5
``PSRT_ELASTIC``                                          ``1``: workers may leave and join a job      ``0``
``PSRT_RESTART_GRACE``                                    seconds for a checkpointing server to restart 30
``PSRT_PARTITION_BYTES``                                  tensors larger than this are split          4 MiB
``PSRT_NONFINITE``                                        ``reject`` or ``allow`` NaN/Inf gradients   ``reject``
``PSRT_KEYS``                                             the job's key directory (``psrt keygen``):  off
                                                          CURVE on every socket; empty: off
``PSRT_SHM``                                              ``0``: no shared memory between a worker     ``1``
                                                          and a shard of one host (sockets only)
=========================  =============================  ==========================================  ==========

Under ``srun`` or ``mpirun`` the role and worker rank also follow from ``SLURM_PROCID``/``SLURM_NTASKS``,
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``, ``PMI_RANK``/``PMI_SIZE`` or ``PMIX_RANK`` (see
:class:`ClusterConfig`).
"""


from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from psrt.checks import MAX_PORT, check_endpoint
from psrt.dtypes import check_compression
from psrt.errors import ConfigError

__all__ = ["WireLimits", "ServerConfig", "ClientConfig", "ClusterConfig", "MODES", "ROLES"]

MODES = ("sync", "async", "ssp")


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


def _env_shm() -> bool:
    """``PSRT_SHM``: ``1`` (default) or ``0``."""
    value = os.environ.get("PSRT_SHM", "1").strip()
    if value not in ("0", "1", ""):
        raise ConfigError(f"PSRT_SHM must be 0 or 1, got {value!r}")
    return value != "0"


def _env_keys() -> Optional[str]:
    return os.environ.get("PSRT_KEYS") or None


def _check_keys(value: object) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"keys must be a key directory (str or path) or None, got {value!r}")


def _positive(name: str, value: object, kind: type = int, env: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        if env:  # a number of seconds, most often from the environment: say which variable and what inf means
            raise ConfigError(f"{name} ({env}) must be a positive number of seconds (inf: no limit), got {value!r}")
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

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a valid message holds (a header or one tensor's buffer): sockets' MAXMSGSIZE."""
        return max(self.max_header_bytes, self.max_tensor_bytes)


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
        ``"sync"``: sum a round's W pushes and step once; ``"async"``: apply every push on arrival; ``"ssp"``:
        apply every push on arrival, but answer a worker's pull at clock c (its pushes so far) only once every
        worker's clock is at least c - ``staleness`` (bounded staleness).
    staleness : int
        ``ssp`` mode: how many pushes a worker may run ahead of the slowest (0: lockstep).
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
    checkpoint_dir : str or None
        Where the shard writes its checkpoints (None: no checkpoints).
    checkpoint_every : int
        Write a checkpoint every this many rounds (sync: when every key reaches a multiple of it, so all shards'
        checkpoints line up; async: every this many pushes); 0: not by rounds.
    checkpoint_secs : float
        Write a checkpoint when this many seconds have passed since the last one and something changed; 0: not
        by time.
    restore : bool
        Start from the newest complete checkpoint of this shard's rank in ``checkpoint_dir`` (no checkpoint at
        all there: start fresh and say so; only other shards' checkpoints: an error naming them).
    rank : int or None
        The shard's rank, its place in the job's shard order, which names its checkpoint files; under a
        scheduler, the slot it asks for. None: the scheduler's choice, or by hand the restored checkpoint's, or 0.
    keys : str or os.PathLike, optional
        The job's key directory (:mod:`psrt.control.security`): CURVE on every socket, and only the job's client key
        is accepted. Default: ``PSRT_KEYS``; None or empty: no security.
    shm : bool
        Offer workers on this host shared-memory lanes (:mod:`psrt.shm.lanes`). Default: ``PSRT_SHM`` (on).
    """

    bind: str = "tcp://127.0.0.1:5701"
    num_workers: int = field(default_factory=lambda: _env_int("PSRT_NUM_WORKERS", 1))
    mode: str = field(default_factory=lambda: _env_str("PSRT_MODE", "sync"))
    staleness: int = field(default_factory=lambda: _env_int("PSRT_STALENESS", 0))
    nonfinite: str = field(default_factory=lambda: _env_str("PSRT_NONFINITE", "reject"))
    hwm: int = 100_000
    send_timeout: float = 10.0
    poll_interval: float = 0.1
    limits: WireLimits = field(default_factory=WireLimits)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    checkpoint_secs: float = 0.0
    restore: bool = False
    rank: Optional[int] = None
    keys: Optional[str | os.PathLike] = field(default_factory=_env_keys)
    shm: bool = field(default_factory=_env_shm)

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if type(self.checkpoint_every) is not int or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be a whole number of rounds >= 0, got {self.checkpoint_every!r}")
        if isinstance(self.checkpoint_secs, bool) or not isinstance(self.checkpoint_secs, (int, float)) \
                or not self.checkpoint_secs >= 0:
            raise ConfigError(f"checkpoint_secs must be a number of seconds >= 0, got {self.checkpoint_secs!r}")
        if self.checkpoint_dir is None and (self.checkpoint_every or self.checkpoint_secs or self.restore):
            raise ConfigError("--checkpoint-every, --checkpoint-secs and --restore need --checkpoint-dir DIR")
        check_endpoint(self.bind, bind=True, what="bind")
        if self.rank is not None and (type(self.rank) is not int or self.rank < 0):
            raise ConfigError(f"rank must be a whole number >= 0, got {self.rank!r}")
        _positive("num_workers", self.num_workers)
        if type(self.staleness) is not int or self.staleness < 0:
            raise ConfigError(f"staleness must be a whole number of pushes >= 0, got {self.staleness!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'sync', 'async' or 'ssp', got {self.mode!r}")
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
        Seconds any single wait for a shard may take before :class:`~psrt.errors.ShardTimeoutError`
        (``PSRT_TIMEOUT=inf``: no limit).
    partition_bytes : int
        Tensors larger than this are split into contiguous chunks of at most this many bytes.
    hwm : int
        ZeroMQ send/receive high-water marks, in messages.
    limits : WireLimits
        Decode limits for replies.
    warn_after : float
        Seconds a call may wait for a shard (or the scheduler) before the client logs, once, a warning naming
        what it waits for and where; the call itself keeps waiting until ``timeout``.
    compression : str or None
        ``"fp16"`` or ``"bf16"``: float32 gradients travel as 16-bit floats; ``"topk:RATIO"`` (0 < RATIO <= 1):
        only the RATIO largest entries of each chunk travel, the rest kept for later (:mod:`psrt.wire.compression`);
        None (default, or ``PSRT_COMPRESSION`` empty): full precision.
    keys : str or os.PathLike, optional
        The job's key directory: CURVE on every socket. Default: ``PSRT_KEYS``; None or empty: no security.
    shm : bool
        Move tensor bytes through shared memory to shards on this host (:mod:`psrt.shm.lanes`; not with
        ``compression``). Default: ``PSRT_SHM`` (on).
    """

    timeout: float = field(default_factory=lambda: _env_float("PSRT_TIMEOUT", 60.0))
    partition_bytes: int = field(default_factory=lambda: _env_int("PSRT_PARTITION_BYTES", 4 << 20))
    hwm: int = 100_000
    limits: WireLimits = field(default_factory=WireLimits)
    warn_after: float = field(default_factory=lambda: _env_float("PSRT_WARN_AFTER", 5.0))
    compression: Optional[str] = field(default_factory=lambda: _env_str("PSRT_COMPRESSION", "") or None)
    keys: Optional[str | os.PathLike] = field(default_factory=_env_keys)
    shm: bool = field(default_factory=_env_shm)

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        _positive("timeout", self.timeout, float, "PSRT_TIMEOUT")
        _positive("warn_after", self.warn_after, float, "PSRT_WARN_AFTER")
        try:
            object.__setattr__(self, "compression", check_compression(self.compression))
        except ValueError as exc:  # name the variable only when the value came from it
            where = " (PSRT_COMPRESSION)" if os.environ.get("PSRT_COMPRESSION") == self.compression else ""
            raise ConfigError(f"{exc}{where}") from None
        _positive("partition_bytes", self.partition_bytes)
        if self.partition_bytes < 8:
            raise ConfigError(f"partition_bytes must be at least 8, got {self.partition_bytes}")
        _positive("hwm", self.hwm)


ROLES = ("scheduler", "server", "worker")

#: Environment variables that give a process's global rank and the job size under MPI or Slurm.
_LAUNCHER_RANK = ("PSRT_GLOBAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_LAUNCHER_SIZE = ("PSRT_WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass(frozen=True)
class ClusterConfig:
    """Where a process sits in a job: its role, the scheduler, and the job's shape.

    Read from the environment by :meth:`from_env`, which understands psrt's own ``PSRT_*`` names, the
    ``DMLC_*`` names that ps-lite/MXNet/BytePS cluster tooling sets, and the rank variables of Slurm
    (``SLURM_PROCID``/``SLURM_NTASKS``) and MPI (``OMPI_COMM_WORLD_RANK``/``PMI_RANK``/...). Under a launcher
    rank, global rank 0 is the scheduler, ranks 1..S the servers and the rest the workers.

    Parameters
    ----------
    role : str or None
        ``"scheduler"``, ``"server"`` or ``"worker"``; None when the environment does not say.
    scheduler : str or None
        The scheduler's endpoint, ``tcp://HOST:PORT``.
    num_servers, num_workers : int or None
        S and W, when known.
    mode : str
        ``"sync"``, ``"async"`` or ``"ssp"``.
    worker_id : int or None
        A worker's requested rank (otherwise the scheduler assigns one in order of registration).
    node_host : str or None
        The address other hosts reach this process at.
    start_timeout : float
        Seconds the scheduler waits for everyone to register (and a barrier for everyone to arrive).
    heartbeat_interval : float
        Seconds between the heartbeats each registered process sends the scheduler.
    heartbeat_timeout : float
        Seconds of silence after which the scheduler takes a process for dead (and a process the scheduler).
    elastic : bool
        Workers may leave and join a running job (``PSRT_ELASTIC=1``); see docs/elastic.md.
    restart_grace : float
        Seconds the scheduler waits for a server that writes checkpoints to restart and take its slot back.
    staleness : int
        ``ssp`` mode: how many pushes a worker may run ahead of the slowest (``PSRT_STALENESS``).
    keys : str or None
        The job's key directory (``PSRT_KEYS``): CURVE on every socket; None: no security.
    """

    role: Optional[str] = None
    scheduler: Optional[str] = None
    num_servers: Optional[int] = None
    num_workers: Optional[int] = None
    mode: str = "sync"
    worker_id: Optional[int] = None
    node_host: Optional[str] = None
    start_timeout: float = 120.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.5
    elastic: bool = False
    keys: Optional[str] = None
    restart_grace: float = 30.0
    staleness: int = 0

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if self.role is not None and self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r} (set PSRT_ROLE or DMLC_ROLE)")
        if self.scheduler is not None:
            check_endpoint(self.scheduler, what="the scheduler (PSRT_SCHEDULER, or DMLC_PS_ROOT_URI and _PORT)")
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.worker_id is not None and (type(self.worker_id) is not int or self.worker_id < 0):
            raise ConfigError(f"worker_id must be a non-negative integer, got {self.worker_id!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'sync', 'async' or 'ssp', got {self.mode!r} (PSRT_MODE)")
        if type(self.staleness) is not int or self.staleness < 0:
            raise ConfigError(f"staleness must be a whole number of pushes >= 0, got {self.staleness!r} "
                              "(PSRT_STALENESS)")
        _positive("start_timeout", self.start_timeout, float, "PSRT_START_TIMEOUT")
        _positive("heartbeat_interval", self.heartbeat_interval, float, "PSRT_HEARTBEAT_INTERVAL")
        _positive("heartbeat_timeout", self.heartbeat_timeout, float, "PSRT_HEARTBEAT_TIMEOUT")
        _positive("restart_grace", self.restart_grace, float, "PSRT_RESTART_GRACE")
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ConfigError(f"heartbeat_timeout ({self.heartbeat_timeout:g}s, PSRT_HEARTBEAT_TIMEOUT) must be at "
                              f"least twice heartbeat_interval ({self.heartbeat_interval:g}s, "
                              "PSRT_HEARTBEAT_INTERVAL), or a live process could be taken for dead")

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> ClusterConfig:
        """Build the configuration from environment variables (``os.environ`` by default)."""
        env = os.environ if env is None else env

        def get(*names: str) -> Optional[str]:
            for n in names:
                if env.get(n):
                    return env[n]
            return None

        def named(names: tuple[str, ...]) -> str:
            return names[0] + (f" (or {', '.join(names[1:])})" if len(names) > 1 else "")

        def get_int(*names: str) -> Optional[int]:
            raw = get(*names)
            if raw is None:
                return None
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {named(names)} = {raw!r} must be an integer") from None

        def get_flag(name: str) -> bool:
            raw = (get(name) or "0").lower()
            if raw not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ConfigError(f"environment variable {name} = {raw!r} must be 1 or 0")
            return raw in ("1", "true", "yes", "on")

        def get_float(name: str, default: float) -> float:
            raw = get(name)
            if raw is None:
                return default
            try:
                return float(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name} = {raw!r} must be a number of seconds") from None

        scheduler = get("PSRT_SCHEDULER")
        if scheduler is None and get("DMLC_PS_ROOT_URI"):
            port = get("DMLC_PS_ROOT_PORT")
            if port is None:
                raise ConfigError("DMLC_PS_ROOT_URI is set but DMLC_PS_ROOT_PORT is not")
            port = port.strip()
            if not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
                raise ConfigError(f"environment variable DMLC_PS_ROOT_PORT = {port!r} must be a TCP port "
                                  f"(1..{MAX_PORT})")
            scheduler = f"tcp://{get('DMLC_PS_ROOT_URI')}:{port}"
        num_servers = get_int("PSRT_NUM_SERVERS", "DMLC_NUM_SERVER")
        num_workers = get_int("PSRT_NUM_WORKERS", "DMLC_NUM_WORKER")
        role = get("PSRT_ROLE", "DMLC_ROLE")
        worker_id = get_int("PSRT_WORKER_ID", "DMLC_WORKER_ID")
        rank, size = get_int(*_LAUNCHER_RANK), get_int(*_LAUNCHER_SIZE)
        if rank is not None and role is None:
            if num_servers is None:
                raise ConfigError("started under a launcher (rank variable set) but the number of servers is "
                                  "unknown: set PSRT_NUM_SERVERS (or DMLC_NUM_SERVER)")
            if rank == 0:
                role = "scheduler"
            elif rank <= num_servers:
                role = "server"
            else:
                role = "worker"
                if worker_id is None:
                    worker_id = rank - 1 - num_servers
            if num_workers is None and size is not None:
                num_workers = size - 1 - num_servers
                if num_workers < 1:
                    raise ConfigError(f"{size} processes leave no workers after 1 scheduler and {num_servers} "
                                      "servers; start more processes")
        return cls(
            role=role,
            scheduler=scheduler,
            num_servers=num_servers,
            num_workers=num_workers,
            mode=get("PSRT_MODE") or "sync",
            worker_id=worker_id,
            node_host=get("PSRT_NODE_HOST", "DMLC_NODE_HOST"),
            start_timeout=get_float("PSRT_START_TIMEOUT", 120.0),
            heartbeat_interval=get_float("PSRT_HEARTBEAT_INTERVAL", 0.5),
            heartbeat_timeout=get_float("PSRT_HEARTBEAT_TIMEOUT", 2.5),
            elastic=get_flag("PSRT_ELASTIC"),
            restart_grace=get_float("PSRT_RESTART_GRACE", 30.0),
            staleness=get_int("PSRT_STALENESS") or 0,
            keys=get("PSRT_KEYS"),
        )
