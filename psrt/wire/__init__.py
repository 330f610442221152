"""The wire protocol, written once: framing, decode limits, and one typed record per message of either plane.

A message is a multipart ZeroMQ message ``[header, buf_0, ..., buf_{n-1}]``. The header is a msgpack map;
tensor bytes never pass through msgpack, so large buffers travel zero-copy. Each tensor in a message is
described by one entry ``[name, part, dtype, shape]`` in the header's ``tensors`` list, and its bytes are the
buffer frame at the same position; a ``params`` reply may instead carry all its tensors in one frame, back to back
in their order (a shard sends a sync round's answer so: :mod:`psrt.shard.answers`). ``part`` numbers the
contiguous chunks of a tensor split by :mod:`psrt.partition` (0 for a whole tensor); ``dtype`` is a name from
:mod:`psrt.dtypes` (``<f4``, ``<f8``).
Every header carries ``v`` (the protocol version, :data:`PROTOCOL_VERSION`), ``op``, and ``id`` (the request
id, echoed in the reply). Untrusted bytes are decoded with explicit limits and an exact field set per op
(:mod:`psrt.wire.codec`); any violation is a :class:`~psrt.errors.ProtocolError`.

Data plane (:mod:`psrt.wire.data` the requests, :mod:`psrt.wire.replies` the replies), worker to shard and back:

==============  =======================================================  =====================================
request         fields (besides ``v, op, id``)                           reply
==============  =======================================================  =====================================
``init``        ``worker, session, optimizer, tensors`` + buffers         ``params`` + ``mode, num_workers,
                (set values unless the key exists)                         conflicts``
                + ``check: true``: no buffers, nothing set: would the     ``ack``, or the ``error`` the init
                init be taken?                                            would get
``push``        ``worker, session, seq, clock, tensors`` + buffers        ``ack``
                (+ ``base`` to a sync shard)
``push_pull``   as ``push``                                               ``params`` once the push's round
                                                                          is applied
``pull``        ``worker, clock, keys``: ``[[name, part, min_version],    ``params``
                ...]`` (+ ``again: true``, sent again after the
                shard restarted: any version will do)
``stats``       (none)                                                    ``stats``
``checkpoint``  (none): write a checkpoint now                            ``saved``
==============  =======================================================  =====================================

Embedding tables (:mod:`psrt.wire.rows`, its docstring has their table): ``init_table``, ``push_rows`` (both
answered by ``ack``) and ``pull_rows`` (answered by ``rows`` + one frame); ids travel as an int64 frame, rows as
one frame of the table's dtype.

Shared-memory lanes (:mod:`psrt.wire.lanes`, its docstring has their table): ``lane_probe`` (answered by
``beacon``) and ``lane_open`` (answered by ``lane``) set up a segment between a worker and a shard of one host,
``lane_close`` (answered by ``closed``) gives it back; ``local_open`` (answered by ``local``) lets a worker that read
the shard's beacon send its requests over a local connection instead of ZeroMQ (:mod:`psrt.transport.local`);
``push``, ``push_pull``, ``pull``, ``push_rows`` and ``pull_rows`` then carry a ``lane`` field instead of buffer
frames, and the ``params`` and ``rows`` replies a ``lane`` field (the segment's generation) instead of theirs.

Replies: ``params {tensors, versions}`` + buffers (after ``init`` also ``mode, num_workers, conflicts``: the
shard's mode and W, and the indices of tensors that exist with another optimizer; and ``backup_workers`` where
the shard has some, and ``replicated: true`` where its range has replicas); ``ack {versions, duplicate}`` (a
push's also ``taken, held``: when the shard took it in and how long it held the answer, ns of its monotonic clock,
by which a worker's overlapped pushes are paced); ``stats {stats}``; ``saved {path}``; ``error {code, message}``,
to any request.

Control plane (:mod:`psrt.wire.control`), one header frame each, no buffers:

==============  =======================================================  =====================================
request         fields                                                   reply
==============  =======================================================  =====================================
``register``    ``role`` (server, worker), ``endpoint, host, rank,        ``forming`` at once (and when the
                restorable, restore``                                    counts move), ``table`` once the job
                                                                         forms
``barrier``     ``rank, name``                                           ``ok`` once every worker arrived
``done``        ``rank``                                                 ``ok``
``failed``      ``rank, message``: the worker's program raised            ``ok``
``table``       (none)                                                   ``table`` (rank -1)
``heartbeat``   ``role, rank, pid, epoch``: every heartbeat interval      ``ok``
``beats``       ``ranks, pid``: a process's workers, every interval      ``ok`` (and ``not_members``)
==============  =======================================================  =====================================

Replies: ``table {rank, num_servers, num_workers, mode, servers, elastic}`` (and ``backup_workers`` when > 0),
``forming {servers, num_servers, workers, num_workers}``, ``ok {}``, ``error {code, message}``; and, unprompted (id
0): ``shutdown {}`` to the servers when every worker is done, ``abort {code, message}`` to every process when the
job fails (the message names the dead peer), and, in an elastic job, ``members {epoch, workers}`` to the servers
whenever the workers change; in a fixed job, ``finished {workers}`` to the servers when workers said ``done`` while
others go on; ``moved {shard, endpoint}`` to the workers when a shard restarted from its checkpoint on another
endpoint, or when a replica took a dead shard's key range over; ``ranges {holders, endpoints}`` to the servers of a
replicated job when a shard died or another took its place. A replicated job's ``register`` (a server's) and
``table`` also carry ``replication`` (:mod:`psrt.wire.control`); the copies themselves travel between shards
(:mod:`psrt.wire.replication`; an embedding table's, :mod:`psrt.wire.rowcopy`).
A ``beats`` naming ranks the scheduler does not count is also answered ``not_members {workers, message}``.
"""

