"""The control plane: messages between the scheduler and its servers and workers, as typed records.

Control messages are single header frames with the data plane's framing and decode rules (``v``, ``op``, ``id``;
msgpack with limits; exact field sets). No tensor bytes travel here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

from psrt.config import CUTS, MODES, PROCESS_ROLES, WireLimits
from psrt.errors import ProtocolError
from psrt.wire.codec import MAX_U63, check_version, encode, op_of, string, uint, unpack_header

__all__ = [
    "CONTROL_LIMITS",
    "REGISTERING_ROLES",
    "Register",
    "Barrier",
    "Done",
    "Failed",
    "TableQuery",
    "Heartbeat",
    "SlowReport",
    "MAX_SLOW_ROWS",
    "Beats",
    "MAX_BEAT_RANKS",
    "ControlRequest",
    "Table",
    "Ok",
    "ControlError",
    "Shutdown",
    "Abort",
    "Members",
    "Moved",
    "Finished",
    "Forming",
    "NotMembers",
    "Ranges",
    "Replication",
    "ControlReply",
    "decode_control_request",
    "decode_control_reply",
    "encode_register",
    "encode_barrier",
    "encode_done",
    "encode_failed",
    "encode_table_query",
    "encode_heartbeat",
    "encode_beats",
    "encode_table",
    "encode_ok",
    "encode_control_error",
    "encode_shutdown",
    "encode_abort",
    "encode_members",
    "encode_moved",
    "encode_finished",
    "encode_forming",
    "encode_not_members",
    "encode_ranges",
]

#: Control messages are small: tighter limits than the data plane's.
CONTROL_LIMITS = WireLimits(max_header_bytes=1 << 16, max_tensors=1 << 12)

#: The roles that register with the scheduler (every process role but the scheduler's own).
REGISTERING_ROLES = tuple(role for role in PROCESS_ROLES if role != "scheduler")

_MAX_ENDPOINT = 1024
_MAX_BARRIER_NAME = 256
_MAX_MESSAGE = 1 << 12
#: Worker ranks one ``beats`` message may carry (a process with more sends several): 4096 ranks of up to nine
#: msgpack bytes each stay well inside :data:`CONTROL_LIMITS`.
MAX_BEAT_RANKS = 1 << 12

_REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "register": frozenset({"v", "op", "id", "role", "endpoint", "host", "rank", "restorable", "restore"}),
    "barrier": frozenset({"v", "op", "id", "rank", "name"}),
    "done": frozenset({"v", "op", "id", "rank"}),
    "failed": frozenset({"v", "op", "id", "rank", "message"}),
    "table": frozenset({"v", "op", "id"}),
    "heartbeat": frozenset({"v", "op", "id", "role", "rank", "pid", "epoch"}),
    "beats": frozenset({"v", "op", "id", "ranks", "pid"}),
}
_REPLY_FIELDS: dict[str, frozenset[str]] = {
    "table": frozenset({"v", "op", "id", "rank", "num_servers", "num_workers", "mode", "servers", "elastic",
                        "staleness"}),
    "ok": frozenset({"v", "op", "id"}),
    "error": frozenset({"v", "op", "id", "code", "message"}),
    "shutdown": frozenset({"v", "op", "id"}),
    "abort": frozenset({"v", "op", "id", "code", "message"}),
    "members": frozenset({"v", "op", "id", "epoch", "workers"}),
    "moved": frozenset({"v", "op", "id", "shard", "endpoint", "replica"}),
    "finished": frozenset({"v", "op", "id", "workers"}),
    "forming": frozenset({"v", "op", "id", "servers", "num_servers", "workers", "num_workers"}),
    "not_members": frozenset({"v", "op", "id", "workers", "message"}),
    "ranges": frozenset({"v", "op", "id", "holders", "endpoints"}),
}
#: Fields a message may carry or leave out (a replicated job's, b, a server's word on who is slow), taken out before
#: its exact field set is checked.
_OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"register": ("replication",),
                                                "table": ("replication", "backup_workers", "cut"),
                                                "heartbeat": ("lateness",)}
#: Most slow workers one server's heartbeat names (:class:`SlowReport`); a line naming more would be unreadable.
MAX_SLOW_ROWS = 64
#: Most endpoints a server announces for replication (its replication endpoint and one standby per range it backs).
MAX_REPLICATION_ENDPOINTS = 1 << 8


# ---------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Register:
    """``register``: a server (with the endpoint it serves on) or a worker joins; rank -1 lets the scheduler choose.

    A server's ``rank`` is the shard index it asks for (the one its checkpoint belongs to). ``restorable``: a
    server that writes checkpoints; if it dies, the scheduler waits for it to restart instead of failing the job
    at once. ``restore``: a server resuming from a checkpoint, which may take back the slot of a dead one.
    """

    id: int
    role: str
    endpoint: str
    host: str
    rank: int
    restorable: bool = False
    restore: bool = False
    #: A server of a replicated job: its replication endpoint, then a standby endpoint per range it backs.
    replication: tuple[str, ...] = ()
    op: ClassVar[str] = "register"


@dataclass(frozen=True)
class Barrier:
    """``barrier``: worker ``rank`` arrived at the barrier ``name``."""

    id: int
    rank: int
    name: str
    op: ClassVar[str] = "barrier"


@dataclass(frozen=True)
class Done:
    """``done``: worker ``rank`` has finished."""

    id: int
    rank: int
    op: ClassVar[str] = "done"


@dataclass(frozen=True)
class Failed:
    """``failed``: worker ``rank``'s program raised; ``message`` says what (its exception, in one line)."""

    id: int
    rank: int
    message: str
    op: ClassVar[str] = "failed"


