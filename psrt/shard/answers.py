"""How a shard answers: parameters (zero-copy over the socket, in a 16-bit form, or through shared memory), acks
and errors, each counted (bytes out, dropped replies, errors).

A ``params`` reply over the socket sends the parameter buffers themselves, zero-copy, and remembers each send's
tracker on its entry, so a later step copies the buffer first if ZeroMQ is still reading it
(:meth:`psrt.shard.store.Entry.writable_param`). A sync round's answer of several tensors (a tensor's pieces cut
for a network, small tensors sharing a message) is the exception: its W answers carry the same bytes, so they are
joined once, back to back in one buffer, and every answer sends that one frame. Each frame costs both ends' ZeroMQ
I/O threads a pass of their own (a send, a wake-up, a receive), far more than the copy: at 10 Gbit/s between
emulated hosts (W=4, S=2, 16 pieces a shard, ``PSRT_PACING=grouped``) one frame made the job 9 % faster than a
frame per piece (README, "Across hosts"). Over a shared-memory lane only the header crosses the socket.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import numpy as np

from psrt import transport, wire
from psrt.shard.counters import Counters
from psrt.shard.store import Entry, Key
from psrt.shm.lanes import ShardLane, ShardLanes

__all__ = ["ShardReplies"]

log = logging.getLogger("psrt.server")

class _Mark:
    """Where a pipelined copy was sent in the replies kept back (:meth:`ShardReplies.mark`): what follows it tells
    of that copy's state, and waits for it."""

    __slots__ = ("copy",)

    def __init__(self, copy: int) -> None:
        self.copy = copy


class _Notice:
    """An early params reply's ``held`` notice, kept back with the replies until the replicas hold what it told."""

    __slots__ = ("identity", "request_id")

    def __init__(self, identity: bytes, request_id: int) -> None:
        self.identity, self.request_id = identity, request_id


#: Sets of keys whose params replies' tensors part a shard keeps packed (:attr:`ShardReplies._tensors`).
_MAX_KEY_SETS = 1 << 12