from psrt.wire.codec import (
    PROTOCOL_VERSION,
    Key,
    TensorMeta,
    check_version,
    dtype_name,
    encode,
    pack_header,
    same_limits,
    tensor_entry,
    unpack_header,
)
from psrt.wire.control import (
    CONTROL_LIMITS,
    MAX_BEAT_RANKS,
    MAX_SLOW_ROWS,
    Abort,
    Barrier,
    Beats,
    ControlError,
    ControlReply,
    ControlRequest,
    Done,
    Failed,
    Finished,
    Forming,
    Heartbeat,
    Members,
    Moved,
    NotMembers,
    Ok,
    Ranges,
    Register,
    Replication,
    Shutdown,
    SlowReport,
    Table,
    TableQuery,
    decode_control_reply,
    decode_control_request,
    encode_abort,
    encode_barrier,
    encode_beats,
    encode_control_error,
    encode_done,
    encode_failed,
    encode_finished,
    encode_forming,
    encode_heartbeat,
    encode_members,
    encode_moved,
    encode_not_members,
    encode_ok,
    encode_ranges,
    encode_register,
    encode_shutdown,
    encode_table,
    encode_table_query,
)
from psrt.wire.data import (
    CheckpointRequest,
    InitRequest,
    PullKey,
    PullRequest,
    PushRequest,
    Request,
    StatsRequest,
    data_request_id,
    decode_request,
    encode_checkpoint_request,
    encode_init,
    encode_pull,
    encode_push,
    encode_push_after,
    encode_stats_request,
    push_prefix,
)
from psrt.wire.lanes import (
    BeaconReply,
    ClosedReply,
    LaneCloseRequest,
    LaneOpenRequest,
    LaneProbeRequest,
    LaneRef,
    LaneReply,
    LocalOpenRequest,
    LocalReply,
    encode_beacon,
    encode_closed,
    encode_lane,
    encode_lane_close,
    encode_lane_open,
    encode_lane_probe,
    encode_local,
    encode_local_open,
)
from psrt.wire.replies import (
    AckReply,
    ErrorReply,
    HeldReply,
    JobInfo,
    ParamsReply,
    Reply,
    SavedReply,
    StatsReply,
    decode_reply,
    encode_ack,
    encode_error,
    encode_held,
    encode_params,
    encode_params_packed,
    encode_saved,
    encode_stats,
    params_tensors,
)
from psrt.wire.rows import (
    IDS_DTYPE,
    InitTableRequest,
    PullRowsRequest,
    PushRowsRequest,
    RowsReply,
    TableStatsRequest,
    encode_init_table,
    encode_pull_rows,
    encode_push_rows,
    encode_rows,
    encode_table_stats,
)

__all__ = [
    "PROTOCOL_VERSION", "Key", "TensorMeta", "check_version", "dtype_name", "encode", "pack_header",
    "same_limits", "tensor_entry", "unpack_header",
    "InitRequest", "PushRequest", "PullKey", "PullRequest", "StatsRequest", "CheckpointRequest", "Request",
    "JobInfo", "ParamsReply", "AckReply", "StatsReply", "ErrorReply", "SavedReply", "HeldReply", "Reply",
    "decode_request", "decode_reply", "data_request_id", "encode_init", "encode_push", "encode_push_after",
    "push_prefix", "encode_pull", "encode_stats_request",
    "encode_checkpoint_request", "encode_params", "params_tensors", "encode_params_packed", "encode_ack",
    "encode_stats", "encode_error", "encode_held", "encode_saved",
    "CONTROL_LIMITS", "Register", "Barrier", "Done", "Failed", "TableQuery", "ControlRequest", "Table", "Ok",
    "ControlError", "Shutdown", "Abort", "Heartbeat", "Members", "Finished", "Forming", "ControlReply",
    "decode_control_request", "decode_control_reply",
    "encode_register", "encode_barrier", "encode_done", "encode_failed", "encode_finished",
    "encode_forming", "encode_table_query", "encode_table", "encode_ok",
    "IDS_DTYPE", "InitTableRequest", "PushRowsRequest", "PullRowsRequest", "RowsReply", "encode_init_table",
    "encode_push_rows", "encode_pull_rows", "encode_rows", "TableStatsRequest", "encode_table_stats",
    "LaneRef", "LaneProbeRequest", "LaneOpenRequest", "BeaconReply", "LaneReply", "encode_lane_probe",
    "encode_lane_open", "encode_beacon", "encode_lane", "LaneCloseRequest", "ClosedReply", "encode_lane_close",
    "encode_closed", "LocalOpenRequest", "LocalReply", "encode_local_open", "encode_local",
    "encode_control_error", "encode_shutdown", "encode_abort", "encode_heartbeat", "encode_members",
    "Moved", "encode_moved", "Beats", "MAX_BEAT_RANKS", "encode_beats", "NotMembers", "encode_not_members",
    "Ranges", "Replication", "encode_ranges", "SlowReport", "MAX_SLOW_ROWS",
]