@dataclass(frozen=True)
class TableQuery:
    """``table``: the scheduler's current view of the job (monitoring; does not register)."""

    id: int
    op: ClassVar[str] = "table"


@dataclass(frozen=True)
class SlowReport:
    """What a server's heartbeat may say of who is slow (``lateness``, optional; sync jobs, now and then).

    ``round``: the shard's round (the highest version of its keys); ``measured``: the workers whose lateness it
    measured; ``typical``: their typical (median) median lateness in seconds; ``slow``: ``(rank, median lateness
    s, pushes, dropped)`` of those it names slow (:meth:`psrt.shard.stragglers.Lateness.report`), slowest first,
    at most :data:`MAX_SLOW_ROWS`.
    """

    round: int
    measured: int
    typical: float
    slow: tuple[tuple[int, float, int, int], ...] = ()


@dataclass(frozen=True)
class Heartbeat:
    """``heartbeat``: a registered process is alive; answered with ``ok`` so it knows the scheduler is too.

    ``epoch`` is the newest membership a server has adopted (:class:`Members`); workers send 0. A server's may
    carry its :class:`SlowReport` (None: not this time).
    """

    id: int
    role: str
    rank: int
    pid: int
    epoch: int
    lateness: Optional[SlowReport] = None
    op: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class Beats:
    """``beats``: the workers ``ranks`` of one process are alive, in one message (a process hosting many workers,
    ``psrt worker --clients N``, beats once per interval for all of them); answered with ``ok``, and with
    :class:`NotMembers` for ranks the scheduler does not count."""

    id: int
    ranks: tuple[int, ...]
    pid: int
    op: ClassVar[str] = "beats"


ControlRequest = Union[Register, Barrier, Done, Failed, TableQuery, Heartbeat, Beats]


def _rank(h: dict[str, Any]) -> int:
    value = h.get("rank")
    if type(value) is not int or not -1 <= value <= MAX_U63:
        raise ProtocolError("field 'rank' must be an integer >= -1 (-1: let the scheduler assign one)")
    return value


def _ranks(h: dict[str, Any], key: str, most: int, lo: int = 0) -> tuple[int, ...]:
    value = h[key]
    if type(value) is not list or not lo <= len(value) <= most or any(
            type(r) is not int or not 0 <= r <= MAX_U63 for r in value):
        raise ProtocolError(f"field {key!r} must be a list of {lo} to {most} worker ranks")
    return tuple(value)


