"""Shared-memory lanes: tensor bytes between a worker and a shard on the same host go through a segment
(:mod:`psrt.shm`), and ZeroMQ carries only the headers (:mod:`psrt.wire.lanes` has the messages).

Setting one up, the first time a worker sends a shard enough bytes in one call (at least
:data:`psrt.transport.ZERO_COPY_BYTES`: below it a copy costs less than what a lane saves):

1. ``lane_probe``: the shard names its beacon, a 0600 file in /dev/shm holding a random token.
2. The worker reads the token from that file on its own host. A worker elsewhere finds no such file (or another
   one), whatever address it reached the shard at, and stays on sockets.
3. ``lane_open {token, size}``: the shard checks the token, creates a segment of ``size`` bytes for this worker
   and names it; the worker maps it and unlinks the file.

Then a push copies each gradient into the segment once and the shard's kernels read it there; a push_pull or
pull names where the parameters are to go, the shard writes them there, and the worker copies them into the
caller's arrays. The worker allocates the areas (:class:`Lane`, a bump allocator that starts over whenever
nothing is in flight, which in a training loop is once per step); a call that does not fit goes over sockets and
the next segment is sized for it. A shard keeps at most :data:`MAX_LANES` segments: past that, a new one takes
the place of the least recently used only if it has been idle for :data:`LANE_IDLE_S` (its worker is likely
gone); else the new worker is refused (``lane_full``) and stays on sockets. Evicting busy lanes instead would
make a thousand workers of one host take each other's lanes in turn, every request a refusal and a resend. A
request naming a segment the shard no longer has is refused with a ``lane_*`` code and the worker sends it
again over sockets, so losing a lane never loses a call. A refused ``lane_open`` is an answer, not a shard
error. ``PSRT_SHM=0`` (``ClientConfig.shm``,
``ServerConfig.shm``) turns lanes off on either side.

Embedding rows go the same way (:meth:`WorkerLanes.carry_rows`, :meth:`ShardLanes.bind_rows`): a ``push_rows``
puts its ids and rows in the segment, a ``pull_rows`` its ids, and the shard gathers the answer into the area
the request names.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from psrt import shm, wire
from psrt.errors import PsrtError, RequestRefused
from psrt.kernels import rows as rowkernels
from psrt.shm.arena import Arena, ArenaReader
from psrt.transport import ZERO_COPY_BYTES

if TYPE_CHECKING:
    from psrt.partition import Chunk

__all__ = ["MAX_LANES", "LANE_IDLE_S", "MAX_LANE_BYTES", "LANE_CODES", "Lane", "LaneUse", "WorkerLanes",
           "ShardLanes", "ShardLane", "call_bytes", "rows_bytes"]

log = logging.getLogger("psrt.lanes")

#: ``ask(encode)``: send a shard one request, its frames made by ``encode(request_id)``; returns the reply record.
Ask = Callable[[Callable[[int], list[Any]]], Any]

#: Segments one shard keeps at most.
MAX_LANES = 64
#: Seconds a shard's least recently used lane must have been idle for a new worker's lane to take its place.
LANE_IDLE_S = 30.0
#: The largest segment a shard creates.
MAX_LANE_BYTES = 1 << 36
#: Error codes a shard refuses a lane request with; the worker then sends the request again over sockets.
LANE_CODES = frozenset({"lane_stale", "lane_bounds"})


# ---------------------------------------------------------------------------------------------- worker side
class Lane:
    """A worker's view of one segment: areas handed out from the front, all given back at once when idle."""

    def __init__(self, segment: shm.Segment) -> None:
        self.segment = segment
        self.top = shm.HEADER_BYTES
        self.live = 0
        #: No more areas from this segment: a call on it was abandoned, and the shard may still write there.
        self.retired = False

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` (already aligned) fit after what is handed out."""
        return not self.retired and self.top + nbytes <= self.segment.size

    def take(self, nbytes: int) -> int:
        """Hand out an aligned area of ``nbytes``; the caller checked :meth:`fits` for the whole call."""
        offset = self.top
        self.top += shm.aligned(nbytes)
        return offset

    def give_back(self) -> None:
        """One request's areas are free; when none is in flight the whole segment is."""
        self.live -= 1
        if self.live == 0:
            self.top = shm.HEADER_BYTES


@dataclass
class LaneUse:
    """One request's areas in a lane: the gradients it sent (views) and where its parameters come back."""

    lane: Lane
    ref: wire.LaneRef
    inputs: list[np.ndarray]

    def output(self, i: int, dtype: np.dtype, count: int) -> np.ndarray:
        """The i-th output area as a flat array (what the shard wrote)."""
        return self.lane.segment.array(self.ref.outputs[i], dtype, count)


class WorkerLanes:
    """A client's lanes, one per shard: set up on first use, grown when a call does not fit.

    It sends nothing itself: setting a lane up asks the shard through the ``ask`` a call passes
    (:meth:`lane_for`), and the generations :meth:`release` returns are the ones to tell the shards of.

    Parameters
    ----------
    num_shards : int
        The shards' count.
    worker, session : int
        Who asks (the shard keeps one segment per worker session).
    enabled : bool
        False: every call goes over sockets.
    local : bool, optional
        Whether the beacons may be read for local connections (:meth:`token`) even where lanes are off (a
        client of compressed gradients); default ``enabled``.
    """

    def __init__(self, num_shards: int, worker: int, session: int, enabled: bool,
                 local: Optional[bool] = None) -> None:
        self._worker = worker
        self._session = session
        self._enabled = enabled
        self._local = enabled if local is None else local
        #: Per shard: None until tried, False where a lane is not possible, else the current Lane.
        self._lanes: list[Any] = [None] * num_shards
        self._token: list[Optional[str]] = [None] * num_shards
        self._arenas = [ArenaReader() for _ in range(num_shards)]  # the shards' shared parameters
        # The most bytes in flight at once that a lane had to send over sockets instead (the next segment's size),
        # and the bytes sent so since the lane was last idle.
        self._demand = [0] * num_shards
        self._spill = [0] * num_shards

    def lane_for(self, shard: int, nbytes: int, ask: Ask) -> Optional[Lane]:
        """The lane a call moving ``nbytes`` (areas, aligned) to ``shard`` uses, or None for sockets.

        ``ask(encode)`` sends ``shard`` one request and returns the reply record (raising on an error reply):
        how a lane is set up when one must be.
        """
        if not self._enabled or nbytes < ZERO_COPY_BYTES:  # a small call: a copy into a segment saves nothing
            return None
        lane = self._lanes[shard]
        if lane is False:
            return None
        if isinstance(lane, Lane):
            if not lane.live:
                self._spill[shard] = 0
                if self._demand[shard] > lane.segment.size - shm.HEADER_BYTES:  # idle: now make it big enough
                    return self._open(shard, self._demand[shard], ask)
            if lane.fits(nbytes):
                return lane
            if lane.live and not lane.retired:
                # Busy: this call goes over sockets, and the next segment holds everything in flight now.
                self._spill[shard] += nbytes
                self._demand[shard] = max(self._demand[shard], lane.top - shm.HEADER_BYTES + self._spill[shard])
                return None
        # A first segment holds two such calls (the next can be on its way while this one's answer comes in).
        return self._open(shard, max(2 * nbytes, self._demand[shard]), ask)

    def release(self) -> dict[int, int]:
        """Stop using lanes (the client closes); returns ``{shard: generation}`` of every open one, to tell each
        shard with ``lane_close`` so that it frees the segment now rather than when it needs the room."""
        generations = {s: lane.segment.generation for s, lane in enumerate(self._lanes) if isinstance(lane, Lane)}
        self._lanes = [False] * len(self._lanes)
        return generations

    def reset(self, shard: int) -> None:
        """Forget ``shard``'s lane (it restarted, or refused the lane): the next call sets one up again."""
        lane = self._lanes[shard]
        if isinstance(lane, Lane):
            lane.retired = True
            self._lanes[shard] = None
            self._token[shard] = None
        # A restarted shard numbers its segments afresh: nothing mapped from its predecessor may be reused.
        self._arenas[shard].forget()

    def token(self, shard: int, ask: Ask) -> Optional[str]:
        """The token of ``shard``'s beacon, read from its file on this host (asked for with ``lane_probe`` the
        first time): proof that the shard shares this host. None when shared memory is off here (``local``), or
        the shard is elsewhere or serves none.

        Raises
        ------
        PsrtError, OSError
            From ``ask`` (an older shard that does not know the op) or reading the file.
        """
        if not self._local:
            return None
        token = self._token[shard]
        return token if token is not None else self.take_beacon(shard, ask(wire.encode_lane_probe))

    @property
    def local(self) -> bool:
        """Whether the client may connect locally to shards of its host (``ClientConfig.shm``)."""
        return self._local

    def known_token(self, shard: int) -> Optional[str]:
        """The token of ``shard``'s beacon if it was read (:meth:`token`) and the shard has not restarted since."""
        return self._token[shard]

    def take_beacon(self, shard: int, beacon: Any) -> Optional[str]:
        """Read the token of the beacon ``shard`` named (its ``beacon`` reply to ``lane_probe``) and keep it; None
        when this host has no such file (the shard is elsewhere) or the shard serves no shared memory.

        Raises
        ------
        OSError
            When the file exists and cannot be read.
        """
        token = shm.Beacon.read(beacon.name) if beacon.name else None
        if token is None:
            log.debug("shard %d: no shared memory with this host (beacon %r)", shard, beacon.name)
            return None
        self._token[shard] = token
        self._arenas[shard].beacon = shm.SegmentName.parse(beacon.name)
        return token

    def _open(self, shard: int, nbytes: int, ask: Ask) -> Optional[Lane]:
        old = self._lanes[shard]
        if isinstance(old, Lane):
            old.retired = True
        self._lanes[shard] = False  # until this succeeds
        try:
            token = self.token(shard, ask)
            if token is None:
                return None
            size = shm.HEADER_BYTES + max(shm.aligned(nbytes), 1 << 20)
            reply = ask(lambda rid: wire.encode_lane_open(rid, self._worker, self._session, token, size))
            segment = shm.Segment.attach(reply.name, reply.generation, reply.size)
        except (PsrtError, OSError) as exc:
            # An older shard, another host, a full /dev/shm: sockets work everywhere.
            log.info("shard %d: no shared-memory lane (%s); using sockets", shard, exc)
            return None
        self._demand[shard] = self._spill[shard] = 0
        lane = self._lanes[shard] = Lane(segment)
        return lane

    @staticmethod
    def carry_rows(lane: Lane, ids: np.ndarray, grads: Optional[np.ndarray], out_bytes: int,
                   select: Optional[np.ndarray] = None) -> LaneUse:
        """Hand out one embedding request's areas: its ids and (``push_rows``) gradient rows, copied in (with
        ``select``, the entries ``ids[select]`` and rows ``grads[select]``, gathered straight into the segment),
        and (``pull_rows``, ``out_bytes`` > 0) the area its rows come back to; the caller checked
        :meth:`Lane.fits` for :func:`rows_bytes`. The areas (views, ids 1-D and rows 2-D) are the use's
        ``inputs``."""
        segment = lane.segment
        inputs: list[np.ndarray] = []
        offsets: list[int] = []
        for a in (ids,) if grads is None else (ids, grads):
            shape = ((len(a) if select is None else len(select)),) + a.shape[1:]
            count = math.prod(shape)  # (np.prod costs more than the copy of a small shard's ids)
            offset = lane.take(count * a.itemsize)
            view = segment.array(offset, a.dtype, count).reshape(shape)
            if select is None:
                np.copyto(view, a)
            elif a.ndim == 2:  # rows: the row kernel (np.take copies a short row with a call of its own)
                rowkernels.gather_rows(a, select, view, checked=True)  # (shard_order's order)
            else:  # (mode="clip": "raise" would gather into a buffer first; the indices are the caller's own)
                np.take(a, select, axis=0, out=view, mode="clip")
            inputs.append(view)
            offsets.append(offset)
        outputs = [lane.take(out_bytes)] if out_bytes else []
        lane.live += 1
        return LaneUse(lane, wire.LaneRef(segment.generation, offsets, outputs), inputs)

    def copy_shared(self, shard: int, place: list[int], dest: np.ndarray) -> bool:
        """Copy parameters from ``shard``'s shared memory into ``dest``: :meth:`psrt.shm.arena.ArenaReader.copy`."""
        return self._arenas[shard].copy(place, dest)

    @staticmethod
    def carry(lane: Lane, chunks: Sequence[Chunk], arrays: Optional[dict[str, np.ndarray]],
              outputs: bool) -> LaneUse:
        """Hand out one request's areas, copying the chunks of ``arrays`` (gradients; None for a pull) in."""
        inputs: list[np.ndarray] = []
        in_offsets: list[int] = []
        out_offsets: list[int] = []
        segment = lane.segment
        for c in chunks:
            if arrays is not None:
                offset = lane.take(c.nbytes)
                view = segment.array(offset, c.dtype, c.count)
                np.copyto(view, c.of(arrays[c.name]))
                inputs.append(view)
                in_offsets.append(offset)
            if outputs:
                out_offsets.append(lane.take(c.nbytes))
        lane.live += 1
        return LaneUse(lane, wire.LaneRef(segment.generation, in_offsets, out_offsets), inputs)


def rows_bytes(*nbytes: int) -> int:
    """The aligned bytes an embedding request's areas (ids, rows) take in a lane."""
    return sum(shm.aligned(n) for n in nbytes)


def call_bytes(messages: Sequence[Sequence[Chunk]], inputs: bool, outputs: bool) -> int:
    """The aligned bytes a call's messages to one shard take in a lane."""
    per = int(inputs) + int(outputs)
    return sum(per * shm.aligned(c.nbytes) for msg in messages for c in msg)


# ---------------------------------------------------------------------------------------------- shard side
#: A request's lane as the shard keeps it until it answers: the segment, and where the parameters go.
ShardLane = tuple[shm.Segment, list[int]]


class ShardLanes:
    """A shard's segments, by generation; the beacon that proves where it runs.

    Parameters
    ----------
    endpoint : str
        The endpoint the shard serves (names its files, so a restart finds a dead predecessor's leftovers).
    enabled : bool
        False (``PSRT_SHM=0``) or no /dev/shm: every probe is answered with an empty beacon name.
    """

    def __init__(self, endpoint: str, enabled: bool) -> None:
        self._tag = shm.endpoint_tag(endpoint)
        self._beacon: Optional[shm.Beacon] = None
        self._segments: OrderedDict[int, shm.Segment] = OrderedDict()  # least recently used first
        self._used: dict[int, float] = {}  # generation -> when a request last used it
        self._by_worker: dict[tuple[int, int], int] = {}
        self._generation = 0
        self._arena: Optional[Arena] = None  # sync mode: parameters workers of this host copy themselves
        if enabled and shm.available():
            removed = shm.remove_leftovers()
            if removed:
                log.info("removed %d shared-memory files of dead shards: %s", len(removed), ", ".join(removed))
            try:
                self._beacon = shm.Beacon(self._tag)
                self._arena = Arena(self._tag, self._new_generation)
            except OSError as exc:
                log.warning("no shared-memory lanes: cannot create a beacon in %s (%s)", shm.SHM_DIR, exc)

    def _new_generation(self) -> int:
        self._generation += 1
        return self._generation

    @property
    def count(self) -> int:
        """Segments held."""
        return len(self._segments)

    def probe(self, req: wire.LaneProbeRequest) -> list[Any]:
        """The ``beacon`` reply."""
        return wire.encode_beacon(req.id, self._beacon.name if self._beacon is not None else "")

    def proves(self, token: str) -> bool:
        """Whether ``token`` is this shard's beacon token (a worker that read it shares this host)."""
        return self._beacon is not None and secrets.compare_digest(token, self._beacon.token)

    def open(self, req: wire.LaneOpenRequest) -> list[Any]:
        """Create a segment for the worker that proved it reads the beacon; returns the ``lane`` reply.

        Raises
        ------
        RequestRefused
            ``lane_off`` (no lanes here), ``lane_token`` (the worker is on another host), ``lane_size`` or
            ``lane_space`` (/dev/shm cannot hold it), ``lane_full`` (:data:`MAX_LANES` lanes in use).
        """
        if self._beacon is None:
            raise RequestRefused("lane_off", "this shard serves no shared memory (PSRT_SHM=0 or no /dev/shm)")
        if not self.proves(req.token):
            raise RequestRefused("lane_token", "the token is not this shard's: the worker runs on another host")
        if not shm.HEADER_BYTES < req.size <= MAX_LANE_BYTES:
            raise RequestRefused("lane_size", f"a segment holds more than {shm.HEADER_BYTES} and at most "
                                              f"{MAX_LANE_BYTES} bytes, not {req.size}")
        now = time.monotonic()
        if (req.worker, req.session) not in self._by_worker and len(self._segments) >= MAX_LANES:
            oldest = next(iter(self._segments))
            if now - self._used.get(oldest, 0.0) < LANE_IDLE_S:
                raise RequestRefused("lane_full", f"this shard serves {MAX_LANES} shared-memory lanes in use: this "
                                                  "worker's tensors go over the socket")
        generation = self._new_generation()
        name = str(shm.SegmentName.own(self._tag, shm.SegmentName.LANE, generation))
        try:
            segment = shm.Segment.create(name, generation, req.size)
        except OSError as exc:
            raise RequestRefused("lane_space", f"cannot create a {req.size}-byte segment in {shm.SHM_DIR}: "
                                               f"{exc.strerror}") from None
        old = self._by_worker.pop((req.worker, req.session), None)
        if old is not None:
            self._drop(old)
        self._by_worker[(req.worker, req.session)] = generation
        self._segments[generation] = segment
        self._used[generation] = now
        while len(self._segments) > MAX_LANES:  # least recently used first (idle, as checked above)
            self._drop(next(iter(self._segments)))
        return wire.encode_lane(req.id, name, generation, req.size)

    @property
    def arena(self) -> Optional[Arena]:
        """The shard's shared parameters (:class:`psrt.shm.arena.Arena`), which its store keeps a sync job's keys
        in; None without lanes."""
        return self._arena

    def close_lane(self, req: wire.LaneCloseRequest) -> list[Any]:
        """A worker is done with a segment (its client closes): let it go now rather than at eviction."""
        for key, generation in list(self._by_worker.items()):
            if generation == req.generation:
                del self._by_worker[key]
        self._drop(req.generation)
        return wire.encode_closed(req.id)

    def _drop(self, generation: int) -> None:
        # Requests still holding views keep the mapping alive; only the name goes, and later requests are refused.
        segment = self._segments.pop(generation, None)
        self._used.pop(generation, None)
        if segment is not None:
            segment.unlink()

    def bind(self, req: Any) -> Optional[shm.Segment]:
        """Point a lane request's buffers into its segment after checking the generation and every input area.

        Returns the segment (None for a request without a lane). Output areas are checked by
        :meth:`check_outputs` once the shard knows the sizes.

        Raises
        ------
        RequestRefused
            ``lane_stale`` (no such segment, or no longer) or ``lane_bounds`` (an area outside it).
        """
        ref = req.lane
        if ref is None:
            return None
        segment = self._segment(ref)
        if isinstance(req, wire.PushRequest):
            buffers = []
            for meta, offset in zip(req.tensors, ref.inputs):
                if not segment.holds(offset, meta.nbytes):
                    raise RequestRefused("lane_bounds", _outside(meta, offset, segment))
                buffers.append(segment.array(offset, meta.dtype, meta.count))
            req.buffers = buffers
        return segment

    def _segment(self, ref: wire.LaneRef) -> shm.Segment:
        segment = self._segments.get(ref.generation)
        if segment is None:
            raise RequestRefused("lane_stale", f"no shared-memory segment of generation {ref.generation} here "
                                               "(a stale or unknown lane): send the tensors over the socket")
        self._segments.move_to_end(ref.generation)
        self._used[ref.generation] = time.monotonic()
        return segment

    def bind_rows(self, req: Any, row_shape: Optional[tuple[int, np.dtype]]) -> int:
        """Point an embedding request that came over a lane (``push_rows``, ``pull_rows``) into its segment, after
        checking the generation and every area; returns the bytes bound.

        The ids are copied out (they index the table, and the worker may write its segment at any time); a
        push's gradient rows are read where the worker wrote them, as a dense push's are. ``row_shape``
        (``pull_rows``): the table's ``(dim, dtype)``, the size of the area the answer is gathered into (None:
        the shard has no such table, which refuses the request itself).

        Raises
        ------
        RequestRefused
            ``lane_stale`` (no such segment, or no longer) or ``lane_bounds`` (an area outside it).
        """
        ref = req.lane
        segment = self._segment(ref)
        count = req.lane_count
        ids_at = ref.inputs[0]
        if not segment.holds(ids_at, count * wire.IDS_DTYPE.itemsize):
            raise RequestRefused("lane_bounds", _outside_rows("ids", count * wire.IDS_DTYPE.itemsize, ids_at, segment))
        areas = []
        if isinstance(req, wire.PushRowsRequest):
            nbytes = count * req.dim * req.dtype.itemsize
            if not segment.holds(ref.inputs[1], nbytes):
                raise RequestRefused("lane_bounds", _outside_rows("gradient rows", nbytes, ref.inputs[1], segment))
            areas.append((ref.inputs[1], req.dtype, count * req.dim, req.dim))
        elif row_shape is not None:
            dim, dtype = row_shape
            nbytes = count * dim * dtype.itemsize
            if not segment.holds(ref.outputs[0], nbytes):
                raise RequestRefused("lane_bounds", _outside_rows("rows", nbytes, ref.outputs[0], segment))
            areas.append((ref.outputs[0], dtype, count * dim, dim))
        # Every area checked: bind.
        req.ids = segment.array(ids_at, wire.IDS_DTYPE, count).copy()
        bound = count * wire.IDS_DTYPE.itemsize
        for offset, dtype, n, dim in areas:
            view = segment.array(offset, dtype, n).reshape(count, dim)
            if isinstance(req, wire.PushRowsRequest):
                req.grads = view
            else:
                req.out = view
            bound += view.nbytes
        return bound

    def push_lane(self, req: wire.PushRequest) -> Optional[ShardLane]:
        """Bind a push's gradients to its segment (:meth:`bind`) and check its output areas; None: no lane."""
        segment = self.bind(req)
        if segment is None or req.lane is None:
            return None
        if req.pull:
            self.check_outputs(segment, req.lane, req.tensors)
        return (segment, req.lane.outputs)

    def pull_lane(self, req: wire.PullRequest, params: Sequence[np.ndarray]) -> Optional[ShardLane]:
        """Check a pull's output areas against the parameters it will get; None: no lane."""
        segment = self.bind(req)
        if segment is None or req.lane is None:
            return None
        self.check_outputs(segment, req.lane, params)
        return (segment, req.lane.outputs)

    @staticmethod
    def check_outputs(segment: shm.Segment, ref: wire.LaneRef, metas: Sequence[Any]) -> None:
        """Raise ``lane_bounds`` unless every output area of ``ref`` holds its tensor (``metas``: ``nbytes``)."""
        for meta, offset in zip(metas, ref.outputs):
            if not segment.holds(offset, meta.nbytes):
                raise RequestRefused("lane_bounds", _outside(meta, offset, segment))

    @staticmethod
    def write(segment: shm.Segment, offsets: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
        """Write parameters into their output areas (checked when the request came)."""
        for offset, a in zip(offsets, arrays):
            np.copyto(segment.array(offset, a.dtype, a.size), a.reshape(-1))

    def close(self) -> None:
        """Remove the beacon and every segment file still named (mappings held elsewhere stay valid)."""
        if self._beacon is not None:
            self._beacon.remove()
        for generation in list(self._segments):
            self._drop(generation)
        if self._arena is not None:
            self._arena.close()


def _outside_rows(what: str, nbytes: int, offset: int, segment: shm.Segment) -> str:
    return (f"{what}: {nbytes} bytes at offset {offset} are not an aligned area of the {segment.size}-byte "
            "segment")


def _outside(meta: Any, offset: int, segment: shm.Segment) -> str:
    name = getattr(meta, "name", "?")
    return (f"tensor {name!r}: {meta.nbytes} bytes at offset {offset} are not an aligned area of the "
            f"{segment.size}-byte segment")

