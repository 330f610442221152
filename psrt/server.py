"""The shard server: one process owning a disjoint part of the parameters, serving workers on a ROUTER socket.

The loop is single-threaded: it receives a message, validates it completely, and only then changes state, so a
malformed or inconsistent request gets an error reply and leaves every parameter as it was. The optimizer
kernels release the GIL and ZeroMQ moves bytes on its own I/O thread, so transfers overlap the arithmetic.

Modes (:mod:`psrt.store` holds the round rules): **sync** sums a round's W pushes per key and steps once with
``scale = 1/W``; a push a round ahead waits, queued, and a pull waits for the round its worker's pushes joined.
**async** applies every push on arrival. **ssp** applies on arrival too, but answers a pull at clock c (the
worker's pushes so far) once every worker's pushes to the pulled keys reach c - ``staleness``.

Every push carries ``(worker, session, seq)``; a push already applied is acknowledged again but not re-applied.
Checkpoints (``config.checkpoint_dir``, :mod:`psrt.checkpoint`): the whole state with the sequence numbers, every
``checkpoint_every`` rounds, every ``checkpoint_secs`` seconds and on request; ``config.restore`` resumes from one.
Embedding tables (``init_table``, ``push_rows``, ``pull_rows``) are served by :mod:`psrt.tables`, per table.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from psrt import admission, checkpoint, compression, kernels, optim, security, tables, transport, wire
from psrt.config import ServerConfig
from psrt.counters import Counters, report
from psrt.errors import ConfigError, ProtocolError, RequestRefused
from psrt.lanes import ShardLane, ShardLanes
from psrt.pulls import PullQueue, Waiter
from psrt.store import Entry, Key, Store

if TYPE_CHECKING:
    from psrt.link import SchedulerLink

__all__ = ["Server", "RequestError"]

log = logging.getLogger("psrt.server")

#: Messages handled per wake-up before the loop checks for a stop request again.
_BATCH = 256

#: A well-formed request the shard must refuse; ``code`` goes into the error reply.
RequestError = RequestRefused


class Server:
    """A shard server bound to ``config.bind``.

    Parameters
    ----------
    config : ServerConfig
        Endpoint, W, mode, limits and keys (with keys, only the job's clients get a message through).

    Raises
    ------
    BindError
        When the endpoint cannot be bound.
    ConfigError
        When ``config.keys`` names a missing or unusable key directory, or ``config.checkpoint_dir`` is unwritable.

    Examples
    --------
    >>> server = Server(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=2))  # doctest: +SKIP
    >>> server.serve()  # until server.stop() or SIGTERM             # doctest: +SKIP
    """

    def __init__(self, config: ServerConfig) -> None:
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
        self.store = Store(config.mode, config.num_workers)
        self.counters = Counters()
        self._stop = threading.Event()
        self._pulls = PullQueue(lambda key: self.store.entries[key].version)
        # ssp: pulls waiting for the slowest worker's clock (per key) to come within the staleness bound.
        self._stale_pulls = PullQueue(lambda key: self.store.slowest_clock(self.store.entries[key]))
        self._deferred: dict[int, deque[tuple[bytes, wire.PushRequest, list[Entry], Optional[ShardLane]]]] = {}
        self._draining = False
        self._ckpt = checkpoint.Checkpointer(config, self.endpoint)
        self.restored_from: Optional[Path] = None
        self.tables = tables.TableService(self.store, self._reply, self._error, config.nonfinite)
        self.tables.staleness = config.staleness
        if config.restore:
            self._restore()

    # ------------------------------------------------------------------ loop
    @property
    def context(self):
        """The server's ZeroMQ context (its scheduler link shares it)."""
        return self._ctx

    # ------------------------------------------------------------------ checkpoints
    def _restore(self) -> None:
        found = self._ckpt.restore()
        if found is None:
            return
        store, path = found.store, found.path
        self.tables.store = store
        self.tables.restore(found.tables, found.table_logs)
        if (store.mode, store.num_workers) != (self.config.mode, self.config.num_workers):
            log.warning("checkpoint %s was taken in %s mode with W=%d; resuming so (this shard was started with "
                        "%s, W=%d)", path, store.mode, store.num_workers, self.config.mode, self.config.num_workers)
            self.config = dataclasses.replace(self.config, mode=store.mode, num_workers=store.num_workers)
        self.store, self.restored_from = store, path
        if store.rounds:
            for entry in store.entries.values():
                self.lanes.place(entry)

    def checkpoint(self) -> Path:
        """Write a checkpoint now; returns its path.

        Raises
        ------
        RequestError
            When the shard has no checkpoint directory.
        CheckpointError
            When the file cannot be written.
        """
        if not self._ckpt.enabled:
            raise RequestError("no_checkpoint_dir", "this shard was started without --checkpoint-dir")
        path = self._ckpt.save(self.store, self.counters.pushes, self.tables.state())
        self.counters.checkpoints += 1
        return path

    def _after_rounds(self) -> None:
        if self._ckpt.due_after_rounds(self.store, self.counters.pushes):
            self._checkpoint_quietly()

    def _checkpoint_quietly(self) -> None:
        try:
            self.checkpoint()
        except checkpoint.CheckpointError as exc:
            log.error("%s; training goes on", exc)

    def set_job(self, num_workers: int, mode: str, staleness: int = 0) -> None:
        """Adopt W, the mode and the staleness bound the scheduler's table gives (before serving)."""
        self.config = dataclasses.replace(self.config, num_workers=num_workers, mode=mode, staleness=staleness)
        self.store.set_job(mode, num_workers)
        self.tables.staleness = staleness

    def serve(self, control: Optional[SchedulerLink] = None) -> None:
        """Serve requests until :meth:`stop` is called or, with ``control``, the scheduler ends the job."""
        poll = self.config.poll_interval
        while not self._stop.is_set():
            if self._chan.poll(poll):
                for _ in range(_BATCH):
                    msg = self._chan.recv()
                    if msg is None:
                        break
                    self.handle(*msg)
                    if not self._chan.readable():  # reading event flags: far cheaper than a failing receive
                        break
            if self._ckpt.due_by_time():
                self._checkpoint_quietly()
            if control is not None and control.tick(self.set_members):
                log.info("the scheduler ended the job")
                return

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

    def stop(self) -> None:
        """Ask :meth:`serve` to return after the message in hand."""
        self._stop.set()

    def close(self) -> None:
        """Close the socket and the ZeroMQ context."""
        self._chan.close()
        self._ctx.term()
        self.lanes.close()

    def handle(self, identity: bytes, frames: list[Any]) -> None:
        """Handle one message from ``identity``; never raises."""
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
                self._push(identity, req)
            elif isinstance(req, wire.PullRequest):
                self._pull(identity, req)
            elif isinstance(req, wire.InitRequest):
                self._init(identity, req)
            elif isinstance(req, tables.REQUESTS):
                self.tables.handle(identity, req)
            elif isinstance(req, wire.LaneProbeRequest):
                self._reply(identity, self.lanes.probe(req))
            elif isinstance(req, wire.LaneOpenRequest):
                self._reply(identity, self.lanes.open(req))
            elif isinstance(req, wire.LaneCloseRequest):
                self._reply(identity, self.lanes.close_lane(req))
            elif isinstance(req, wire.CheckpointRequest):
                self._reply(identity, wire.encode_saved(req.id, str(self.checkpoint())))
            else:
                self._reply(identity, wire.encode_stats(req.id, self.stats()))
        except RequestError as exc:  # an operator's refused checkpoint request is no error of the shard's traffic
            self._error(identity, req.id, exc.code, str(exc), counted=not isinstance(req, wire.CheckpointRequest))
        except ConfigError as exc:
            self._error(identity, req.id, "config", str(exc))
        except checkpoint.CheckpointError as exc:
            self._error(identity, req.id, "checkpoint", str(exc), counted=False)
        except Exception as exc:  # a bug must not take the shard down; say what happened
            log.exception("internal error handling %s", req.op)
            self._error(identity, req.id, "internal", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ ops
    def _init(self, identity: bytes, req: wire.InitRequest) -> None:
        opt = optim.from_wire(req.optimizer)
        for i, meta in enumerate(req.tensors):
            entry = self.store.get(meta.key)
            if entry is not None:
                admission.check_shape(entry, meta)
            elif self.config.nonfinite == "reject" and not kernels.all_finite(req.array(i)):
                raise RequestError("nonfinite", f"initial value of {meta.name!r} part {meta.part} has NaN or Inf")
        conflicts = []
        entries = []
        for i, meta in enumerate(req.tensors):
            entry = self.store.get(meta.key)
            if entry is None:  # the first initialization of a key wins
                entry = self.store.create(meta.key, req.array(i), opt)
                if self.store.rounds:
                    self.lanes.place(entry)  # workers of this host copy each round's result themselves
            elif entry.optimizer != opt:
                conflicts.append(i)
            entries.append(entry)
        self.counters.inits += 1
        members = self.store.members
        job = wire.JobInfo(self.config.mode, self.config.num_workers if members is None else len(members), conflicts)
        self._send_params(identity, req.id, req.keys(), entries, job)

    def _push(self, identity: bytes, req: wire.PushRequest) -> None:
        lane = self.lanes.push_lane(req)  # over a lane: the gradients are read where the worker wrote them
        entries = admission.validate_push(self.store, req, self.config.nonfinite)
        if lane is not None:
            self.counters.shm_bytes_in += sum(m.nbytes for m in req.tensors)
        if self._deferred.get(req.worker) or not self.store.can_join(req.worker, entries):
            # This worker is a round ahead on some key: hold the whole (validated) message until it can join.
            self._deferred.setdefault(req.worker, deque()).append((identity, req, entries, lane))
            return
        self._accept(identity, req, entries, lane)

    def _accept(self, identity: bytes, req: wire.PushRequest, entries: list[Entry], lane: Optional[ShardLane]) -> None:
        keys = req.keys()
        if self.store.is_duplicate(req.worker, req.session, req.seq):
            self.counters.duplicates += 1
            self._answer_push(identity, req, keys, self.store.targets(req.worker, entries), True, lane)
            return
        grads = [req.array(i) for i in range(len(entries))]
        # A push_pull's lane areas stay untouched until its answer, which comes after its round: held, not copied.
        targets, completed = self.store.admit(req.worker, entries, grads, hold=lane is not None and req.pull)
        if self.config.mode == "ssp":
            self.store.note_clock(req.worker, entries, req.clock)
        self.store.record(req.worker, req.session, req.seq)
        self.counters.pushes += 1
        self.counters.rounds += len(completed)
        self._answer_push(identity, req, keys, targets, False, lane)
        for i in completed:
            self._wake(keys[i])
        if completed and self._deferred:
            self._drain_deferred()
        if completed:
            self._after_rounds()

    def _answer_push(self, identity: bytes, req: wire.PushRequest, keys: list[Key], targets: list[int],
                     duplicate: bool, lane: Optional[ShardLane]) -> None:
        if not req.pull:
            self._reply(identity, wire.encode_ack(req.id, targets, duplicate))
            return
        self.counters.pulls += 1  # the pull half of a push_pull is a pull too
        # A worker pushing 16-bit gradients gets the parameters of its push_pull back in the same form.
        codec = next((m.encoding for m in req.tensors if m.encoding in compression.WIRE_NAMES), None)
        if self.config.mode == "ssp":
            self._wait_for_clock(identity, req.id, keys, req.clock, codec, lane)
        else:
            self._wait_for(identity, req.id, dict(zip(keys, targets)), keys, codec, lane)

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
                        identity, req, entries, lane = queue[0]
                        if not self.store.can_join(worker, entries):
                            break
                        queue.popleft()
                        self._accept(identity, req, entries, lane)
                        progress = True
                    if not queue:
                        del self._deferred[worker]
        finally:
            self._draining = False

    def _pull(self, identity: bytes, req: wire.PullRequest) -> None:
        want: dict[Key, int] = {}
        keys: list[Key] = []
        deferred = self._deferred.get(req.worker, ())
        queued = len(deferred)
        for pk in req.keys:
            entry = admission.entry_of(self.store, pk.key)
            if pk.min_version > self.store.reachable(entry, queued):
                raise RequestError(
                    "version",
                    f"pull of {pk.name!r} part {pk.part} asks for version {pk.min_version} but the key is at "
                    f"{entry.version}; no push of this worker will produce it",
                )
            keys.append(pk.key)
            # This worker's pushes reached the shard before this pull (one socket keeps their order), even when
            # their acks have not reached the worker yet: in sync mode the pull waits for the rounds they joined.
            mine = 0
            if self.store.rounds:
                mine = self.store.targets(req.worker, [entry])[0] + sum(1 for _, r, _, _ in deferred
                                                                         if pk.key in r.keys())
            want[pk.key] = max(want.get(pk.key, 0), pk.min_version, mine)
        lane = self.lanes.pull_lane(req, [self.store.entries[k].param for k in keys])
        self.counters.pulls += 1
        if self.config.mode == "ssp":
            self._wait_for_clock(identity, req.id, keys, req.clock, lane=lane)
        else:
            self._wait_for(identity, req.id, want, keys, lane=lane)

    # ------------------------------------------------------------------ waiting pulls
    def _wait_for_clock(self, identity: bytes, request_id: int, keys: list[Key], clock: int,
                        codec: Optional[str] = None, lane: Optional[ShardLane] = None) -> None:
        """ssp: answer once every worker's pushes to ``keys`` reach ``clock - staleness``."""
        least = clock - self.config.staleness
        if self._stale_pulls.add(Waiter(identity, request_id, keys, dict.fromkeys(keys, least), codec=codec,
                                        lane=lane)):
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
        tensors = [wire.tensor_entry(k[0], k[1], e.param.dtype, (e.param.size,)) for k, e in zip(keys, entries)]
        if lane is not None:  # the parameters go through shared memory, the header over the socket
            segment, offsets = lane
            # Rounds (sync, W > 1): a round's result stays put until every worker pushes again, so each worker
            # copies it from the shard's own memory; otherwise (or for a key not there) it is written into the lane.
            places = self.lanes.places(entries) if self.store.rounds else [[] for _ in entries]
            written = [(o, e.param) for o, e, p in zip(offsets, entries, places) if not p]
            self.lanes.write(segment, [o for o, _ in written], [a for _, a in written])
            self.counters.shm_bytes_out += sum(e.param.nbytes for e in entries)
            self._reply(identity, wire.encode_params(request_id, tensors, [e.version for e in entries], [], job,
                                                     lane=segment.generation, places=places))
            return
        payload: list[Any] = [e.param for e in entries]
        if codec is not None:
            for i, e in enumerate(entries):
                packed = e.packed_param(codec)  # None: float64, or out of fp16's range
                if packed is not None:
                    tensors[i][2], payload[i] = packed
        frames = wire.encode_params(request_id, tensors, [e.version for e in entries], payload, job)
        try:
            trackers = self._chan.send(identity, frames, track=True)
        except transport.SendDropped as exc:
            self.counters.dropped_replies += 1
            log.warning("reply to a worker dropped: %s", exc)
            return
        self.counters.bytes_out += sum(map(len, frames))
        # One tracker per frame (None where the frame was copied); the parameters' frames follow the header.
        # A 16-bit copy is the frame's own: only frames of the parameters themselves are tracked.
        for entry, frame, tracker in zip(entries, payload, trackers[1:]):
            if tracker is not None and frame is entry.param:
                entry.trackers.append(tracker)

    def _reply(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self._chan.send(identity, frames)
        except transport.SendDropped as exc:
            self.counters.dropped_replies += 1
            log.warning("reply to a worker dropped: %s", exc)
            return
        self.counters.bytes_out += len(frames[0])

    def _error(self, identity: bytes, request_id: int, code: str, message: str, counted: bool = True) -> None:
        self.counters.errors += counted
        log.info("error reply (%s): %s", code, message)
        self._reply(identity, wire.encode_error(request_id, code, message))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """The shard's counters and state sizes, as a flat mapping of numbers and strings."""
        return report(self.counters, self.store, endpoint=self.endpoint, mode=self.config.mode,
                      num_workers=self.config.num_workers, queued_pulls=len(self._pulls) + len(self._stale_pulls),
                      deferred_pushes=sum(len(q) for q in self._deferred.values()), lanes=self.lanes.count,
                      **self.tables.stats())