def decode_control_request(frames: Sequence[Any], limits: WireLimits = CONTROL_LIMITS) -> ControlRequest:
    """Decode a message a server or worker sent the scheduler.

    Raises
    ------
    ProtocolError
        With ``request_id`` set when the header got that far.
    """
    request_id = None
    try:
        if len(frames) != 1:
            raise ProtocolError(f"control messages are one frame, got {len(frames)}")
        h = unpack_header(frames[0], limits)
        if type(h.get("id")) is int and 0 <= h["id"] <= MAX_U63:
            request_id = h["id"]
        check_version(h)
        optional = _take_optional(h)
        op = op_of(h, _REQUEST_FIELDS, "control")
        rid = uint(h, "id")
        if op == "register":
            role = string(h, "role", allowed=REGISTERING_ROLES)
            endpoint = string(h, "endpoint", _MAX_ENDPOINT)
            if role == "server" and "://" not in endpoint:
                raise ProtocolError(f"a server must announce an endpoint like tcp://HOST:PORT, got {endpoint!r}")
            for flag in ("restorable", "restore"):
                if type(h[flag]) is not bool:
                    raise ProtocolError(f"field {flag!r} must be true or false")
            replication = _endpoints(optional.get("replication", []), "replication")
            if replication and role != "server":
                raise ProtocolError("only a server announces replication endpoints")
            return Register(rid, role, endpoint, string(h, "host", _MAX_ENDPOINT), _rank(h), h["restorable"],
                            h["restore"], replication)
        if op == "barrier":
            return Barrier(rid, _rank(h), string(h, "name", _MAX_BARRIER_NAME))
        if op == "done":
            return Done(rid, _rank(h))
        if op == "failed":
            return Failed(rid, _rank(h), string(h, "message", _MAX_MESSAGE))
        if op == "heartbeat":
            lateness = _slow_report(optional["lateness"]) if "lateness" in optional else None
            return Heartbeat(rid, string(h, "role", allowed=REGISTERING_ROLES), _rank(h), uint(h, "pid", 1 << 32),
                             uint(h, "epoch"), lateness)
        if op == "beats":
            return Beats(rid, _ranks(h, "ranks", MAX_BEAT_RANKS, lo=1), uint(h, "pid", 1 << 32))
        return TableQuery(rid)
    except ProtocolError as exc:
        exc.request_id = request_id  # type: ignore[attr-defined]
        raise


def encode_register(rid: int, role: str, endpoint: str, host: str, rank: int, restorable: bool = False,
                    restore: bool = False, replication: Sequence[str] = ()) -> list[Any]:
    """Frames of a ``register`` request (``replication`` only where given: an unreplicated job's are unchanged)."""
    header = {"op": "register", "id": rid, "role": role, "endpoint": endpoint, "host": host, "rank": rank,
              "restorable": restorable, "restore": restore}
    if replication:
        header["replication"] = list(replication)
    return encode(header)


def _take_optional(h: dict[str, Any]) -> dict[str, Any]:
    """Remove the optional fields of the header's op from ``h`` and return them (an unknown op keeps all)."""
    op = h.get("op")
    names = _OPTIONAL_FIELDS.get(op, ()) if type(op) is str else ()
    return {name: h.pop(name) for name in names if name in h}


def _backup_workers(optional: dict[str, Any]) -> Union[int, str]:
    """A table's backup workers b (0 when the table does not say), or ``"auto"``."""
    if "backup_workers" not in optional:
        return 0
    return "auto" if optional["backup_workers"] == "auto" else uint(optional, "backup_workers", 1 << 31)


def _endpoints(value: Any, what: str, lo: int = 0) -> tuple[str, ...]:
    if type(value) is not list or not lo <= len(value) <= MAX_REPLICATION_ENDPOINTS or any(
            type(e) is not str or "://" not in e or len(e) > _MAX_ENDPOINT for e in value):
        raise ProtocolError(f"field {what!r} must be a list of endpoints like tcp://HOST:PORT")
    return tuple(value)


