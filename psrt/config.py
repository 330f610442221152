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
``PSRT_CLIENTS``                                          workers ``psrt worker`` runs in one process  1
``PSRT_NODE_HOST``         ``DMLC_NODE_HOST``             the address this host is reached at
``PSRT_MODE``                                             ``sync`` (BSP), ``async`` or ``ssp``        ``sync``
``PSRT_STALENESS``                                        ``ssp``: pushes a worker may run ahead       0
``PSRT_BACKUP_WORKERS``                                   sync: rounds close on the first W - b        0
``PSRT_START_TIMEOUT``                                    seconds for a job to form / a barrier        120
``PSRT_TIMEOUT``                                          seconds any single network wait may take    60
``PSRT_WARN_AFTER``                                       seconds before a slow wait logs a warning   5
``PSRT_COMPRESSION``                                      ``fp16`` or ``bf16`` gradients on the wire    none
``PSRT_HEARTBEAT_INTERVAL``                               seconds between heartbeats to the scheduler  0.5
``PSRT_HEARTBEAT_TIMEOUT``                                silence after which a process is dead        2.5
``PSRT_ELASTIC``                                          ``1``: workers may leave and join a job      ``0``
``PSRT_RESTART_GRACE``                                    seconds for a checkpointing server to restart 30
``PSRT_REPLICAS``                                         copies of each shard's key range (sync)      0
``PSRT_SLOW_EVERY``                                       rounds between the scheduler's slow lines    100
``PSRT_PARTITION_BYTES``                                  tensors larger than this are split          4 MiB
``PSRT_NONFINITE``                                        ``reject`` or ``allow`` NaN/Inf gradients   ``reject``
``PSRT_PIPELINE``                                         cut tensors for a network: ``auto``,        ``auto``
                                                          ``on`` or ``off`` (every worker alike)
``PSRT_IN_FLIGHT``                                        a blocking sync call's pieces in flight     2
                                                          per shard over a network; 0: all at once
``PSRT_PACING``                                           how those pieces go: ``auto`` (timed),      ``auto``
                                                          ``paced``, ``joined`` or ``grouped``
``PSRT_KEYS``                                             the job's key directory (``psrt keygen``):  off
                                                          CURVE on every socket; empty: off
``PSRT_SHM``                                              ``0``: no shared memory between a worker     ``1``
                                                          and a shard of one host (sockets only)
``PSRT_MAX_ROWS_PER_MESSAGE``                             most ids one embedding message may carry    4M
``PSRT_MAX_TABLE_ROWS``                                   most rows of one table on one shard         2^28
=========================  =============================  ==========================================  ==========

Each variable is named once, on the field it feeds (its ``env`` metadata), and read by one reader; the defaults
that other modules need too are named once here (:data:`START_TIMEOUT`...). A field with ``flag`` metadata is
also a command-line flag: ``psrt server`` builds its flags from :class:`ServerConfig`'s fields and ``psrt
scheduler`` from :class:`ClusterConfig`'s (:func:`flags`), so a new option is one field with its help text.

