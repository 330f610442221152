"""The shard server: one process owning a disjoint part of the parameters, serving workers on a ROUTER socket.

The loop is single-threaded: it receives a message, validates it completely, and only then changes state, so a
malformed or inconsistent request gets an error reply and leaves every parameter as it was. The optimizer
kernels release the GIL and ZeroMQ moves bytes on its own I/O thread, so transfers overlap the arithmetic.

Modes (:mod:`psrt.shard.store` holds the round rules): **sync** sums a round's W pushes per key and steps once with
``scale = 1/W``; a push a round ahead waits, queued, and a pull waits for the round its worker's pushes joined; with
``backup_workers`` b a round closes on W - b pushes and a late push is dropped (:mod:`psrt.shard.stragglers`).
**async** applies every push on arrival. **ssp** applies on arrival too, but answers a pull at clock c (the
worker's pushes so far) once every worker's pushes to the pulled keys reach c - ``staleness``.

Every push carries ``(worker, session, seq)``; a push already applied is acknowledged again but not re-applied,
whatever the order pushes arrive in (:mod:`psrt.shard.replay`).
Checkpoints (``config.checkpoint_dir``, :mod:`psrt.shard.recovery`): the whole state with the sequence numbers, every
``checkpoint_every`` rounds, every ``checkpoint_secs`` seconds, on request and at a clean shutdown, named by the
shard's rank; ``config.restore`` resumes from the newest of its rank.
Embedding tables (``init_table``, ``push_rows``, ``pull_rows``) are served by :mod:`psrt.shard.tables`, per table.
A replicated job's copies (``--replicas R``) are :mod:`psrt.shard.replication`'s: the loop calls it where a round
completes, before anything that round made true is answered.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from psrt import kernels, optim, transport, wire
from psrt.config import ServerConfig
from psrt.control import security
from psrt.errors import ConfigError, ProtocolError, PsrtError, RequestRefused
from psrt.shard import admission, checkpoint, realign, replication, tables
from psrt.shard.answers import ShardReplies
from psrt.shard.counters import Counters, report
from psrt.shard.pulls import PullQueue, Waiter
from psrt.shard.recovery import Checkpointer, Recovery
from psrt.shard.replication import COPY_POLL, Copier, Replication
from psrt.shard.store import Entry, Key, Store
from psrt.shard.stragglers import REPORT_EVERY_S, TELL_EVERY_S, Lateness
from psrt.shard.tablecopy import TableCopies
from psrt.shm.lanes import ShardLane, ShardLanes
from psrt.wire import compression

if TYPE_CHECKING:
    from psrt.control.link import SchedulerLink

__all__ = ["Server"]

log = logging.getLogger("psrt.server")

#: Messages handled per wake-up before the loop checks for a stop request again.
_BATCH = 256
#: Replies to messages queued together that go out together (:meth:`psrt.transport.RouterChannel.hold`).
_HOLD = 16
#: ... unless the batch worked this long since the oldest was held: they go then. Holding saves the I/O thread a
#: wake-up per reply (microseconds), worth it for small requests handled in microseconds each; a reply held
#: behind requests that take longer (a large tensor's pieces, milliseconds each) would only keep its worker
#: waiting, and keep it from taking that piece in while the shard works on the next.
_HOLD_S = 50e-6


class Server(Recovery):
    """A shard server bound to ``config.bind``.

    Parameters
    ----------
    config : ServerConfig
        Endpoint, W, mode, limits and keys (with keys, only the job's clients get a message through).
    scheduled : bool
        The rank (and with it the checkpoint to restore) comes from a scheduler: :meth:`join` its table before
        serving. Else the shard takes its rank and restores (``config.restore``) at once.

    Raises
    ------
    BindError
        When the endpoint cannot be bound.
    ConfigError
        When ``config.keys`` names a missing or unusable key directory, ``config.checkpoint_dir`` is unwritable,
        or ``config.restore`` finds a directory holding checkpoints of other shards only.
    CheckpointError
        When another running shard writes this rank's checkpoints, or none of them can be read.

    Examples
    --------
    >>> server = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2))  # doctest: +SKIP
    >>> server.serve()  # until server.stop() or SIGTERM             # doctest: +SKIP
    """

    def __init__(self, config: ServerConfig, scheduled: bool = False) -> None:
        self.config = config
        keys = security.load_keys(config.keys, serve=True, connect=False)
        checkpoint.check_directory(config.checkpoint_dir)  # unwritable: fail now, not at every checkpoint
        self._ctx = transport.new_context()
        try:
            self._chan = transport.RouterChannel(self._ctx, config.bind, config.hwm, config.send_timeout,
                                                 keys=keys, max_frame=config.limits.max_frame_bytes)
        except Exception:
            self._ctx.term()
            raise
        self.endpoint: str = self._chan.endpoint
        self.lanes = ShardLanes(self.endpoint, config.shm)  # shared memory for workers on this host
        self.store = Store(config.mode, config.num_workers, config.backup_workers)
        self.store.use_shared_memory(self.lanes.arena)  # workers of this host copy each round's result themselves
        self.counters = Counters()
        self.lateness = Lateness()  # who is slow: per worker, how late its pushes come, how many were dropped
        self._slow_at = time.monotonic() + REPORT_EVERY_S  # when to log who is slow next
        self._tell_at = 0.0  # when to tell the scheduler next (_slow_report)
        self.replies = ShardReplies(self._chan, self.lanes, self.counters)
        self._reply, self._error = self.replies.reply, self.replies.error
        self._stop = threading.Event()
        self._pulls = PullQueue(lambda key: self.store.entries[key].version)
        # ssp: pulls waiting for the slowest worker's clock (per key) to come within the staleness bound.
        self._stale_pulls = PullQueue(lambda key: self.store.slowest_clock(self.store.entries[key]))
        #: Per worker, its early pushes (sync) held whole until they can join, each with when it was taken in.
        self._deferred: dict[int, deque[tuple[bytes, wire.PushRequest, list[Entry], Optional[ShardLane], int]]] = {}
        self._draining = False
        self._taken = 0  # when the message in hand was taken in (time.monotonic_ns)
        self._ckpt = Checkpointer(config)
        self.restored_from: Optional[Path] = None
        self.tables = tables.TableService(self.store, self._reply, self._error, config.nonfinite, config.row_limits)
        self.tables.staleness = config.staleness
        #: A replicated job: this shard's copies (:meth:`prepare_replication`), or a promoted standby's copier
        #: (:meth:`adopt_copier`); None otherwise.
        self._replication: Optional[Replication | Copier] = None
        self._control: Optional[SchedulerLink] = None
        self._ended = False  # the scheduler ended the job while a copy was awaited
        self._failed: Optional[BaseException] = None  # ... or aborted it: raised by the loop, not by a handler
        #: A range taken over: per key, what its copied state holds of each worker's pushes though they were not
        #: settled (:data:`psrt.shard.replication.Held`), with the sessions they are of.
        self._included: dict[Key, tuple[dict[int, int], dict[int, replication.Held]]] = {}
        if not scheduled:
            try:
                self._restore()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ loop
    @property
    def context(self):
        """The server's ZeroMQ context (its scheduler link shares it)."""
        return self._ctx

    def serve(self, control: Optional[SchedulerLink] = None) -> None:
        """Serve requests until :meth:`stop` is called or, with ``control``, the scheduler ends the job."""
        poll = self.config.poll_interval
        self._control = control
        if control is not None:
            control.report = self._slow_report
        while not self._stop.is_set():
            # A sync round's copy not yet acknowledged (pipelined): its replicas' answers end the wait too.
            # It is then read as often as an awaited copy reads the scheduler's notices (COPY_POLL).
            awaiting = self._replication.awaiting() if self._replication is not None else ()
            if self._chan.poll(min(poll, COPY_POLL) if awaiting else poll, awaiting):
                # Every message queued, then one receive that finds none: a socket's event flags cost a system
                # call per message, a receive that succeeds none. The first message's answer goes at once (a
                # single request waits for nothing else); those of the messages queued behind it go together.
                msg = self._chan.recv()
                if msg is not None:
                    self.handle(*msg)
                    chan = self._chan
                    chan.hold(_HOLD)
                    try:
                        since = time.perf_counter()
                        for _ in range(_BATCH - 1):
                            msg = chan.recv()
                            if msg is None:
                                break
                            self.handle(*msg)
                            now = time.perf_counter()
                            if now - since > _HOLD_S:
                                chan.flush()
                                since = now
                        self._flush_copies()  # what the batch changed: one copy, then its answers
                    finally:
                        self.replies.dropped(self._chan.release())
            self._flush_copies()  # (a copy that failed goes again)
            if self._ckpt.due_by_time():
                self._checkpoint_quietly()
            if self._failed is None and isinstance(self._replication, Replication):
                self._failed = self._replication.failure
            if self._failed is not None:
                raise self._failed
            if self._replication is not None:  # (a standby serving a range it took over has its range's copier)
                self._replication.sync_newcomers()
            if self.lateness.samples and time.monotonic() >= self._slow_at:
                self._slow_at = time.monotonic() + REPORT_EVERY_S
                self.report_slow()
            if self._ended or (control is not None and control.tick(self.set_members, self.set_finished,
                                                                    self._on_ranges)):
                log.info("the scheduler ended the job")
                return
            if self._replication is not None:
                # A replica the scheduler just named dead is waited for no more: what a pipelined copy kept back
                # for it goes now, as a copy that is awaited lets its answers go on that notice, not a poll later
                # (a sync push's ack would otherwise wait a poll interval for a replica that will never answer).
                self._replication.poll()

    # ------------------------------------------------------------------ replication
    def prepare_replication(self, replicas: int) -> tuple[str, ...]:
        """A replicated job (the scheduler said R > 0): bind the replication socket and the standbys of the ranges
        this shard will back; returns their endpoints, to announce when registering."""
        # A standby writes its range's checkpoints under that range's rank once it serves it (take_rank).
        config = dataclasses.replace(self.config, restore=False, rank=None, shm=False)
        self._replication = Replication(self, replicas, lambda bind: Server(dataclasses.replace(config, bind=bind),
                                                                            scheduled=True))
        self._replication.tick = self._tick_while_copying
        return self._replication.endpoints

    def _flush_copies(self) -> None:
        """A replicated job: the copy of what the batch of messages just handled changed, one for them all, awaited
        before the answers it kept back go (:meth:`Copier.flush`). One that fails keeps them back and goes again."""
        if self._replication is None:
            return
        try:
            self._replication.flush()
        except Exception:  # (a replica's send queue full past send_timeout): nothing is answered that is not held
            log.exception("the copy of this shard's latest changes to its replicas failed; it goes again")

    def take_rank(self, rank: int) -> None:
        """A standby taking range ``rank`` over: with a checkpoint directory, its checkpoints are that rank's from
        now on (the dead shard's lock went with its process)."""
        if self._ckpt.enabled:
            try:
                self._ckpt.start(rank)
            except checkpoint.CheckpointError as exc:
                log.error("%s; range %d is served without checkpoints", exc, rank)
                return
            self._ckpt.align(min((e.version for e in self.store.entries.values()), default=0))

    def checkpoint_at_exit(self) -> Optional[Path]:
        """At a clean shutdown: this shard's final checkpoint, and those of the ranges it took over."""
        path = super().checkpoint_at_exit()
        if isinstance(self._replication, Replication):
            self._replication.checkpoint_at_exit()
        return path

    def adopt_copier(self, copier: Copier, included: dict[Key, tuple[dict[int, int], dict[int, replication.Held]]]
                     ) -> None:
        """A standby taking its range over: its rounds are copied on to the range's remaining replicas, and a push
        sent again that its copied state holds in part is applied to the rest of its keys only (``included``)."""
        self._replication = copier
        self._included = included
        self.tables.copies = TableCopies(copier, self.tables)  # its tables are copied on too

    def join(self, table: wire.Table) -> None:
        """Adopt the scheduler's table (:meth:`Recovery.join`) and, in a replicated job, start copying."""
        super().join(table)
        if isinstance(self._replication, Replication):
            self._replication.start(table)
            assert self._replication.copier is not None
            self.tables.copies = TableCopies(self._replication.copier, self.tables)

    def _on_ranges(self, notice: wire.Ranges) -> None:
        if isinstance(self._replication, Replication):
            self._replication.on_ranges(notice)

    def _tick_while_copying(self) -> bool:
        """While a copy waits: heartbeat and read the scheduler's notices; True once the job ended or failed."""
        control = self._control
        if control is not None and not self._ended and self._failed is None:
            try:
                self._ended = control.tick(self.set_members, self.set_finished, self._on_ranges)
            except PsrtError as exc:  # the job failed: the serving loop raises it once this message is handled
                self._failed = exc
        return self._ended or self._failed is not None

    def set_members(self, workers: list[int]) -> None:
        """Adopt an elastic job's workers: rounds in progress stop waiting for those who left.

        Queued early pushes of workers that left are dropped; pulls waiting for a round this completes are
        answered.
        """
        members = frozenset(workers)
        log.info("members: workers %s", sorted(members))
        for worker in [w for w in self._deferred if w not in members]:
            del self._deferred[worker]
        completed = self.store.set_members(members)
        self.tables.set_members()
        for key in completed:
            self.counters.rounds += 1
            self._wake(key)
        if self.config.mode == "ssp":  # the slowest worker may have been the one that left
            for key in list(self.store.entries):
                self._wake(key)
        if self._deferred:
            self._drain_deferred()
        if completed:
            self._after_rounds()

    def set_finished(self, workers: list[int]) -> None:
        """Adopt the workers of a fixed job that said ``done`` while others go on.

        A sync round that still needs one of them can never complete: what waits on it (pulls, push_pulls and
        queued early pushes) is refused now, naming the worker, and so is every later push or pull that would
        need it. In ssp mode they no longer bound the others' reads.
        """
        self.store.finished = frozenset(workers)
        log.info("workers %s finished", sorted(self.store.finished))
        stuck = {k: w for k, e in self.store.entries.items() if (w := self.store.missing_finished(e)) is not None}
        for waiter in self._pulls.take(stuck):
            self._error(waiter.identity, waiter.request_id, "peer_finished",
                        _finished_message(stuck[next(k for k in waiter.keys if k in stuck)]))
        for worker, queue in list(self._deferred.items()):
            for identity, req, _, _, _ in queue:
                self._error(identity, req.id, "peer_finished", _finished_message(min(self.store.finished)))
            del self._deferred[worker]
        self.tables.set_finished(_finished_message)
        if self.config.mode == "ssp":
            for key in list(self.store.entries):
                self._wake(key)

    def _refuse_if_finished(self, worker: Optional[int], entries: list[Entry]) -> None:
        for entry in entries:
            missing = self.store.missing_finished(entry, worker)
            if missing is not None:
                raise RequestRefused("peer_finished", _finished_message(missing))

    def report_slow(self) -> Optional[str]:
        """Log (and return) the line naming the workers whose pushes come far later than the others', if any
        (every 30 s while serving, and when the job ends)."""
        line = self.lateness.slow()
        if line is not None:
            log.warning("%s", line)
        return line

    def _slow_report(self) -> Optional[wire.SlowReport]:
        """Who is slow, for a heartbeat to the scheduler: every :data:`TELL_EVERY_S` seconds of a job with rounds
        that measured lateness (None otherwise)."""
        now = time.monotonic()
        if now < self._tell_at or not self.lateness.samples:
            return None
        self._tell_at = now + TELL_EVERY_S
        return self.lateness.report(max((e.version for e in self.store.entries.values()), default=0))

    def stop(self) -> None:
        """Ask :meth:`serve` to return after the message in hand."""
        self._stop.set()

    def close(self) -> None:
        """Close the socket and the ZeroMQ context; let go of the rank's checkpoint files."""
        if self._replication is not None:
            self._replication.close()
        self._chan.close()
        self._ctx.term()
        self.lanes.close()
        self._ckpt.close()

    def handle(self, identity: bytes, frames: list[Any]) -> None:
        """Handle one message from ``identity``; never raises."""
        self._taken = time.monotonic_ns()  # (a push's ack says it: the spacing of a worker's pushes is their rate)
        self.counters.bytes_in += sum(map(len, frames))
        try:
            req = wire.decode_request(frames, self.config.limits)
        except ProtocolError as exc:
            rid = getattr(exc, "request_id", None)
            self._error(identity, rid if rid is not None else 0, "protocol", str(exc))
            return
        except Exception as exc:  # a decoder bug must not take the shard down either
            log.exception("internal error decoding a message")
            self._error(identity, 0, "internal", f"{type(exc).__name__}: {exc}")
            return
        try:
            if isinstance(req, wire.PushRequest):
                if not self._at_once(identity, req):
                    self._push(identity, req)
            elif isinstance(req, wire.PullRequest):
                self._pull(identity, req)
            elif isinstance(req, wire.InitRequest):
                self._init(identity, req)
            elif isinstance(req, tables.REQUESTS):
                if getattr(req, "lane", None) is not None:  # its ids and rows are in the worker's segment
                    self._bind_rows(req)
                self.tables.handle(identity, req)
            elif isinstance(req, wire.LaneProbeRequest):
                self._reply(identity, self.lanes.probe(req))
            elif isinstance(req, wire.LaneOpenRequest):
                self._reply(identity, self.lanes.open(req))
            elif isinstance(req, wire.LaneCloseRequest):
                self._reply(identity, self.lanes.close_lane(req))
            elif isinstance(req, wire.LocalOpenRequest):
                self._reply(identity, self._local_open(identity, req))
            elif isinstance(req, wire.CheckpointRequest):
                self._reply(identity, wire.encode_saved(req.id, str(self.checkpoint())))
            else:
                self._reply(identity, wire.encode_stats(req.id, self.stats()))
        except RequestRefused as exc:  # an operator's refused checkpoint, a lane not offered: no error of the traffic
            self._error(identity, req.id, exc.code, str(exc),
                        counted=not isinstance(req, (wire.CheckpointRequest, wire.LaneOpenRequest,
                                                     wire.LocalOpenRequest)))
        except ConfigError as exc:
            self._error(identity, req.id, "config", str(exc))
        except checkpoint.CheckpointError as exc:
            self._error(identity, req.id, "checkpoint", str(exc), counted=False)
        except Exception as exc:  # a bug must not take the shard down; say what happened
            log.exception("internal error handling %s", req.op)
            self._error(identity, req.id, "internal", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ ops
    def _local_open(self, identity: bytes, req: Any) -> list[Any]:
        """The ``local`` reply: a local connection for a worker that read this shard's beacon (so shares this
        host, and its kernel and network namespace reach the listener's abstract name).

        Raises
        ------
        RequestRefused
            ``local_off``: this shard serves no shared memory, or the token is not its beacon's, or the platform
            has no abstract sockets.
        """
        if not self.lanes.proves(req.token):
            raise RequestRefused("local_off", "local connections are for workers of this host (the beacon's "
                                              "token), with shared memory on")
        try:
            name, secret = self._chan.grant_local(identity)
        except OSError as exc:
            raise RequestRefused("local_off", f"no local connections here: {exc}") from None
        return wire.encode_local(req.id, name, secret)

    def _bind_rows(self, req: Any) -> None:
        """Bind a ``push_rows`` or ``pull_rows`` that came over a shared-memory lane to its segment (every area
        checked first: a refusal changes nothing, and the worker sends it again over the socket)."""
        shape = None
        if isinstance(req, wire.PullRowsRequest):
            table = self.tables.tables.get(req.table)
            shape = (table.spec.dim, table.spec.dtype) if table is not None else None
        nbytes = self.lanes.bind_rows(req, shape)
        if isinstance(req, wire.PushRowsRequest):
            self.counters.shm_bytes_in += nbytes
        else:
            out = req.out.nbytes if req.out is not None else 0
            self.counters.shm_bytes_in += nbytes - out
            self.counters.shm_bytes_out += out

    def _init(self, identity: bytes, req: wire.InitRequest) -> None:
        if req.check:  # would an init of these parts be taken? The same shape checks, nothing made
            for meta in req.tensors:
                entry = self.store.get(meta.key)
                if entry is not None:
                    admission.check_shape(entry, meta)
            self._reply(identity, wire.encode_ack(req.id, [0] * len(req.tensors), False))
            return
        opt = optim.from_wire(req.optimizer)
        for i, meta in enumerate(req.tensors):
            entry = self.store.get(meta.key)
            if entry is not None:
                admission.check_shape(entry, meta)
            elif self.config.nonfinite == "reject" and not kernels.all_finite(req.array(i)):
                raise RequestRefused("nonfinite", f"initial value of {meta.name!r} part {meta.part} has NaN or Inf")
        conflicts = []
        entries = []
        for i, meta in enumerate(req.tensors):
            entry = self.store.get(meta.key)
            if entry is None:  # the first initialization of a key wins
                entry = self.store.create(meta.key, req.array(i), opt)
            elif entry.optimizer != opt:
                conflicts.append(i)
            entries.append(entry)
        if self._replication is not None:  # a new key is held R + 1 times before any worker learns of it
            self._replication.commit([m.key for m in req.tensors])
        self.counters.inits += 1
        members = self.store.members
        job = wire.JobInfo(self.config.mode, self.config.num_workers if members is None else len(members), conflicts,
                           self._backup_of_job() if self.store.rounds else 0, self._replication is not None)
        self._send_params(identity, req.id, req.keys(), entries, job)

    def _at_once(self, identity: bytes, req: wire.PushRequest) -> bool:
        """A push (or push_pull) that is applied on arrival and asks for nothing unusual, taken in fewer steps than
        :meth:`_push` takes: the same checks, then the same changes and the same answer.

        That is a push of a job whose pushes are steps (async, or sync with W = 1), over the socket, at full
        precision, by a member, not a replay, while no worker finished early and no push waits. Anything else,
        and any check that fails, returns False having changed nothing: :meth:`_push` takes the message then
        (and says what is wrong with it).
        """
        store = self.store
        if (req.lane is not None or self._deferred or store.finished or self.config.mode == "ssp" or store.rounds
                or self._replication is not None or (store.members is not None and req.worker not in store.members)
                or store.is_duplicate(req.worker, req.session, req.seq)):
            return False
        held, reject = store.entries, self.config.nonfinite == "reject"
        entries, grads = [], []
        for meta, buf in zip(req.tensors, req.buffers):  # (the decoder matched every frame to its tensor)
            entry = held.get(meta.key)
            if entry is None or meta.encoding is not None:
                return False
            param = entry.param
            if (param.dtype is not meta.dtype and param.dtype != meta.dtype) or param.size != meta.count:
                return False
            grad = np.frombuffer(buf, meta.dtype)
            if reject and not kernels.all_finite(grad):
                return False
            entries.append(entry)
            grads.append(grad)
        # Every check passed: what follows cannot fail halfway (as Store.apply_push without rounds).
        for entry, grad in zip(entries, grads):
            entry.apply(grad, 1.0)
        store.record(req.worker, req.session, req.seq)
        counters = self.counters
        counters.pushes += 1
        counters.rounds += len(entries)
        keys = req.keys()
        if req.pull:
            counters.pulls += 1  # the pull half of a push_pull is a pull too
            self.replies.params(identity, req.id, keys, entries, False)
        else:
            self._reply(identity, self._timed_ack(req.id, [e.version for e in entries], False))
        if self._pulls or self._stale_pulls:
            for key in keys:
                self._wake(key)
        if entries:
            self._after_rounds()
        return True

    def _push(self, identity: bytes, req: wire.PushRequest) -> None:
        self.replies.forget_joined()  # (what it closes is answered anew; a push taken at once closes no round)
        # A push older than the replay window cannot be told applied or not: refused, neither applied nor acked.
        self.store.check_window(req.worker, req.session, req.seq)
        # Over a lane: the gradients are read where the worker wrote them.
        lane = self.lanes.push_lane(req) if req.lane is not None else None
        entries = admission.validate_push(self.store, req, self.config.nonfinite)
        if self.store.realigning and req.base is not None and self.store.rounds \
                and not self.store.is_duplicate(req.worker, req.session, req.seq):
            # (A base beyond a key's version: this shard was restored behind what its workers saw.)
            for i in realign.jump(self.store, entries, req.base):
                self._wake(req.tensors[i].key)  # a round of a lost version: its pushes are answered
        late = self._late(req, entries)  # (keys whose round closed without this push: dropped)
        # (A push too late for every key joins no round: it needs no finished worker's push.)
        if self.store.finished and not (late is not None and all(late)) \
                and not self.store.is_duplicate(req.worker, req.session, req.seq):
            self._refuse_if_finished(req.worker, entries)
        if lane is not None:
            self.counters.shm_bytes_in += sum(m.nbytes for m in req.tensors)
        if self._deferred.get(req.worker) or not self.store.can_join(req.worker, entries, late):
            # This worker is a round ahead on some key: hold the whole (validated) message until it can join.
            self._deferred.setdefault(req.worker, deque()).append((identity, req, entries, lane, self._taken))
            return
        self._accept(identity, req, entries, lane)

    def _accept(self, identity: bytes, req: wire.PushRequest, entries: list[Entry], lane: Optional[ShardLane]) -> None:
        keys = req.keys()
        if self.store.is_duplicate(req.worker, req.session, req.seq):
            self.counters.duplicates += 1
            self._answer_push(identity, req, keys, self.store.targets(req.worker, entries), True, lane, entries)
            return
        late = self._late(req, entries)
        if late is not None and not self.store.drops_late:
            realign.dropped(req.worker, entries, late)
        if late is not None and all(late):  # too late for every key: dropped, answered as a pull would be
            self._drop(identity, req, keys, entries, lane)
            return
        if self.store.rounds:
            self.lateness.seen(req.worker, req.buffers, lane is not None)
            self.lateness.joined(req.worker, entries[0] if late is None else
                                 next(e for e, x in zip(entries, late) if not x))
        if late is not None:
            self.counters.dropped_pushes += 1
        grads = [req.array(i) for i in range(len(entries))]
        # A push_pull's lane areas stay untouched until its answer, which comes after its round: held, not copied.
        hold = lane is not None and req.pull
        skip = replication.replayed(self._included, req.worker, req.session, req.seq, keys) if self._included else None
        if skip:  # a range taken over: this push sent again is in part of its keys' copied state already
            targets, completed = replication.apply_except(self.store, req.worker, entries, grads, skip, hold, late)
        else:
            targets, completed = self.store.apply_push(req.worker, entries, grads, hold=hold, late=late)
        if self.config.mode == "ssp":
            self.store.tick_clocks(req.worker, entries)
        self.store.record(req.worker, req.session, req.seq)
        self.counters.pushes += 1
        self.counters.rounds += len(completed)
        if self._replication is not None:  # the rounds this push completed are held R + 1 times before answers
            self._replication.joined(req.worker, req.seq, keys, completed, late)
            if completed and self.store.rounds:  # sync: a round's copy at once, before its answers (kept back
                # until the replicas hold it while the shard serves on: the next piece's round is copied meanwhile)
                self._replication.commit([keys[i] for i in completed], pipelined=True)
            elif completed:  # async, ssp: copied with the batch's other pushes at its end, answers kept back till then
                self._replication.defer([keys[i] for i in completed])
        self._answer_push(identity, req, keys, targets, False, lane, entries)
        if self._pulls or self._stale_pulls:  # (nothing waits: the usual case with W = 1, or async)
            for i in completed:
                self._wake(keys[i])
        if completed and self._deferred:
            self._drain_deferred()
        if completed:
            if self.store.auto is not None:
                self._pick_backup()
            self._after_rounds()

    def _late(self, req: wire.PushRequest, entries: list[Entry]) -> Optional[list[bool]]:
        """Per key, whether ``req`` is too late for it: with backup workers, its round closed without it
        (:meth:`Store.late`); in any sync job, it belongs to a round a restore lost (:func:`realign.behind`). None
        when it is for none."""
        if not self.store.rounds:
            return None
        if not self.store.drops_late:
            return realign.behind(req.worker, entries, req.base) \
                if self.store.realigning and req.base is not None else None
        if req.base is None:
            raise RequestRefused("config", f"this shard runs with --backup-workers {self._backup_of_job()}, "
                                 "whose pushes must say which version their gradients were computed from; worker "
                                 f"{req.worker}'s does not (an older psrt): run the same psrt on every worker")
        return self.store.late(req.worker, entries, req.base)

    def _backup_of_job(self) -> int:
        """The b a shard's answer to init gives: its fixed b, or with auto the most it may pick (W - 1)."""
        store = self.store
        return max(1, store.num_workers - 1) if store.auto is not None else store.backup_workers

    def _pick_backup(self) -> None:
        """``--backup-workers auto``: let the measured lateness pick b (every quarter second at most)."""
        store = self.store
        assert store.auto is not None
        members = sorted(store.members) if store.members is not None else None
        b = store.auto.choose(self.lateness, store.backup_workers, members)
        if b != store.backup_workers:
            log.info("backup workers: %d (picked from the workers' lateness)", b)
            store.backup_workers = b

    def _drop(self, identity: bytes, req: wire.PushRequest, keys: list[Key], entries: list[Entry],
              lane: Optional[ShardLane]) -> None:
        """A push too late for its rounds: never applied, but counted, and remembered as taken (its sequence number:
        sent again, it is not taken twice). A push_pull is answered with the newest parameters (at once, unless
        this worker's earlier push is in a round still open), from which the worker joins the next round. In a
        replicated job its sequence number is held by the replicas before the drop is answered."""
        self.store.record(req.worker, req.session, req.seq)
        self.counters.pushes += 1
        self.counters.dropped_pushes += 1
        self.lateness.seen(req.worker, req.buffers, lane is not None)
        self.lateness.missed(req.worker, entries[0], req.base)
        if self._replication is not None:
            self._replication.settle()
        self._answer_push(identity, req, keys, self.store.targets(req.worker, entries), False, lane, entries)

    def _timed_ack(self, rid: int, versions: list[int], duplicate: bool) -> list[Any]:
        """A push's ``ack``, saying when its message was taken in and how long until now (:class:`wire.AckReply`)."""
        return wire.encode_ack(rid, versions, duplicate, self._taken, time.monotonic_ns() - self._taken)

    def _answer_push(self, identity: bytes, req: wire.PushRequest, keys: list[Key], targets: list[int],
                     duplicate: bool, lane: Optional[ShardLane], entries: list[Entry]) -> None:
        if not req.pull:
            if self._replication is None:
                self._reply(identity, self._timed_ack(req.id, targets, duplicate))
            # A replicated job's ack says nothing of when its push came: the ack of a sync push waits for its
            # round, which waits for the other workers' pushes, and a worker that paced its pushes by such acks
            # could hold back the very push another worker's held ack waits for (psrt.worker.overlap.Pace).
            elif not self._replication.hold_ack(identity, req.id, keys, targets, duplicate):
                self._reply(identity, wire.encode_ack(req.id, targets, duplicate))
            return
        self.counters.pulls += 1  # the pull half of a push_pull is a pull too
        # A worker pushing 16-bit gradients gets the parameters of its push_pull back in the same form.
        codec = None
        for m in req.tensors:
            if m.encoding is not None and m.encoding in compression.WIRE_NAMES:
                codec = m.encoding
                break
        if self.config.mode == "ssp":
            self._wait_for_clock(identity, req.id, keys, req.worker, codec, lane)
            return
        for entry, target in zip(entries, targets):
            if entry.version < target:  # its round is still open: wait for it
                self._wait_for(identity, req.id, dict(zip(keys, targets)), keys, codec, lane)
                return
        self._send_params(identity, req.id, keys, entries, codec=codec, lane=lane)  # applied (async, or W = 1)

    def _drain_deferred(self) -> None:
        """Admit queued early pushes whose keys have moved on to a round they can join."""
        if self._draining:
            return  # the outer call's loop will see what this one would have
        self._draining = True
        try:
            progress = True
            while progress:
                progress = False
                for worker in list(self._deferred):
                    queue = self._deferred[worker]
                    while queue:
                        # Validated on arrival; keys are never removed or reshaped, so that still holds.
                        identity, req, entries, lane, taken = queue[0]
                        if not self.store.can_join(worker, entries):
                            break
                        queue.popleft()
                        now, self._taken = self._taken, taken  # (its ack says when it came)
                        try:
                            self._accept(identity, req, entries, lane)
                        finally:
                            self._taken = now
                        progress = True
                    if not queue:
                        del self._deferred[worker]
        finally:
            self._draining = False

    def _pull(self, identity: bytes, req: wire.PullRequest) -> None:
        self.replies.forget_joined()
        want: dict[Key, int] = {}
        keys: list[Key] = []
        deferred = self._deferred.get(req.worker, ())
        queued = len(deferred)
        # A pull sent again to a restored sync shard: the keys whose asked version none of this worker's pushes
        # here (taken or queued) target, a round whose push from it the previous life took and lost.
        lost: Optional[list[tuple[Entry, int, Key]]] = \
            [] if req.again and self.store.realigning and self.store.rounds else None
        for pk in req.keys:
            entry = admission.entry_of(self.store, pk.key)
            least = 0 if req.again else pk.min_version  # (sent again after a restart: any version will do)
            if least > self.store.reachable(entry, queued):
                raise RequestRefused(
                    "version",
                    f"pull of {pk.name!r} part {pk.part} asks for version {pk.min_version} but the key is at "
                    f"{entry.version}; no push of this worker will produce it",
                )
            keys.append(pk.key)
            # This worker's pushes reached the shard before this pull (one socket keeps their order), even when
            # their acks have not reached the worker yet: in sync mode the pull waits for the rounds they joined.
            mine = 0
            if self.store.rounds:
                mine = self.store.targets(req.worker, [entry])[0] + sum(1 for _, r, _, _, _ in deferred
                                                                         if pk.key in r.keys())
            want[pk.key] = max(want.get(pk.key, 0), least, mine)
            if self.store.finished and want[pk.key] > entry.version:
                self._refuse_if_finished(None, [entry])
            if lost is not None and pk.min_version > mine:
                lost.append((entry, pk.min_version, pk.key))
        lane = self.lanes.pull_lane(req, [self.store.entries[k].param for k in keys])
        if lost:
            # Checked (nothing refuses the pull now): the keys move up (realign.pulled_again), the pushes of a round
            # that drops are answered, and the pull waits on them for nothing (``want``: the versions before).
            for i in realign.pulled_again(self.store, [e for e, _, _ in lost], [v for _, v, _ in lost]):
                self._wake(lost[i][2])
        self.counters.pulls += 1
        if self.config.mode == "ssp":
            self._wait_for_clock(identity, req.id, keys, req.worker, lane=lane)
        else:
            self._wait_for(identity, req.id, want, keys, lane=lane)

    # ------------------------------------------------------------------ waiting pulls
    def _wait_for_clock(self, identity: bytes, request_id: int, keys: list[Key], worker: int,
                        codec: Optional[str] = None, lane: Optional[ShardLane] = None) -> None:
        """ssp: answer once, for each key, every worker has pushed it at least c - staleness times, where c is
        how many times ``worker`` has (clocks are per key: any pattern of pushes keeps the bound)."""
        entries, s = self.store.entries, self.config.staleness
        least = {k: entries[k].clocks.get(worker, 0) - s for k in keys}
        if self._stale_pulls.add(Waiter(identity, request_id, keys, least, codec=codec, lane=lane)):
            self._send_params(identity, request_id, keys, [self.store.entries[k] for k in keys], codec=codec,
                              lane=lane)

    def _wait_for(self, identity: bytes, request_id: int, want: dict[Key, int], keys: list[Key],
                  codec: Optional[str] = None, lane: Optional[ShardLane] = None) -> None:
        entries = self.store.entries  # keys already at their versions (always with W = 1, or async): no Waiter
        if any(entries[k].version < v for k, v in want.items()) and not self._pulls.add(
                Waiter(identity, request_id, keys, want, codec=codec, lane=lane)):
            return  # queued: _wake answers it
        self._send_params(identity, request_id, keys, [entries[k] for k in keys], codec=codec, lane=lane)

    def _wake(self, key: Key) -> None:
        for queue in (self._pulls, self._stale_pulls):
            for w in queue.wake(key) if queue else ():  # (nothing waits: the usual case with W = 1, or async)
                self._send_params(w.identity, w.request_id, w.keys, [self.store.entries[k] for k in w.keys],
                                  codec=w.codec, lane=w.lane)

    # ------------------------------------------------------------------ replies
    def _send_params(self, identity: bytes, request_id: int, keys: list[Key], entries: list[Entry],
                     job: Optional[wire.JobInfo] = None, codec: Optional[str] = None,
                     lane: Optional[ShardLane] = None) -> None:
        self.replies.params(identity, request_id, keys, entries, self.store.rounds, job, codec, lane)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """The shard's counters and state sizes, as a flat mapping of numbers and strings."""
        return report(self.counters, self.store, endpoint=self.endpoint, mode=self.config.mode,
                      num_workers=self.config.num_workers, backup_workers=self.store.backup_workers,
                      backup_auto=int(self.store.auto is not None),
                      **self.lateness.stats(), queued_pulls=len(self._pulls) + len(self._stale_pulls),
                      deferred_pushes=sum(len(q) for q in self._deferred.values()), lanes=self.lanes.count,
                      local_peers=self._chan.local_peers, local_messages=self._chan.local_messages,
                      **self.tables.stats(), **(self._replication.stats() if self._replication is not None else {}))


def _finished_message(worker: int) -> str:
    return (f"worker {worker} finished (said done) while this sync round still needs its push: in a sync job "
            "every worker pushes every round, so it can never complete; let every worker run the same number of "
            "steps, or start the job with --elastic so that workers may finish early")