def encode_barrier(rid: int, rank: int, name: str) -> list[Any]:
    """Frames of a ``barrier`` request."""
    return encode({"op": "barrier", "id": rid, "rank": rank, "name": name})


def encode_done(rid: int, rank: int) -> list[Any]:
    """Frames of a ``done`` request."""
    return encode({"op": "done", "id": rid, "rank": rank})


def encode_failed(rid: int, rank: int, message: str) -> list[Any]:
    """Frames of a ``failed`` request (the message cut to what the decoder takes)."""
    return encode({"op": "failed", "id": rid, "rank": rank, "message": message[:_MAX_MESSAGE]})


def encode_table_query(rid: int) -> list[Any]:
    """Frames of a ``table`` request."""
    return encode({"op": "table", "id": rid})


def encode_heartbeat(rid: int, role: str, rank: int, pid: int, epoch: int = 0,
                     lateness: Optional[SlowReport] = None) -> list[Any]:
    """Frames of a ``heartbeat`` request (``lateness`` only where given: other heartbeats are unchanged)."""
    header: dict[str, Any] = {"op": "heartbeat", "id": rid, "role": role, "rank": rank, "pid": pid, "epoch": epoch}
    if lateness is not None:
        header["lateness"] = [lateness.round, lateness.measured, float(lateness.typical),
                              [[r, float(m), p, d] for r, m, p, d in lateness.slow[:MAX_SLOW_ROWS]]]
    return encode(header)


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and 0.0 <= value < 1e9  # (NaN fails both)


def _slow_report(value: Any) -> SlowReport:
    """A heartbeat's ``lateness``: ``[round, measured, typical_s, [[rank, median_s, pushes, dropped], ...]]``."""
    what = "field 'lateness' must be [round, measured, typical seconds, [[rank, median seconds, pushes, dropped]]]"
    if type(value) is not list or len(value) != 4 or type(value[3]) is not list or len(value[3]) > MAX_SLOW_ROWS:
        raise ProtocolError(what)
    head = {"lateness round": value[0], "lateness measured": value[1]}
    if not _seconds(value[2]):
        raise ProtocolError(what)
    rows = []
    for row in value[3]:
        if type(row) is not list or len(row) != 4 or not _seconds(row[1]):
            raise ProtocolError(what)
        fields = {"lateness rank": row[0], "lateness pushes": row[2], "lateness dropped": row[3]}
        rows.append((uint(fields, "lateness rank"), float(row[1]), uint(fields, "lateness pushes"),
                     uint(fields, "lateness dropped")))
    return SlowReport(uint(head, "lateness round"), uint(head, "lateness measured"), float(value[2]), tuple(rows))


def encode_beats(rid: int, ranks: Sequence[int], pid: int) -> list[Any]:
    """Frames of a ``beats`` request (at most :data:`MAX_BEAT_RANKS` ranks)."""
    return encode({"op": "beats", "id": rid, "ranks": list(ranks), "pid": pid})


# ---------------------------------------------------------------------------------------------- replies
@dataclass(frozen=True)
class Table:
    """``table``: what the scheduler tells a registered process (or a monitor, with rank -1) about the job."""

    id: int
    rank: int
    num_servers: int
    num_workers: int
    mode: str
    #: Shard endpoints in shard order (empty until the job has formed).
    servers: list[str]
    #: Whether workers may leave and join while the job runs (``--elastic``); ``num_workers`` is then the
    #: number of members when this table was sent.
    elastic: bool = False
    #: ``ssp`` mode: how many pushes a worker may run ahead of the slowest.
    staleness: int = 0
    #: A replicated job (``--replicas R``): R, the holders of each range and the shards' replication endpoints.
    replication: Optional[Replication] = None
    #: Sync mode: backup workers b, a round closes on the first W - b pushes, or ``"auto"`` (sent only when b > 0,
    #: so that a table of a job without them is the one older processes know).
    backup_workers: Union[int, str] = 0
    #: How every worker cuts tensors into chunks (:data:`CUTS`), decided by the scheduler when the job formed;
    #: None when the table does not say (before formation, or from an older scheduler): the worker decides from
    #: the endpoints.
    cut: Optional[str] = None
    op: ClassVar[str] = "table"