Under ``srun`` or ``mpirun`` the role and worker rank also follow from ``SLURM_PROCID``/``SLURM_NTASKS``,
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``, ``PMI_RANK``/``PMI_SIZE`` or ``PMIX_RANK`` (see
:class:`ClusterConfig`).
"""


from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from psrt.checks import MAX_PORT, check_endpoint, check_seconds, endpoint_error
from psrt.dtypes import check_compression
from psrt.errors import ConfigError

__all__ = ["WireLimits", "RowLimits", "ServerConfig", "ClientConfig", "ClusterConfig", "Flag", "flags",
           "field_default", "MODES", "NONFINITE", "PIPELINE", "PACING", "CUTS", "PROCESS_ROLES", "JOB_SETTINGS",
           "START_TIMEOUT", "CHECKPOINT_SETTINGS", "HEARTBEAT_INTERVAL", "HEARTBEAT_TIMEOUT", "RESTART_GRACE",
           "WARN_AFTER", "parse_whole", "parse_count", "parse_seconds", "parse_interval", "parse_endpoint",
           "parse_bind"]

MODES = ("sync", "async", "ssp")

#: What a shard does with a gradient holding NaN or Inf: refuse the push, or apply it.
NONFINITE = ("reject", "allow")
#: ``ClientConfig.pipeline``'s values.
PIPELINE = ("auto", "on", "off")
#: ``ClientConfig.pacing``'s values: timed, or one way always (:mod:`psrt.worker.pacing`, finest first).
PACING = ("auto", "paced", "joined", "grouped")
#: How a job's workers cut tensors into chunks (a scheduler's table says which, :attr:`psrt.wire.Table.cut`):
#: for shards on the workers' host, or for shards across a network (pieces that pipeline).
CUTS = ("host", "network")

#: The roles a process of a job can take (``PSRT_ROLE``); the scheduler is the one the others register with.
PROCESS_ROLES = ("scheduler", "server", "worker")

#: The :class:`ServerConfig` fields a shard that joins a scheduler's job takes from the scheduler's table.
JOB_SETTINGS = ("num_workers", "mode", "staleness", "backup_workers")
#: The :class:`ServerConfig` fields ``psrt launch`` takes as flags too and gives every shard it starts.
CHECKPOINT_SETTINGS = ("checkpoint_dir", "checkpoint_every", "checkpoint_secs", "checkpoint_full_every", "restore")

#: Seconds for a job to form and for each barrier (``PSRT_START_TIMEOUT``).
START_TIMEOUT = 120.0
#: Seconds between the heartbeats a registered process sends the scheduler (``PSRT_HEARTBEAT_INTERVAL``).
HEARTBEAT_INTERVAL = 0.5
#: Seconds of silence after which a process (or the scheduler) is taken for dead (``PSRT_HEARTBEAT_TIMEOUT``).
HEARTBEAT_TIMEOUT = 2.5
#: Seconds a checkpointing server that died has to restart and take its slot back (``PSRT_RESTART_GRACE``).
RESTART_GRACE = 30.0
#: Seconds a wait lasts before it logs, once, what it waits for (``PSRT_WARN_AFTER``).
WARN_AFTER = 5.0
#: Rounds of a sync job between the scheduler's lines naming the workers slow on every shard (``PSRT_SLOW_EVERY``).
SLOW_EVERY = 100

#: Environment variables that give a process's global rank and the job size under MPI or Slurm.
_LAUNCHER_RANK = ("PSRT_GLOBAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_LAUNCHER_SIZE = ("PSRT_WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


class _Environment:
    """The one reader of psrt's environment variables; each method returns None for a variable unset or empty.

    Parameters
    ----------
    env : mapping, optional
        The variables (``os.environ`` by default).
    """

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self.env = os.environ if env is None else env

    def text(self, *names: str) -> Optional[str]:
        """The value of the first of ``names`` that is set and not empty."""
        for name in names:
            if self.env.get(name):
                return self.env[name]
        return None

    def whole(self, *names: str) -> Optional[int]:
        """An integer."""
        raw = self.text(*names)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {_named(names)} = {raw!r} must be an integer") from None

    def backup(self, *names: str) -> Optional[int | str]:
        """Backup workers: a whole number, or ``auto``."""
        raw = self.text(*names)
        if raw is None:
            return None
        if raw.strip() == "auto":
            return "auto"
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {_named(names)} = {raw!r} must be a whole number or auto"
                              ) from None

    def seconds(self, *names: str) -> Optional[float]:
        """A number of seconds (the config that takes it checks it is > 0; ``inf``: no limit)."""
        raw = self.text(*names)
        if raw is None:
            return None
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"environment variable {_named(names)} = {raw!r} must be a number of seconds") from None

    def flag(self, *names: str) -> Optional[bool]:
        """On or off: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``."""
        raw = self.text(*names)
        if raw is None:
            return None
        raw = raw.lower()
        if raw not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ConfigError(f"environment variable {_named(names)} = {raw!r} must be 1 or 0")
        return raw in ("1", "true", "yes", "on")

    def switch(self, name: str) -> Optional[bool]:
        """Strictly ``1`` (on) or ``0`` (off), blanks around it ignored (``PSRT_SHM``)."""
        value = self.env.get(name, "").strip()
        if value not in ("0", "1", ""):
            raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
        return None if value == "" else value == "1"


def _named(names: tuple[str, ...]) -> str:
    return names[0] + (f" (or {', '.join(names[1:])})" if len(names) > 1 else "")


#: How a field's variable is read: an :class:`_Environment` method, called as ``read(reader, *names)``.
_Read = Callable[..., Any]


def _env_fed(default: Any, *names: str, read: _Read = _Environment.text, flag: Optional[Flag] = None) -> Any:
    """A field whose default is read from the first of ``names`` each time a config is made, else ``default``."""

    def factory() -> Any:
        value = read(_Environment(), *names)
        return default if value is None else value

    return field(default_factory=factory, metadata=_metadata(default, names, read, flag))


def _env_named(default: Any, *names: str, read: _Read = _Environment.text, flag: Optional[Flag] = None) -> Any:
    """A field with a plain default, which :meth:`ClusterConfig.from_env` reads from the first of ``names``."""
    return field(default=default, metadata=_metadata(default, names, read, flag))


def _flagged(default: Any, flag: Flag) -> Any:
    """A field that no variable feeds, with a command-line flag."""
    return field(default=default, metadata={"flag": flag})


def _metadata(default: Any, names: tuple[str, ...], read: _Read, flag: Optional[Flag]) -> dict[str, Any]:
    meta: dict[str, Any] = {"env": names, "read": read, "default": default}
    if flag is not None:
        meta["flag"] = flag
    return meta


# The text of a command-line flag, parsed: each raises a ConfigError saying what was expected, which the
# command line turns into its one-line usage error.

def parse_whole(text: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise ConfigError(f"must be >= 0, got {value}")
    return value


def parse_backup(text: str) -> int | str:
    """Backup workers: a whole number >= 0, or ``auto``."""
    return "auto" if text.strip() == "auto" else parse_whole(text)


def parse_count(text: str) -> int:
    """A whole number >= 1."""
    value = parse_whole(text)
    if value < 1:
        raise ConfigError(f"must be >= 1, got {value}")
    return value


def parse_seconds(text: str) -> float:
    """A number of seconds > 0; ``inf``: no limit."""
    try:
        return check_seconds(float(text), "a timeout")
    except ValueError:  # float()'s, or check_seconds' ConfigError
        raise ConfigError(f"expected a number of seconds > 0 (inf: no limit), got {text!r}") from None


def parse_interval(text: str) -> float:
    """A finite number of seconds > 0 (a pause between two things: inf would never end)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def parse_endpoint(text: str) -> str:
    """A ZeroMQ endpoint to connect to, checked up front (a typo is a usage error, not a ZeroMQ traceback)."""
    problem = endpoint_error(text)
    if problem:
        raise ConfigError(problem)
    return text


