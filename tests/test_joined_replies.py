"""A sync round's ``params`` reply of several tensors carries them in one buffer frame, back to back.

Each frame of a message costs both processes' ZeroMQ I/O threads a pass of their own (a send, a wake-up, a
receive), so a reply of a shard's sixteen pieces of a tensor cut for a network cost far more than one of the same
bytes whole. A sync round's W answers carry the same parameters, so the shard joins them once per round and every
answer sends that one buffer; the worker takes the tensors apart as it copies them into its outputs.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from _helpers import RawPeer, frames_of, serving

import psrt
from psrt import wire
from psrt.config import ClientConfig, ServerConfig, WireLimits
from psrt.errors import ProtocolError

LIMITS = WireLimits()
#: Three tensors of two dtypes, as a message of small tensors (or a tensor's pieces) holds them.
ENTRIES = [["w", 0, "<f4", [3]], ["w", 1, "<f4", [2]], ["b", 0, "<f8", [2]]]
INITIAL = [np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0, 5.0], np.float32), np.array([6.0, 7.0])]


def _init(peer: RawPeer, worker: int) -> None:
    header, _ = peer.ask(frames_of({"op": "init", "id": 1, "worker": worker, "session": 10 + worker,
                                    "optimizer": psrt.SGD(lr=1.0).to_wire(), "tensors": ENTRIES}, INITIAL))
    assert header["op"] == "params", header


def _push_pull(peer: RawPeer, worker: int, grads: list[np.ndarray]) -> None:
    peer.send(frames_of({"op": "push_pull", "id": 2, "worker": worker, "session": 10 + worker, "seq": 1, "clock": 1,
                         "tensors": ENTRIES}, grads))


@pytest.mark.integration
@pytest.mark.parametrize("workers", [2, 1])
def test_a_sync_rounds_answers_carry_their_tensors_in_one_frame(workers):
    """W = 2: both answers are the header and one frame, the three tensors' new values back to back (the mean
    gradient applied once); W = 1 has no rounds: a frame per tensor, the parameters themselves, as ever."""
    grads = [[np.full(3, 2.0 * r + 1, np.float32), np.full(2, 2.0 * r + 1, np.float32), np.full(2, 2.0 * r + 1)]
             for r in range(workers)]
    mean = sum(2.0 * r + 1 for r in range(workers)) / workers
    expected = [a - a.dtype.type(mean) for a in INITIAL]
    with serving(ServerConfig(bind="tcp://127.0.0.1:*", num_workers=workers, mode="sync")) as server:
        peers = [RawPeer(server.endpoint) for _ in range(workers)]
        try:
            for r, peer in enumerate(peers):
                _init(peer, r)
            for r, peer in enumerate(peers):
                _push_pull(peer, r, grads[r])
            for peer in peers:
                assert peer.answered(), "no answer to the push_pull"
                header, frames = peer.recv()
                assert header["op"] == "params" and header["versions"] == [1, 1, 1], header
                if workers > 1:
                    assert len(frames) == 1
                    assert frames[0] == b"".join(a.tobytes() for a in expected)
                else:
                    assert frames == [a.tobytes() for a in expected]
        finally:
            for peer in peers:
                peer.close()


class _FakeShard:
    """A ROUTER that answers ``init`` as a shard does and each ``pull`` with the frames :attr:`answer` makes of
    the parameters asked for (their values: 1, 2, 3, ... in order)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.answer: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            req = wire.decode_request(frames, LIMITS)
            if isinstance(req, wire.InitRequest):
                entries = [[m.name, m.part, m.dtype.str, [m.count]] for m in req.tensors]
                reply = wire.encode_params(req.id, entries, [0] * len(entries),
                                           [req.array(i) for i in range(len(entries))],
                                           wire.JobInfo("sync", 1, []))
            else:
                entries = [[k.name, k.part, "<f4", [3]] for k in req.keys]
                values = [np.arange(3 * i + 1, 3 * i + 4, dtype=np.float32) for i in range(len(entries))]
                reply = [msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "params", "id": req.id,
                                        "tensors": entries, "versions": [1] * len(entries)}),
                         *self.answer(values)]
            self.sock.send_multipart([identity, *(bytes(f) for f in reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize("answer, error", [
    (lambda values: [b"".join(v.tobytes() for v in values)], None),  # joined
    (lambda values: [v.tobytes() for v in values], None),  # a frame each
    (lambda values: [b"".join(v.tobytes() for v in values)[:-4]], "frame has 32 bytes, expected 12"),
    (lambda values: [b"".join(v.tobytes() for v in values) + b"\0" * 4], "frame has 40 bytes, expected 12"),
    (lambda values: [values[0].tobytes() + values[1].tobytes(), values[2].tobytes()], "frame has 24 bytes"),
    (lambda values: [b"".join(v.tobytes() for v in values), b""], "frame has 36 bytes"),
], ids=["joined", "a-frame-each", "joined-short", "joined-long", "two-joined-of-three", "joined-and-more"])
def test_a_client_takes_a_joined_reply_apart_and_refuses_one_of_another_size(answer, error):
    """Three float32 tensors of 3 values: one frame of all 36 bytes is taken apart into the three outputs, as a
    frame each is; a single frame of any other size is taken for the first tensor's, and, like joined frames that
    are not all of them, is a protocol error naming what is wrong (the call fails: nothing half-read passes for
    parameters)."""
    shard = _FakeShard()
    shard.answer = answer
    try:
        with psrt.Client([shard.endpoint], config=ClientConfig(timeout=5, shm=False)) as c:
            c.init({name: np.zeros(3, np.float32) for name in ("a", "b", "c")})
            if error is None:
                got = c.pull(["a", "b", "c"])
                for i, name in enumerate(("a", "b", "c")):
                    np.testing.assert_array_equal(got[name], np.arange(3 * i + 1, 3 * i + 4, dtype=np.float32))
            else:
                with pytest.raises(ProtocolError, match=error):
                    c.pull(["a", "b", "c"])
    finally:
        shard.close()