@dataclass(frozen=True)
class Replication:
    """What a replicated job's table says of its copies (:mod:`psrt.control.placement`).

    ``token`` is the job's replication token, in the tables of its servers only (empty in the others'): a replica
    takes a replication message only with it (and, with keys, only over a connection with the job's server key).
    """

    replicas: int
    #: Per range, its live holders, the one serving it first.
    holders: tuple[tuple[int, ...], ...]
    #: Per shard: its replication endpoint, then its standby endpoint for each range it backs (empty: not formed).
    endpoints: tuple[tuple[str, ...], ...]
    token: str = ""


@dataclass(frozen=True)
class Ok:
    """``ok``: a barrier was passed, or ``done`` was taken."""

    id: int
    op: ClassVar[str] = "ok"


@dataclass(frozen=True)
class ControlError:
    """``error``: the scheduler refused a request, or the job failed; ``code`` is machine-readable."""

    id: int
    code: str
    message: str
    op: ClassVar[str] = "error"


@dataclass(frozen=True)
class Shutdown:
    """``shutdown``: sent unprompted to the servers when every worker is done."""

    id: int
    op: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Abort:
    """``abort``: sent unprompted to every process when the job fails (a peer died); ``message`` names it."""

    id: int
    code: str
    message: str
    op: ClassVar[str] = "abort"


@dataclass(frozen=True)
class Members:
    """``members``: sent unprompted to the servers of an elastic job whenever its workers change.

    ``epoch`` counts the changes; a server confirms it adopted one in its next heartbeat.
    """

    id: int
    epoch: int
    workers: list[int]
    op: ClassVar[str] = "members"


@dataclass(frozen=True)
class Moved:
    """``moved``: sent unprompted to the workers when shard ``shard`` came back on another endpoint: their requests
    to it go to ``endpoint`` from now on. ``replica``: its range was taken over by a replica, which holds all that
    the shard answered (a replicated job's failover); else the shard itself restarted, maybe from a checkpoint
    behind what it answered."""

    id: int
    shard: int
    endpoint: str
    replica: bool
    op: ClassVar[str] = "moved"


@dataclass(frozen=True)
class Finished:
    """``finished``: sent unprompted to the servers of a fixed (not elastic) job when workers said ``done``
    while others go on; ``workers`` lists every finished rank. A sync round that still needs one of them can
    never complete, so the servers refuse it at once, naming the worker."""

    id: int
    workers: list[int]
    op: ClassVar[str] = "finished"


@dataclass(frozen=True)
class Forming:
    """``forming``: a registration was received and the job is still forming: how many servers and workers of
    how many have registered. Sent at once to each registration (its id), then again to every waiting process
    (same id) when the counts move; the ``table`` follows once the job forms."""

    id: int
    servers: int
    num_servers: int
    workers: int
    num_workers: int
    op: ClassVar[str] = "forming"


@dataclass(frozen=True)
class NotMembers:
    """``not_members``: the reply to a ``beats`` naming ranks the scheduler does not count in the job (they left an
    elastic job, or never joined); ``message`` says why. The process's other workers are unaffected."""

    id: int
    workers: tuple[int, ...]
    message: str
    op: ClassVar[str] = "not_members"


@dataclass(frozen=True)
class Ranges:
    """``ranges``: sent unprompted to the servers of a replicated job when a shard died or another took its place:
    each key range's live holders, the one that serves it first, and every shard's replication endpoints. A
    replica named first for a range it backs takes it over (the only promotion there is); a primary stops copying
    to holders no longer named, and gives a holder it newly names the whole range first."""

    id: int
    holders: tuple[tuple[int, ...], ...]
    #: Per shard: its replication endpoint, then its standby endpoints (as in the table's replication).
    endpoints: tuple[tuple[str, ...], ...] = ()
    op: ClassVar[str] = "ranges"


