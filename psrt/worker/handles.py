"""A call in flight: what a client's non-blocking calls return, and what every call waits on.

A :class:`Handle` gathers the replies of one user-level call (one request per message, maybe to many shards),
as :class:`psrt.worker.calls.ShardCalls` routes them to it; :meth:`Handle.wait` returns its result.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from psrt.checks import check_seconds

__all__ = ["Handle"]


class Handle:
    """A call in flight. :meth:`wait` returns its result: parameters for pulls, None for pushes."""

    #: Whether it is a local connection's set-up (:meth:`psrt.worker.sender.ShardSender._local_first`), which
    #: nobody waits for: not sent again when its shard reconnects.
    setup = False

    def __init__(self, calls: Any, op: str, outputs: Optional[dict[str, np.ndarray]]) -> None:
        self._calls = calls
        self.op = op
        self._outputs = outputs
        self._outstanding: set[int] = set()
        self._error: Optional[BaseException] = None
        self._conflicts: list[str] = []  # init: tensors another worker initialized with another optimizer
        #: Each shard's answer, for the calls that ask every shard something (one dict for them all: a handle is
        #: made for every push, and most ask nothing): ``init``, the job (a :class:`psrt.wire.JobInfo`);
        #: ``stats``/``table_stats``, its counters; ``checkpoint``, its file; a lane set-up, its reply record.
        self._answers: dict[int, Any] = {}
        #: Per shard, requests still to send, one each time the shard answers one of this call's (a paced push:
        #: :meth:`psrt.worker.sender.ShardSender._paced`); None for the calls that send everything at once.
        self._deferred: Optional[dict[int, deque[Callable[[], None]]]] = None
        #: Per shard, from its acks (a push's): the latest ``taken`` and the longest ``held`` (ns of the shard's
        #: clock, :class:`psrt.wire.AckReply`), read by :class:`psrt.worker.overlap.Pipeline`; None until one came.
        self._timing: Optional[dict[int, tuple[int, int]]] = None

    def done(self) -> bool:
        """True when every reply has arrived (takes in any replies already queued, never blocks)."""
        if self._outstanding and not self._calls.closed:
            self._calls.progress(self, 0.0)
        return not self._outstanding

    def wait(self, timeout: Optional[float] = None) -> Optional[dict[str, np.ndarray]]:
        """Wait for every reply of this call and return its result.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait (``inf``: no limit; 0: take in what has arrived); the client's configured timeout
            when omitted.

        Returns
        -------
        dict of str to numpy.ndarray or None
            The parameters for ``pull``/``push_pull``/``init``, None for ``push``.

        Raises
        ------
        ConfigError
            When ``timeout`` is negative or not a number.
        ShardTimeoutError
            Naming the shard(s) that did not answer in time.
        ServerError
            When a shard answered with an error.
        """
        calls = self._calls
        calls.wait(self, calls.config.timeout if timeout is None else check_seconds(timeout, "timeout", zero=True))
        if self._error is not None:
            raise self._error
        return self._outputs

    def _queue(self, shard: int) -> deque[Callable[[], None]]:
        """The requests to ``shard`` this call sends as the shard answers its earlier ones."""
        if self._deferred is None:
            self._deferred = {}
        return self._deferred.setdefault(shard, deque())

    def _timed(self, shard: int, taken: int, held: int) -> None:
        """Note an ack's ``taken`` and ``held`` (a push cut in pieces gets one ack a piece: the last taken counts)."""
        if self._timing is None:
            self._timing = {}
        last = self._timing.get(shard)
        self._timing[shard] = (taken, held) if last is None else (max(last[0], taken), max(last[1], held))

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