def parse_bind(text: str) -> str:
    """A ZeroMQ endpoint to bind (``tcp://HOST:*`` picks a free port)."""
    problem = endpoint_error(text, bind=True)
    if problem:
        raise ConfigError(problem)
    return text


_BACKUP_HELP = ("sync: backup workers b (0 <= b < W): a round closes on the first W - b pushes, a later push for "
                "it is dropped; auto: the shard picks b from how late the workers' pushes come")


def check_backup_workers(backup_workers: object, num_workers: Optional[int], mode: str = "sync") -> None:
    """Raise :class:`ConfigError` unless ``backup_workers`` is a whole number b with ``0 <= b < num_workers``
    (``num_workers`` None: W is not known yet, only b >= 0 is checked) or ``"auto"``, and 0 unless ``mode`` is
    sync."""
    if backup_workers == "auto":
        if mode != "sync":
            raise ConfigError(f"--backup-workers auto picks how many stragglers a sync round leaves behind; this is "
                              f"--mode {mode}: leave it out or use --mode sync")
        return
    if type(backup_workers) is not int or backup_workers < 0:
        raise ConfigError(f"backup_workers must be a whole number >= 0 or auto, got {backup_workers!r} "
                          "(--backup-workers, PSRT_BACKUP_WORKERS)")
    if backup_workers and mode != "sync":
        raise ConfigError(f"backup workers leave stragglers behind in sync rounds; this is --mode {mode}, where no "
                          "push waits for another: leave --backup-workers (PSRT_BACKUP_WORKERS) out or use --mode sync")
    if num_workers is not None and type(num_workers) is int and backup_workers >= num_workers:
        raise ConfigError(f"backup_workers must be less than the number of workers W={num_workers} (a round needs "
                          f"at least one push), got {backup_workers}; pass --backup-workers B with 0 <= B < W "
                          "(or set PSRT_BACKUP_WORKERS)")