ControlReply = Union[Table, Ok, ControlError, Shutdown, Abort, Members, Moved, Finished, Forming, NotMembers, Ranges]


def decode_control_reply(frames: Sequence[Any], limits: WireLimits = CONTROL_LIMITS) -> ControlReply:
    """Decode a message the scheduler sent.

    Raises
    ------
    ProtocolError
        When it is malformed, whatever is wrong with it.
    """
    if len(frames) != 1:
        raise ProtocolError(f"control messages are one frame, got {len(frames)}")
    h = unpack_header(frames[0], limits)
    check_version(h)
    optional = _take_optional(h)
    op = op_of(h, _REPLY_FIELDS, "control reply")
    rid = uint(h, "id")
    if op == "ranges":
        endpoints = h["endpoints"]
        if type(endpoints) is not list or len(endpoints) > MAX_REPLICATION_ENDPOINTS * 16:
            raise ProtocolError("ranges: 'endpoints' must be a list per shard")
        return Ranges(rid, _holders(h["holders"]), tuple(_endpoints(e, "replication endpoints") for e in endpoints))
    if op == "table":
        servers = h["servers"]
        if type(servers) is not list or any(type(s) is not str or "://" not in s or len(s) > _MAX_ENDPOINT
                                            for s in servers):
            raise ProtocolError("table: 'servers' must be a list of endpoints")
        if type(h["elastic"]) is not bool:
            raise ProtocolError("table: 'elastic' must be true or false")
        replication = None
        if "replication" in optional:
            replication = _replication(optional["replication"])
        cut = string(optional, "cut", allowed=CUTS) if "cut" in optional else None
        return Table(rid, _rank(h), uint(h, "num_servers", lo=1), uint(h, "num_workers"),
                     string(h, "mode", allowed=MODES), list(servers), h["elastic"], uint(h, "staleness", 1 << 31),
                     replication, _backup_workers(optional), cut)
    if op in ("members", "finished"):
        workers = h["workers"]
        if type(workers) is not list or any(type(r) is not int or not 0 <= r <= MAX_U63 for r in workers):
            raise ProtocolError(f"{op}: 'workers' must be a list of ranks")
        if op == "finished":
            return Finished(rid, list(workers))
        return Members(rid, uint(h, "epoch"), list(workers))
    if op == "moved":
        endpoint = string(h, "endpoint", _MAX_ENDPOINT)
        if "://" not in endpoint:
            raise ProtocolError(f"moved: 'endpoint' must be an endpoint like tcp://HOST:PORT, got {endpoint!r}")
        if type(h["replica"]) is not bool:
            raise ProtocolError("moved: 'replica' must be true or false")
        return Moved(rid, uint(h, "shard", 1 << 31), endpoint, h["replica"])
    if op == "forming":
        return Forming(rid, uint(h, "servers"), uint(h, "num_servers"), uint(h, "workers"), uint(h, "num_workers"))
    if op == "not_members":
        return NotMembers(rid, _ranks(h, "workers", MAX_BEAT_RANKS, lo=1), string(h, "message", _MAX_MESSAGE))
    if op == "error":
        return ControlError(rid, string(h, "code", 64), string(h, "message", 1 << 16))
    if op == "abort":
        return Abort(rid, string(h, "code", 64), string(h, "message", 1 << 16))
    return Ok(rid) if op == "ok" else Shutdown(rid)


def encode_table(rid: int, rank: int, num_servers: int, num_workers: int, mode: str,
                 servers: list[str], elastic: bool = False, staleness: int = 0,
                 replication: Optional[Replication] = None, backup_workers: Union[int, str] = 0,
                 cut: Optional[str] = None) -> list[Any]:
    """Frames of a ``table`` reply (``replication`` only in a replicated job's, ``backup_workers`` only when > 0,
    ``cut`` once the job formed: a job without them sends the table older processes know)."""
    header = {"op": "table", "id": rid, "rank": rank, "num_servers": num_servers, "num_workers": num_workers,
              "mode": mode, "servers": servers, "elastic": elastic, "staleness": staleness}
    if replication is not None:
        header["replication"] = {"replicas": replication.replicas, "token": replication.token,
                                 "holders": [list(h) for h in replication.holders],
                                 "endpoints": [list(e) for e in replication.endpoints]}
    if backup_workers:
        header["backup_workers"] = backup_workers
    if cut is not None:
        header["cut"] = cut
    return encode(header)