class ShardReplies:
    """The replies of one shard, sent on its ROUTER ``channel``.

    Parameters
    ----------
    channel : psrt.transport.RouterChannel
        The shard's socket.
    lanes : ShardLanes
        Its shared-memory lanes with workers of this host.
    counters : Counters
        What the shard counts.
    """

    def __init__(self, channel: transport.RouterChannel, lanes: ShardLanes, counters: Counters) -> None:
        self._chan, self.lanes, self.counters = channel, lanes, counters
        #: The ``tensors`` part of the params replies of each set of keys, packed once: a key's dtype and size never
        #: change (a shard refuses to initialize it again otherwise), so every reply for them repeats its bytes.
        self._tensors: dict[tuple[Key, ...], bytes] = {}
        #: Replies kept back until a replicated job's copy of what they tell is acknowledged (:meth:`gate`), each
        #: with copies of its frames; None: replies go at once.
        self._gated: Optional[list[Union[tuple[bytes, list[bytes]], Callable[[], None], _Mark, _Notice]]] = None
        #: Whether the replies kept back wait for pipelined copies (:meth:`mark`): a params answer is then made at
        #: once, from the state then, as a later round's copy may be on its way when the earlier one's replies go.
        self._marked = False
        #: The last joined parameters made (:meth:`_joined_params`): ``(entries, versions, bytes)``.
        self._joined: Optional[tuple[list[Entry], list[int], np.ndarray]] = None

    def params(self, identity: bytes, request_id: int, keys: list[Key], entries: list[Entry], rounds: bool,
               job: Optional[wire.JobInfo] = None, codec: Optional[str] = None,
               lane: Optional[ShardLane] = None) -> None:
        """Send the parameters of ``entries``; ``rounds``: the shard's pushes gather into sync rounds. While replies
        are kept back (:meth:`gate`) the answer is made when they go: the parameters then, which the replicas hold
        (every change until then is in the copy they acknowledged), sent zero-copy as ever."""
        if self._gated is not None:
            if not self._marked:
                self._gated.append(lambda: self.params(identity, request_id, keys, entries, rounds, job, codec,
                                                       lane))
                return
            if lane is None and job is None:  # pipelined copies: the data now, the notice once they are held
                self._early(identity, request_id, keys, entries, codec)
                return
        if lane is None and codec is None and job is None:  # the usual answer: full precision, over the socket
            which = tuple(keys)
            tensors = self._tensors.get(which)
            if tensors is None:
                if len(self._tensors) >= _MAX_KEY_SETS:
                    self._tensors.clear()  # (workers send a few sets of keys, the same every step)
                tensors = self._tensors[which] = wire.params_tensors(which, [e.param.dtype for e in entries],
                                                                      [e.param.size for e in entries])
            if len(entries) == 1:  # one tensor: written out
                entry = entries[0]
                param = entry.param
                frames = wire.encode_params_packed(request_id, tensors, [entry.version], [param])
                try:
                    trackers = self._send(identity, frames, True)
                except transport.SendDropped as exc:
                    self.counters.dropped_replies += 1
                    log.warning("reply to a worker dropped: %s", exc)
                    return
                self.counters.bytes_out += len(frames[0]) + len(frames[1])
                if trackers[1] is not None:
                    entry.trackers.append(trackers[1])
                return
            versions = [e.version for e in entries]
            if rounds:  # a sync round's W answers carry the same bytes: joined into one frame, made once
                joined = self._joined_params(entries, versions)
                self.reply(identity, wire.encode_params_packed(request_id, tensors, versions, [joined]))
                return
            payload = [e.param for e in entries]
            self._send_params(identity, entries, payload, wire.encode_params_packed(request_id, tensors, versions,
                                                                                   payload))
            return
        tensors = [wire.tensor_entry(k[0], k[1], e.param.dtype, (e.param.size,)) for k, e in zip(keys, entries)]
        if lane is not None:  # the parameters go through shared memory, the header over the socket
            segment, offsets = lane
            # Rounds (sync, W > 1): a round's result stays put until every worker pushes again, so each worker
            # copies it from the shard's own memory; otherwise (or for a key not there) it is written into the lane.
            places = [e.shared_place() for e in entries] if rounds else [[] for _ in entries]
            written = [(o, e.param) for o, e, p in zip(offsets, entries, places) if not p]
            self.lanes.write(segment, [o for o, _ in written], [a for _, a in written])
            self.counters.shm_bytes_out += sum(e.param.nbytes for e in entries)
            self.reply(identity, wire.encode_params(request_id, tensors, [e.version for e in entries], [], job,
                                                    lane=segment.generation, places=places))
            return
        payload = _packed(tensors, entries, codec)
        self._send_params(identity, entries, payload,
                          wire.encode_params(request_id, tensors, [e.version for e in entries], payload, job))

    def forget_joined(self) -> None:
        """Drop the joined parameters kept for a round's answers (:meth:`_joined_params`): the shard takes another
        push or pull, whose answers are made anew (the async path, which joins nothing, never calls this)."""
        self._joined = None

    def _joined_params(self, entries: list[Entry], versions: list[int]) -> np.ndarray:
        """The parameters of ``entries`` at ``versions`` back to back, as one reply frame carries them: copied once
        for the W answers of their round, which go one after another as the message that closes it is handled
        (only the last one made is kept, and only until the next push or pull: a shard holds at most one message's
        parameters twice)."""
        last = self._joined
        if last is not None and last[1] == versions and len(last[0]) == len(entries) \
                and all(a is b for a, b in zip(last[0], entries)):
            return last[2]
        joined = np.concatenate([e.param.reshape(-1).view(np.uint8) for e in entries])
        self._joined = (list(entries), list(versions), joined)
        return joined

    def _early(self, identity: bytes, request_id: int, keys: list[Key], entries: list[Entry],
               codec: Optional[str]) -> None:
        """A params reply made while pipelined copies are awaited (:meth:`mark`): sent at once marked not held, so
        its bytes leave while the copy travels; the worker keeps them but completes the call only on the ``held``
        notice, which waits with the replies kept back (:meth:`release`)."""
        tensors = [wire.tensor_entry(k[0], k[1], e.param.dtype, (e.param.size,)) for k, e in zip(keys, entries)]
        payload = _packed(tensors, entries, codec)
        frames = wire.encode_params(request_id, tensors, [e.version for e in entries], payload, held=False)
        # (a dropped one gets no notice: the worker's call times out and goes again)
        if self._send_params(identity, entries, payload, frames, at_once=True):
            assert self._gated is not None
            self._gated.append(_Notice(identity, request_id))

    def _send_params(self, identity: bytes, entries: list[Entry], payload: list[Any], frames: list[Any],
                     at_once: bool = False) -> bool:
        """Send a params reply (``at_once``: past the gate, an early reply); whether it went."""
        try:
            trackers = self._chan.send(identity, frames, track=True) if at_once else self._send(identity, frames, True)
        except transport.SendDropped as exc:
            self.counters.dropped_replies += 1
            log.warning("reply to a worker dropped: %s", exc)
            return False
        self.counters.bytes_out += sum(map(len, frames))
        # One tracker per frame (None where the frame was copied); the parameters' frames follow the header.
        # A 16-bit copy is the frame's own: only frames of the parameters themselves are tracked.
        for entry, frame, tracker in zip(entries, payload, trackers[1:]):
            if tracker is not None and frame is entry.param:
                entry.trackers.append(tracker)
        return True

    def reply(self, identity: bytes, frames: list[Any]) -> None:
        """Send a reply whose buffers (if any) are small: acks, rows, stats, lane set-up."""
        try:
            self._send(identity, frames, False)
        except transport.SendDropped as exc:
            self.counters.dropped_replies += 1
            log.warning("reply to a worker dropped: %s", exc)
            return
        self.counters.bytes_out += sum(map(len, frames))

    def _send(self, identity: bytes, frames: list[Any], track: bool) -> list[Any]:
        """Every reply's way out: at once, or kept back while :meth:`gate` holds (copied, as a held reply of the
        channel is: the caller may change its buffers at once)."""
        gated = self._gated
        if gated is None:
            return self._chan.send(identity, frames, track=track)
        gated.append((identity, [f if type(f) is bytes else memoryview(f).tobytes() for f in frames]))
        return [None] * len(frames)

    @property
    def gated(self) -> bool:
        """Whether replies are kept back (:meth:`gate`)."""
        return self._gated is not None

    def gate(self) -> None:
        """Keep every reply back from now on, in order, until :meth:`ungate`: a replicated job's state changed and
        its copy is not acknowledged yet, so nothing that tells of it (an ack, parameters, even an error that
        follows it in a worker's stream) may go out before it is held R + 1 times."""
        if self._gated is None:
            self._gated = []

    def ungate(self) -> None:
        """Send the replies kept back since :meth:`gate`, in the order they were made; replies go at once again."""
        gated, self._gated, self._marked = self._gated, None, False
        for held in gated or ():
            self._send_held(held)

    def mark(self, copy: int) -> None:
        """A sync round's copy ``copy`` was sent and is not awaited (a pipelined copy): every reply made from now on
        is kept back, in order, until :meth:`release` says the replicas hold that copy; a params reply is made now
        (its frames copied), from the state this copy and the earlier ones hold."""
        if self._gated is None:
            self._gated = []
            self._marked = True
        self._gated.append(_Mark(copy))

    def release(self, copy: int, last: bool) -> None:
        """Every copy up to ``copy`` is held by the replicas: send the replies kept back before a later copy's
        :meth:`mark`, in order; ``last``: no copy is awaited any more, so replies go at once again."""
        gated = self._gated or []
        n = 0
        for n, held in enumerate(gated):  # noqa: B007  (n: where the replies still waiting begin)
            if type(held) is _Mark and held.copy > copy:
                break
        else:
            n = len(gated)
        self._gated = gated[n:]
        if last and not self._gated:
            self._gated, self._marked = None, False
        notices: dict[bytes, list[int]] = {}  # one per worker: every early reply of it this release answers
        for held in gated[:n]:
            if type(held) is _Notice:
                notices.setdefault(held.identity, []).append(held.request_id)
            elif type(held) is not _Mark:
                self._send_held(held)
        for identity, ids in notices.items():
            self._notify(identity, ids)

    def _send_held(self, held: Union[tuple[bytes, list[bytes]], Callable[[], None], _Mark, _Notice]) -> None:
        if type(held) is _Mark:
            return
        if type(held) is _Notice:
            self._notify(held.identity, [held.request_id])
            return
        if callable(held):
            held()
            return
        identity, frames = held
        try:
            self._chan.send(identity, frames)
        except transport.SendDropped as exc:  # (counted as sent when it was made)
            self.dropped([(sum(map(len, frames)), str(exc))])

    def _notify(self, identity: bytes, ids: list[int]) -> None:
        """Send a ``held`` notice now (past the replies still kept back for later copies)."""
        frames = wire.encode_held(ids)
        try:
            self._chan.send(identity, frames)
        except transport.SendDropped as exc:  # (the worker's calls time out and go again, as after a lost reply)
            self.counters.dropped_replies += 1
            log.warning("reply to a worker dropped: %s", exc)
            return
        self.counters.bytes_out += sum(map(len, frames))

    def dropped(self, replies: list[tuple[int, str]]) -> None:
        """Count replies that were held back (:meth:`psrt.transport.RouterChannel.hold`) and could not be sent,
        ``(bytes, why)`` each: counted as sent when they were given, they are taken back out of ``bytes_out``."""
        for nbytes, why in replies:
            self.counters.dropped_replies += 1
            self.counters.bytes_out -= nbytes
            log.warning("reply to a worker dropped: %s", why)

    def error(self, identity: bytes, request_id: int, code: str, message: str, counted: bool = True) -> None:
        """Send an ``error`` reply (the request changed nothing); ``counted``: a shard error (an operator's
        refused request is not one)."""
        self.counters.errors += counted
        log.info("error reply (%s): %s", code, message)
        self.reply(identity, wire.encode_error(request_id, code, message))


def _packed(tensors: list[list[Any]], entries: list[Entry], codec: Optional[str]) -> list[Any]:
    """The payload of a params reply: each entry's parameters, or with a 16-bit ``codec`` their packed copy where
    one exists (None: float64, or out of fp16's range), whose dtype then goes into its ``tensors`` entry."""
    payload: list[Any] = [e.param for e in entries]
    if codec is not None:
        for i, e in enumerate(entries):
            packed = e.packed_param(codec)
            if packed is not None:
                tensors[i][2], payload[i] = packed
    return payload