@dataclass(frozen=True)
class Flag:
    """How a configuration field is given on the command line (the field's ``flag`` metadata).

    Parameters
    ----------
    name : str
        The flag, e.g. ``"--workers"``; the parsed arguments hold its value as :attr:`dest`.
    help : str
        What it sets. The help text adds the default: the field's variable and default value, or ``default_help``.
    parse : callable, optional
        The flag's text to a value (:func:`parse_whole`..., or a type such as ``int``); None: the text itself.
        A bool field is an on/off flag and takes no value.
    choices : tuple, optional
        The values allowed.
    metavar : str, optional
        The value's name in the usage line.
    unset : bool
        The flag's default is None, "not given", and the config's own default applies, decided when the config
        is made (``--bind`` depends on ``--scheduler``; ``--staleness`` is checked against ``--mode`` if given).
    fallback : optional
        The flag's default where the field's is None (``psrt scheduler --servers``: 1).
    default_help : str, optional
        The default in words (``{default}``: the field's default value).
    """

    name: str
    help: str
    parse: Optional[Callable[[str], Any]] = None
    choices: Optional[tuple[str, ...]] = None
    metavar: Optional[str] = None
    unset: bool = False
    fallback: Any = None
    default_help: Optional[str] = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments holding the value (``--checkpoint-dir``: ``checkpoint_dir``)."""
        return self.name.lstrip("-").replace("-", "_")


def flags(config: type) -> list[tuple[Field, Flag]]:
    """The fields of the config dataclass ``config`` that are command-line flags, in field order, with their flag."""
    return [(f, f.metadata["flag"]) for f in fields(config) if "flag" in f.metadata]


def field_default(f: Field) -> Any:
    """Field ``f``'s default as its help says it: the value when its variable is unset, or the plain default."""
    return f.metadata.get("default", None if f.default is MISSING else f.default)


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
class RowLimits:
    """A shard's caps on embedding traffic (:mod:`psrt.shard.tables`).

    Parameters
    ----------
    max_rows_per_message : int
        Most ids one ``push_rows``/``pull_rows``/``init_table`` may carry (``PSRT_MAX_ROWS_PER_MESSAGE``).
    max_table_rows : int
        Most rows one table may hold on this shard (``PSRT_MAX_TABLE_ROWS``).
    """

    max_rows_per_message: int = _env_fed(1 << 22, "PSRT_MAX_ROWS_PER_MESSAGE", read=_Environment.whole)
    max_table_rows: int = _env_fed(1 << 28, "PSRT_MAX_TABLE_ROWS", read=_Environment.whole)


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
    backup_workers : int
        Sync mode: b, with ``0 <= b < num_workers``. A key's round closes once W - b workers pushed it (the mean of
        those pushes); a push for a round already closed is dropped (:mod:`psrt.shard.stragglers`).
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
    checkpoint_full_every : int
        Every this many checkpoints one is full; the ones between are deltas, holding of the embedding tables
        only the rows changed since the checkpoint before (:mod:`psrt.shard.checkpoint`). 1: all full.
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
    row_limits : RowLimits
        Caps on embedding traffic. Default: ``PSRT_MAX_ROWS_PER_MESSAGE``, ``PSRT_MAX_TABLE_ROWS``.

    Fields with ``flag`` metadata are ``psrt server``'s flags (:class:`Flag`); those in :data:`JOB_SETTINGS` come
    from the scheduler when the shard joins a job.
    """

    bind: str = _flagged("tcp://127.0.0.1:5701", Flag(
        "--bind", "ZeroMQ endpoint to bind; tcp://HOST:* picks a free port", parse=parse_bind, unset=True,
        default_help="{default}, or an ephemeral port on --host with --scheduler"))
    num_workers: int = _env_fed(1, "PSRT_NUM_WORKERS", read=_Environment.whole, flag=Flag(
        "--workers", "W: pushes that complete a sync round", parse=int))
    mode: str = _env_fed("sync", "PSRT_MODE", flag=Flag(
        "--mode", "sync (BSP), async or ssp (bounded staleness)", choices=MODES))
    staleness: int = _env_fed(0, "PSRT_STALENESS", read=_Environment.whole, flag=Flag(
        "--staleness", "ssp: pushes a worker may run ahead of the slowest", parse=parse_whole, metavar="S",
        unset=True))
    backup_workers: int | str = _env_fed(0, "PSRT_BACKUP_WORKERS", read=_Environment.backup, flag=Flag(
        "--backup-workers", _BACKUP_HELP, parse=parse_backup, metavar="B", unset=True))
    nonfinite: str = _env_fed("reject", "PSRT_NONFINITE", flag=Flag(
        "--nonfinite", "what to do with NaN/Inf gradients", choices=NONFINITE))
    hwm: int = 100_000
    send_timeout: float = 10.0
    poll_interval: float = 0.1
    limits: WireLimits = field(default_factory=WireLimits)
    checkpoint_dir: Optional[str] = _flagged(None, Flag(
        "--checkpoint-dir", "write checkpoints (parameters, optimizer state, versions, sequence numbers) in this "
        "directory"))
    checkpoint_every: int = _flagged(0, Flag(
        "--checkpoint-every", "a checkpoint every N rounds (sync: at versions that are multiples of N; async: N "
        "pushes)", parse=parse_count, metavar="N"))
    checkpoint_secs: float = _flagged(0.0, Flag(
        "--checkpoint-secs", "a checkpoint every T seconds while the parameters change", parse=parse_interval,
        metavar="T"))
    checkpoint_full_every: int = _flagged(10, Flag(
        "--checkpoint-full-every", "every Kth checkpoint is full; those between write only the embedding rows "
        "changed since the one before", parse=parse_count, metavar="K"))
    restore: bool = _flagged(False, Flag(
        "--restore", "start from the newest complete checkpoint of this shard in --checkpoint-dir: its rank's, or "
        "the directory's only shard (no checkpoint at all: start fresh)"))
    rank: Optional[int] = _flagged(None, Flag(
        "--rank", "this shard's rank (its place in the workers' list of servers), which names its checkpoints; "
        "with --scheduler, the slot to take", parse=parse_whole, metavar="R",
        default_help="the scheduler's choice, or the restored checkpoint's, or 0"))
    keys: Optional[str | os.PathLike] = _env_fed(None, "PSRT_KEYS", flag=Flag(
        "--keys", "the job's key directory (psrt keygen): CURVE on every socket, only the job's client key "
        "accepted", metavar="DIR"))
    shm: bool = _env_fed(True, "PSRT_SHM", read=_Environment.switch)
    row_limits: RowLimits = field(default_factory=RowLimits)

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if type(self.checkpoint_every) is not int or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be a whole number of rounds >= 0, got {self.checkpoint_every!r}")
        if isinstance(self.checkpoint_secs, bool) or not isinstance(self.checkpoint_secs, (int, float)) \
                or not self.checkpoint_secs >= 0:
            raise ConfigError(f"checkpoint_secs must be a number of seconds >= 0, got {self.checkpoint_secs!r}")
        if type(self.checkpoint_full_every) is not int or self.checkpoint_full_every < 1:
            raise ConfigError(f"checkpoint_full_every must be a whole number >= 1 (1: every checkpoint full), got "
                              f"{self.checkpoint_full_every!r}")
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
        if self.backup_workers is None:  # (its flag not given: the variable's value, checked against this W)
            object.__setattr__(self, "backup_workers", _Environment().backup("PSRT_BACKUP_WORKERS") or 0)
        check_backup_workers(self.backup_workers, self.num_workers, self.mode)
        if self.nonfinite not in NONFINITE:
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
    pipeline : str
        Whether large tensors are cut for a network (:mod:`psrt.partition`: ``PIPELINE_PIECES`` pieces per shard,
        a message each or two, so that a shard answers one piece while the next arrives). ``"auto"``
        (default, ``PSRT_PIPELINE``): when some shard's endpoint is off this host. ``"on"``: always (shared-memory
        lanes still carry a call's pieces together). ``"off"``: never; a link so fast that the shards' CPUs are
        the bottleneck can be better served by fewer, larger messages. The cut names the keys a shard holds, so
        every worker of a job must use the same setting (a worker that differs is refused: its chunks are not
        the shard's).
    in_flight : int
        A blocking ``push``/``push_pull`` to a sync shard reached over a network sends a split tensor's pieces at
        most this many ahead of the shard's answers to them (default 2, ``PSRT_IN_FLIGHT``; 0: every piece at
        once). A sync round closes only when every worker's piece is in; sent all at once, the workers' pieces
        race each other over the shard's link and the rounds close late, in bursts, with the link idle between
        them. Held in step, every worker's pieces arrive side by side, each round closes as its last piece
        lands, and the answers stream out while the next pieces stream in (docs/perfmodel.md, "The pull
        tail"). Non-blocking calls send everything at once: nothing would send the rest while the caller
        computes.
    pacing : str
        How a blocking call's pieces go there (:mod:`psrt.worker.pacing`): ``"auto"`` (default, ``PSRT_PACING``):
        the way the client's own calls time fastest; ``"paced"`` (at most ``in_flight`` ahead of the answers),
        ``"joined"`` (joined into messages of 256 KiB or more, all at once) or ``"grouped"`` (as few messages as
        ``partition_bytes`` allows, all at once): that way always, for a job whose bottleneck is known (a link:
        paced; the processes' CPUs: grouped). Ignored with ``in_flight=0``.
    """

    timeout: float = _env_fed(60.0, "PSRT_TIMEOUT", read=_Environment.seconds)
    partition_bytes: int = _env_fed(4 << 20, "PSRT_PARTITION_BYTES", read=_Environment.whole)
    hwm: int = 100_000
    limits: WireLimits = field(default_factory=WireLimits)
    warn_after: float = _env_fed(WARN_AFTER, "PSRT_WARN_AFTER", read=_Environment.seconds)
    compression: Optional[str] = _env_fed(None, "PSRT_COMPRESSION")
    keys: Optional[str | os.PathLike] = _env_fed(None, "PSRT_KEYS")
    shm: bool = _env_fed(True, "PSRT_SHM", read=_Environment.switch)
    pipeline: str = _env_fed("auto", "PSRT_PIPELINE")
    in_flight: int = _env_fed(2, "PSRT_IN_FLIGHT", read=_Environment.whole)
    pacing: str = _env_fed("auto", "PSRT_PACING")

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if isinstance(self.in_flight, bool) or not isinstance(self.in_flight, int) or self.in_flight < 0:
            where = " (PSRT_IN_FLIGHT)" if os.environ.get("PSRT_IN_FLIGHT", "").strip() == str(self.in_flight) else ""
            raise ConfigError(f"in_flight must be a whole number >= 0 (0: no limit), got {self.in_flight!r}{where}")
        if self.pipeline not in PIPELINE:
            where = " (PSRT_PIPELINE)" if os.environ.get("PSRT_PIPELINE") == self.pipeline else ""
            raise ConfigError(f"pipeline must be 'auto', 'on' or 'off', got {self.pipeline!r}{where}")
        if self.pacing not in PACING:
            where = " (PSRT_PACING)" if os.environ.get("PSRT_PACING") == self.pacing else ""
            raise ConfigError(f"pacing must be 'auto', 'paced', 'joined' or 'grouped', got {self.pacing!r}{where}")
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
    clients : int
        Workers one ``psrt worker`` process runs (``PSRT_CLIENTS``), each a full peer with its own rank, the
        first ``worker_id`` and the next ones after it (``psrt launch --clients N`` sets both).
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
    backup_workers : int
        Sync mode: b, rounds close on the first W - b pushes (``PSRT_BACKUP_WORKERS``; 0 <= b < W).
    keys : str or None
        The job's key directory (``PSRT_KEYS``): CURVE on every socket; None: no security.
    replicas : int
        Copies of each shard's key range, held by the next R shards on the ring (``PSRT_REPLICAS``; 0: none;
        at most S - 1). The scheduler hands it to the shards; a dead primary's first replica takes its range over.
    slow_every : int
        Rounds of a sync job between the scheduler's log lines naming the workers slow on every shard
        (``PSRT_SLOW_EVERY``; 100); one more when the job ends.

    Fields with ``flag`` metadata are ``psrt scheduler``'s flags (:class:`Flag`).
    """

    role: Optional[str] = _env_named(None, "PSRT_ROLE", "DMLC_ROLE")
    scheduler: Optional[str] = _env_named(None, "PSRT_SCHEDULER")  # or DMLC_PS_ROOT_URI and _PORT (from_env)
    num_servers: Optional[int] = _env_named(None, "PSRT_NUM_SERVERS", "DMLC_NUM_SERVER", read=_Environment.whole,
                                            flag=Flag("--servers", "S", parse=int, fallback=1))
    num_workers: Optional[int] = _env_named(None, "PSRT_NUM_WORKERS", "DMLC_NUM_WORKER", read=_Environment.whole,
                                            flag=Flag("--workers", "W", parse=int, fallback=1))
    mode: str = _env_named("sync", "PSRT_MODE", flag=Flag(
        "--mode", "sync (BSP), async or ssp (bounded staleness)", choices=MODES))
    worker_id: Optional[int] = _env_named(None, "PSRT_WORKER_ID", "DMLC_WORKER_ID", read=_Environment.whole)
    clients: int = _env_named(1, "PSRT_CLIENTS", read=_Environment.whole)
    node_host: Optional[str] = _env_named(None, "PSRT_NODE_HOST", "DMLC_NODE_HOST")
    start_timeout: float = _env_named(START_TIMEOUT, "PSRT_START_TIMEOUT", read=_Environment.seconds, flag=Flag(
        "--timeout", "seconds for everyone to register and for each barrier", parse=parse_seconds))
    heartbeat_interval: float = _env_named(HEARTBEAT_INTERVAL, "PSRT_HEARTBEAT_INTERVAL", read=_Environment.seconds)
    heartbeat_timeout: float = _env_named(HEARTBEAT_TIMEOUT, "PSRT_HEARTBEAT_TIMEOUT", read=_Environment.seconds)
    elastic: bool = _env_named(False, "PSRT_ELASTIC", read=_Environment.flag, flag=Flag(
        "--elastic", "workers may leave (die or finish) and join while the job runs"))
    keys: Optional[str] = _env_named(None, "PSRT_KEYS", flag=Flag(
        "--keys", "the job's key directory (psrt keygen): CURVE, only the job's client key accepted", metavar="DIR"))
    restart_grace: float = _env_named(RESTART_GRACE, "PSRT_RESTART_GRACE", read=_Environment.seconds)
    staleness: int = _env_named(0, "PSRT_STALENESS", read=_Environment.whole, flag=Flag(
        "--staleness", "ssp: pushes a worker may run ahead of the slowest", parse=parse_whole, metavar="S",
        unset=True))
    replicas: int = _env_named(0, "PSRT_REPLICAS", read=_Environment.whole, flag=Flag(
        "--replicas", "copies of each shard's key range on the next R shards of the ring (at most S - 1); a dead "
        "shard's range is taken over by its first replica", parse=parse_whole, metavar="R"))
    backup_workers: int | str = _env_named(0, "PSRT_BACKUP_WORKERS", read=_Environment.backup, flag=Flag(
        "--backup-workers", _BACKUP_HELP, parse=parse_backup, metavar="B"))
    slow_every: int = _env_named(SLOW_EVERY, "PSRT_SLOW_EVERY", read=_Environment.whole)

    def __post_init__(self) -> None:
        _check_keys(self.keys)
        if type(self.slow_every) is not int or self.slow_every < 1:
            raise ConfigError(f"slow_every must be a whole number of rounds >= 1, got {self.slow_every!r} "
                              "(PSRT_SLOW_EVERY)")
        if type(self.replicas) is not int or self.replicas < 0:
            raise ConfigError(f"replicas must be a whole number >= 0, got {self.replicas!r} (PSRT_REPLICAS)")
        if self.num_workers is not None or self.backup_workers:
            check_backup_workers(self.backup_workers, self.num_workers, self.mode)
        if self.role is not None and self.role not in PROCESS_ROLES:
            raise ConfigError(f"role must be one of {PROCESS_ROLES}, got {self.role!r} (set PSRT_ROLE or DMLC_ROLE)")
        if self.scheduler is not None:
            check_endpoint(self.scheduler, what="the scheduler (PSRT_SCHEDULER, or DMLC_PS_ROOT_URI and _PORT)")
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.worker_id is not None and (type(self.worker_id) is not int or self.worker_id < 0):
            raise ConfigError(f"worker_id must be a non-negative integer, got {self.worker_id!r}")
        if type(self.clients) is not int or self.clients < 1:
            raise ConfigError(f"clients must be a whole number of workers >= 1, got {self.clients!r} (PSRT_CLIENTS)")
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
        reader = _Environment(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = f.metadata["read"](reader, *f.metadata["env"])
            if value is not None:
                values[f.name] = value
        if "scheduler" not in values and reader.text("DMLC_PS_ROOT_URI"):
            port = reader.text("DMLC_PS_ROOT_PORT")
            if port is None:
                raise ConfigError("DMLC_PS_ROOT_URI is set but DMLC_PS_ROOT_PORT is not")
            port = port.strip()
            if not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
                raise ConfigError(f"environment variable DMLC_PS_ROOT_PORT = {port!r} must be a TCP port "
                                  f"(1..{MAX_PORT})")
            values["scheduler"] = f"tcp://{reader.text('DMLC_PS_ROOT_URI')}:{port}"
        rank, size = reader.whole(*_LAUNCHER_RANK), reader.whole(*_LAUNCHER_SIZE)
        if rank is not None and "role" not in values:
            num_servers = values.get("num_servers")
            if num_servers is None:
                raise ConfigError("started under a launcher (rank variable set) but the number of servers is "
                                  "unknown: set PSRT_NUM_SERVERS (or DMLC_NUM_SERVER)")
            if rank == 0:
                values["role"] = "scheduler"
            elif rank <= num_servers:
                values["role"] = "server"
            else:
                values["role"] = "worker"
                values.setdefault("worker_id", rank - 1 - num_servers)
            if "num_workers" not in values and size is not None:
                values["num_workers"] = size - 1 - num_servers
                if values["num_workers"] < 1:
                    raise ConfigError(f"{size} processes leave no workers after 1 scheduler and {num_servers} "
                                      "servers; start more processes")
        return cls(**values)