def encode_ranges(holders: Sequence[Sequence[int]], endpoints: Sequence[Sequence[str]] = ()) -> list[Any]:
    """Frames of the ``ranges`` notice (id 0) to the servers of a replicated job: each range's live holders, and
    each shard's replication endpoints (a server that took a dead shard's place announced new ones)."""
    return encode({"op": "ranges", "id": 0, "holders": [list(h) for h in holders],
                   "endpoints": [list(e) for e in endpoints]})


def _holders(value: Any) -> tuple[tuple[int, ...], ...]:
    if type(value) is not list or len(value) > MAX_REPLICATION_ENDPOINTS * 16 or any(
            type(h) is not list or len(h) > MAX_REPLICATION_ENDPOINTS
            or any(type(r) is not int or not 0 <= r < 1 << 31 for r in h) for h in value):
        raise ProtocolError("field 'holders' must be a list of lists of shard ranks")
    return tuple(tuple(h) for h in value)


def _replication(value: Any) -> Replication:
    if type(value) is not dict or set(value) != {"replicas", "token", "holders", "endpoints"}:
        raise ProtocolError("table: 'replication' must be a map of replicas, token, holders and endpoints")
    endpoints = value["endpoints"]
    if type(endpoints) is not list or len(endpoints) > MAX_REPLICATION_ENDPOINTS * 16:
        raise ProtocolError("table: replication 'endpoints' must be a list per shard")
    return Replication(uint(value, "replicas", 1 << 16), _holders(value["holders"]),
                       tuple(_endpoints(e, "replication endpoints") for e in endpoints), string(value, "token", 128))


def encode_members(epoch: int, workers: list[int]) -> list[Any]:
    """Frames of the ``members`` notice (id 0)."""
    return encode({"op": "members", "id": 0, "epoch": epoch, "workers": workers})


def encode_moved(shard: int, endpoint: str, replica: bool) -> list[Any]:
    """Frames of the ``moved`` notice (id 0)."""
    return encode({"op": "moved", "id": 0, "shard": shard, "endpoint": endpoint, "replica": replica})


def encode_finished(workers: list[int]) -> list[Any]:
    """Frames of the ``finished`` notice (id 0)."""
    return encode({"op": "finished", "id": 0, "workers": workers})


def encode_forming(rid: int, servers: int, num_servers: int, workers: int, num_workers: int) -> list[Any]:
    """Frames of a ``forming`` reply."""
    return encode({"op": "forming", "id": rid, "servers": servers, "num_servers": num_servers, "workers": workers,
                   "num_workers": num_workers})


def encode_ok(rid: int) -> list[Any]:
    """Frames of an ``ok`` reply."""
    return encode({"op": "ok", "id": rid})


def encode_control_error(rid: int, code: str, message: str) -> list[Any]:
    """Frames of an ``error`` reply."""
    return encode({"op": "error", "id": rid, "code": code, "message": message})


def encode_shutdown() -> list[Any]:
    """Frames of the ``shutdown`` notice (id 0: it answers no request)."""
    return encode({"op": "shutdown", "id": 0})


def encode_abort(code: str, message: str) -> list[Any]:
    """Frames of the ``abort`` notice (id 0)."""
    return encode({"op": "abort", "id": 0, "code": code, "message": message})


def encode_not_members(rid: int, workers: Sequence[int], message: str) -> list[Any]:
    """Frames of a ``not_members`` reply."""
    return encode({"op": "not_members", "id": rid, "workers": list(workers), "message": message[:_MAX_MESSAGE]})
