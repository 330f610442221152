"""The client a worker embeds in its training loop: push gradients, pull parameters.

A :class:`Client` holds one DEALER socket per shard. Its tensors are spread over the shards by
:class:`~psrt.partition.PartitionMap`; every call turns into per-shard messages (:mod:`psrt.worker.plans`) that
are all sent at once, each shard's by its :class:`~psrt.worker.sender.ShardSender`, so the shards work in parallel
and a split tensor's chunks stream through a shard one after the other. Replies are received straight into the
output arrays (no intermediate copies).

Every call has a non-blocking form returning a :class:`Handle`; ZeroMQ's I/O thread moves the bytes while the
caller computes, and :meth:`Handle.wait` collects the replies (:mod:`psrt.worker.calls` routes them). A client is not
thread-safe: use it from the thread that created it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from psrt import dtypes, transport, wire
from psrt.checks import check_endpoint
from psrt.config import ClientConfig, ClusterConfig
from psrt.control import security
from psrt.control.link import HeartbeatThread, SchedulerLink, join_as_worker
from psrt.errors import ConfigError, ConnectionLostError, PsrtError, PsrtTypeError, ServerError
from psrt.optim import SGD, Optimizer
from psrt.partition import Chunk, PartitionMap
from psrt.shm.lanes import WorkerLanes
from psrt.worker import exits
from psrt.worker.buffers import ReceivePool
from psrt.worker.calls import ShardCalls
from psrt.worker.compress import Compressor
from psrt.worker.embedding_client import EmbeddingClient, RowsHandle
from psrt.worker.handles import Handle
from psrt.worker.pacing import Pacing
from psrt.worker.plans import Plans, cuts_for_network
from psrt.worker.sender import ShardSender

log = logging.getLogger("psrt.client")

__all__ = ["Client", "Handle"]


class Client:
    """A worker's connection to the shard servers.

    Parameters
    ----------
    servers : sequence of str, optional
        The shard endpoints, e.g. ``["tcp://127.0.0.1:5701", "tcp://127.0.0.1:5702"]``. Every worker must list
        them in the same order: the order decides which shard holds which chunk. When omitted, the client
        registers with the scheduler (``scheduler`` or the environment: ``PSRT_SCHEDULER``, ``DMLC_PS_ROOT_URI``
        and ``DMLC_PS_ROOT_PORT``) and gets the shards, its rank and W from the job's table.
    rank : int, optional
        This worker's rank in ``[0, num_workers)``; it identifies its pushes. With a scheduler: a requested rank
        (default: ``PSRT_WORKER_ID``/``DMLC_WORKER_ID``, else assigned).
    num_workers : int, optional
        W, which must match the shards' ``--workers`` (with a scheduler: checked against the job's W).
    scheduler : str, optional
        The scheduler's endpoint, overriding the environment.
    config : ClientConfig, optional
        Timeouts, partition size and limits; defaults come from the environment (``PSRT_TIMEOUT``, ...).
    cluster : ClusterConfig, optional
        The job's configuration; :meth:`ClusterConfig.from_env` when omitted.

    Examples
    --------
    >>> client = psrt.Client(servers=["tcp://127.0.0.1:5701"], rank=0, num_workers=1)  # doctest: +SKIP
    >>> client.init({"w": np.zeros(10, np.float32)}, optimizer=psrt.SGD(lr=0.1))         # doctest: +SKIP
    >>> params = client.push_pull({"w": np.ones(10, np.float32)})                         # doctest: +SKIP
    """

    def __init__(
        self,
        servers: Optional[Sequence[str]] = None,
        rank: Optional[int] = None,
        num_workers: Optional[int] = None,
        *,
        scheduler: Optional[str] = None,
        config: Optional[ClientConfig] = None,
        cluster: Optional[ClusterConfig] = None,
        compression: Optional[str] = None,
    ) -> None:
        self.config = config if config is not None else ClientConfig()
        if compression is not None:
            self.config = dataclasses.replace(self.config, compression=compression)
        security.load_keys(self.config.keys)  # a bad key directory fails here, before any socket or thread
        self._closed = True  # until the sockets exist
        self._link: Optional[SchedulerLink] = None
        self._heartbeat: Optional[HeartbeatThread] = None
        self._elastic = False
        self._barriers = 0
        table_backup = 0
        cut = None  # the job's cut, when a scheduler's table says it
        if servers is None:
            cluster = cluster if cluster is not None else ClusterConfig.from_env()
            scheduler = scheduler or cluster.scheduler
            if scheduler is None:
                raise ConfigError("no servers and no scheduler: pass servers=[...] or scheduler='tcp://HOST:PORT', "
                                  "or set PSRT_SCHEDULER (or DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)")
            check_endpoint(scheduler, what="scheduler")
            self._start_timeout = cluster.start_timeout
            self._ctx = transport.acquire_context()
            try:
                self._link, self._heartbeat, table = join_as_worker(
                    self._ctx, scheduler, cluster, rank if rank is not None else cluster.worker_id, num_workers,
                    warn_after=self.config.warn_after, keys=self.config.keys)
            except BaseException:
                transport.release_context(self._ctx)
                raise
            servers, rank, num_workers = table.servers, table.rank, table.num_workers
            self._elastic = table.elastic
            table_backup = table.backup_workers if table.mode == "sync" else 0
            cut = table.cut
        else:
            rank = 0 if rank is None else rank
            num_workers = 1 if num_workers is None else num_workers
            self._start_timeout = self.config.timeout
            self._ctx = None
        if isinstance(servers, str) or not isinstance(servers, Sequence) or not servers:
            raise ConfigError("servers must be a non-empty list of endpoints such as ['tcp://127.0.0.1:5701']")
        for ep in servers:
            check_endpoint(ep, what="servers")
        if len(set(servers)) != len(servers):
            raise ConfigError(f"servers lists an endpoint twice: {list(servers)}")
        if type(num_workers) is not int or num_workers < 1:
            raise ConfigError(f"num_workers must be a positive integer, got {num_workers!r}")
        if type(rank) is not int or not 0 <= rank < num_workers:
            raise ConfigError(f"rank must be an integer in [0, num_workers={num_workers}), got {rank!r}")
        self._rank = rank
        self._num_workers = num_workers
        if self._ctx is None:
            self._ctx = transport.acquire_context()
        # A fresh session per client: a restarted worker's sequence numbers are not mistaken for replays.
        self._session = secrets.randbits(63)
        self._clock = 0  # pushes so far (ssp: a pull at clock c waits for every worker to reach c - staleness)
        compress = self.config.compression
        self._compressor = None if compress is None else Compressor(compress, self.config.limits.max_tensor_bytes)
        # Shared memory with shards on this host (not for compressed gradients, which are small already).
        # (Local connections carry compressed gradients too: they need only the beacon.)
        self._lanes = WorkerLanes(len(servers), rank, self._session, self.config.shm and compress is None,
                                  local=self.config.shm)
        hb = self._heartbeat
        self._calls = ShardCalls(self._ctx, servers, self.config, self._lanes,
                                 check=hb.check if hb is not None else None, moves=hb.moves if hb is not None else None,
                                 restarted=self._compressor.restarted if self._compressor is not None else None)
        self.servers = self._calls.servers  # one list: a shard that restarted elsewhere is named where it is now
        pipeline = self.config.pipeline
        self._senders = [ShardSender(shard, self._calls, self._lanes, rank, self._session, self._compressor, pipeline)
                         for shard in range(len(self.servers))]
        network = cuts_for_network(pipeline, cut, self.servers)
        self._map = PartitionMap(len(self.servers), self.config.partition_bytes, self.config.limits.max_header_bytes,
                                 network=network)
        self._plans = Plans(self._map, rank, self._session, prefixes=compress is None)
        #: Whether blocking calls' pieces are paced, timed per set of tensors: made once init says the shards
        #: run sync rounds across a network (:mod:`psrt.worker.pacing`); None: every call sends all at once.
        self._pacing: Optional[Pacing] = None
        self._receive = ReceivePool()
        if table_backup:  # the scheduler's table says it (a shard's answer to init says it too)
            for sender in self._senders:
                sender.backup_workers = table_backup
        self._embedding = EmbeddingClient(self._calls, self._senders, rank, self._session)
        self._closed = False
        exits.track(self)  # closed at interpreter exit if the program does not close it

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self._rank

    @property
    def num_workers(self) -> int:
        """W, the number of workers in the job."""
        return self._num_workers

    @property
    def round(self) -> int:
        """The job's global step: the number of completed rounds behind the parameters this client holds (the
        highest version among the tensors it last received; 0 before ``init``).

        In sync mode every worker's parameters of round r are the same, so a loop ``while client.round < N:``
        stops every worker at the same round N. With backup workers (``--backup-workers b``) a slow worker's
        late push is dropped and it is handed the newest parameters, so it skips rounds: its own count of steps
        is then smaller than the fast workers', and the round, not a step counter, says where the job is.
        """
        return max((v for held in self._calls.versions.held for v in held.values()), default=0)

    @property
    def partition(self) -> PartitionMap:
        """The shard map of the initialized tensors."""
        return self._map

    @property
    def holding_shards(self) -> frozenset[int]:
        """The shards that hold a push's ack until its round is copied, so until every worker pushed it (a
        replicated sync job's, as their answers to :meth:`init` said): a pipeline that held a push back there could
        keep another worker's held ack waiting for it (:class:`psrt.worker.overlap.Pipeline` holds none back)."""
        return frozenset(s.shard for s in self._senders if s.sync and s.replicated)

    # ------------------------------------------------------------------ public API
    def init(self, params: Mapping[str, Any], optimizer: Optional[Optimizer] = None,
             timeout: Optional[float] = None) -> dict[str, np.ndarray]:
        """Register tensors with their initial values and the optimizer the shards apply to them.

        The first initialization of a key wins: workers that initialize it later get the stored value back,
        so all workers start from identical parameters. Shards restored from checkpoints hold their tensors cut as
        the job that wrote them cut them (for one host, or for a network: :mod:`psrt.partition`); with
        ``pipeline="auto"`` a client's first ``init`` asks the shards first (an init check, which makes nothing)
        and cuts its tensors as they hold them.

        Parameters
        ----------
        params : mapping of str to array
            Initial values (float32 or float64).
        optimizer : Optimizer, optional
            A named optimizer (:class:`psrt.SGD`, :class:`psrt.Adam`, ...); ``psrt.SGD()``, ``SGD(lr=0.001)``,
            when omitted.
        timeout : float, optional
            Seconds to wait for the shards.

        Returns
        -------
        dict of str to numpy.ndarray
            The values the shards hold after the call (which may be another worker's).

        Raises
        ------
        ConfigError
            When a tensor exists with another optimizer, or the shards run with another W.
        ServerError
            ``mismatch``: a tensor exists with another size, or cut into other parts.
        """
        self._check_open()
        optimizer = SGD() if optimizer is None else optimizer
        if not isinstance(optimizer, Optimizer):
            raise PsrtTypeError(f"optimizer must be psrt.SGD, psrt.Adam, psrt.AdamW or psrt.AdaGrad, "
                                f"got {type(optimizer).__name__}")
        if not isinstance(params, Mapping) or not params:
            raise ConfigError("params must be a non-empty dict of name -> array")
        arrays = {}
        for name, value in params.items():
            if not isinstance(name, str) or not 0 < len(name) <= self.config.limits.max_name_len:
                raise ConfigError(f"tensor names must be non-empty strings, got {name!r}")
            a = np.ascontiguousarray(value)
            if a.dtype not in dtypes.SUPPORTED:
                raise PsrtTypeError(f"tensor {name!r} has dtype {a.dtype}; psrt holds {dtypes.describe()} "
                                    f"(use .astype(np.float32))")
            arrays[name] = a
        if self._compressor is not None:
            self._compressor.forget(arrays)  # top-k: no residual of an earlier life of these names carries over
        # Restored shards hold their tensors as the job that wrote the checkpoints cut them: for one host, or for a
        # network (psrt.partition). A job restored where its shards are now elsewhere (or here, after running
        # across hosts) cuts them the other way, and each shard would refuse the parts (``mismatch``). Unless the
        # cut was set (PSRT_PIPELINE), a client's first init where the other cut differs first asks the shards
        # whether they would take its parts (an init check: names and sizes, no bytes, nothing made), and cuts the
        # other way if they would take those instead: every worker meets the same shards and decides alike, and
        # no part of a refused cut is left on any shard.
        flipped = False
        if (not self._map.tensors and self.config.pipeline == "auto" and self._cut_differs(arrays)
                and not self._cut_taken(arrays, optimizer, timeout)):
            self._map.network, flipped = not self._map.network, True
            if not self._cut_taken(arrays, optimizer, timeout):
                self._map.network, flipped = not self._map.network, False  # neither: init says what is wrong
        try:
            result = self._init_cut(arrays, optimizer, timeout)
        except BaseException:
            if flipped:
                self._map.network = not self._map.network
            raise
        if flipped:
            log.warning("the shards hold %s cut for %s (restored from a checkpoint of a job whose shards were %s?): "
                        "this client cuts its tensors alike", sorted(arrays),
                        "a network" if self._map.network else "one host",
                        "across hosts" if self._map.network else "on its workers' host")
        return result

    def _cut_taken(self, arrays: dict[str, np.ndarray], optimizer: Optimizer, timeout: Optional[float]) -> bool:
        """Whether the shards would take ``arrays`` cut as the map cuts now (an init check, changing nothing);
        True as well when a shard cannot say (one that does not know the check refuses it as a protocol error)."""
        chunks = self._map.add({n: (a.shape, a.dtype) for n, a in arrays.items()})
        try:
            handle = Handle(self._calls, "init", None)
            self._send_init(handle, chunks, arrays, optimizer, check=True)
            handle.wait(timeout)
            return True
        except ServerError as exc:
            if exc.code == "mismatch":
                return False
            if exc.code == "protocol":
                return True
            raise
        finally:
            self._forget(arrays, chunks)

    def _cut_differs(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Whether the other cut (for a network instead of one host, or the reverse) cuts ``arrays`` otherwise."""
        specs = {n: (a.shape, a.dtype) for n, a in arrays.items()}
        mine, other = (PartitionMap(len(self.servers), self._map.partition_bytes, network=net).add(specs)
                       for net in (self._map.network, not self._map.network))
        return [(c.name, c.part, c.shard, c.nbytes) for c in mine] != [(c.name, c.part, c.shard, c.nbytes)
                                                                        for c in other]

    def _init_cut(self, arrays: dict[str, np.ndarray], optimizer: Optimizer,
                  timeout: Optional[float]) -> dict[str, np.ndarray]:
        """Add ``arrays`` to the map, cut as it cuts now, and initialize their chunks on the shards."""
        chunks = self._map.add({n: (a.shape, a.dtype) for n, a in arrays.items()})
        # The tensors count as initialized only once every shard has accepted them: whatever goes wrong below,
        # the client forgets them again, so a corrected retry starts from the state before this call.
        try:
            return self._init_chunks(chunks, arrays, optimizer, timeout)
        except BaseException:
            self._forget(arrays, chunks)
            raise

    def _forget(self, arrays: Mapping[str, np.ndarray], chunks: list[Chunk]) -> None:
        """Take ``arrays`` out of the map again, with the versions learnt of their ``chunks``."""
        self._map.remove(arrays)
        self._calls.versions.drop(chunks)
        self._plans.clear()

    def _send_init(self, handle: Handle, chunks: list[Chunk], arrays: Mapping[str, np.ndarray],
                   optimizer: Optimizer, check: bool = False) -> None:
        """Send the ``init`` requests of ``chunks`` (with ``check``: the init checks, no bytes)."""
        spec = optimizer.to_wire()
        # Init is no round to pipeline: its pieces share messages, as few as before they were cut for the network.
        for shard, messages in self._map.messages(sorted(chunks, key=lambda c: (c.name, c.part)),
                                                  pipelined=False).items():
            self._senders[shard].init(handle, messages, arrays, spec, check)

    def _init_chunks(self, chunks: list[Chunk], arrays: dict[str, np.ndarray], optimizer: Optimizer,
                     timeout: Optional[float]) -> dict[str, np.ndarray]:
        outputs = {n: np.empty(a.shape, a.dtype) for n, a in arrays.items()}
        handle = Handle(self._calls, "init", outputs)
        self._send_init(handle, chunks, arrays, optimizer)
        result = handle.wait(timeout)
        for shard, job in handle._answers.items():
            self._senders[shard].backup_workers = job.backup_workers
            self._senders[shard].sync = job.mode == "sync"
            self._senders[shard].replicated = job.replicated
            if not self._elastic and job.num_workers != self._num_workers:
                raise ConfigError(f"shard {self.servers[shard]} runs with --workers {job.num_workers} "
                                  f"but this client has num_workers={self._num_workers}")
        if self._pacing is None and self.config.in_flight and self._map.network and any(
                s.sync and not s._grouped() for s in self._senders):
            self._pacing = Pacing.named(self.config.pacing)
        if handle._conflicts:
            raise ConfigError(f"tensors {sorted(set(handle._conflicts))} were initialized by another worker with "
                              "a different optimizer; every worker must pass the same optimizer")
        return result  # type: ignore[return-value]

    def push(self, grads: Mapping[str, Any], timeout: Optional[float] = None) -> None:
        """Push gradients and wait until every shard has taken them (summed into the round, or applied).

        Parameters
        ----------
        grads : mapping of str to numpy.ndarray
            Gradients of initialized tensors, each with the tensor's shape and dtype.
        timeout : float, optional
            Seconds to wait.
        """
        self._blocking(grads, "push", timeout, None)

    def pull(self, names: Optional[Iterable[str]] = None, timeout: Optional[float] = None,
             out: Optional[Mapping[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
        """Pull parameters: all tensors, or those named.

        In sync mode, after a push the pull waits for the round that push joined, so it returns parameters
        that include this worker's gradient.

        Parameters
        ----------
        names : iterable of str, optional
            Tensors to pull (default: all).
        timeout : float, optional
            Seconds to wait.
        out : mapping of str to numpy.ndarray, optional
            Arrays to receive into (each C-contiguous, writable, of the tensor's shape and dtype), e.g. the
            previous step's parameters: the bytes land there straight from the socket, with no allocation.
            Tensors not in ``out`` get fresh arrays.
        """
        return self.pull_async(names, out=out).wait(timeout)  # type: ignore[return-value]

    def push_pull(self, grads: Mapping[str, Any], timeout: Optional[float] = None,
                  out: Optional[Mapping[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
        """Push gradients and return the parameters they updated, once updated (the round in sync mode).

        ``out`` is as for :meth:`pull`.
        """
        return self._blocking(grads, "push_pull", timeout, out)  # type: ignore[return-value]

    def push_async(self, grads: Mapping[str, Any]) -> Handle:
        """Start a push; returns a :class:`Handle`. Do not modify ``grads`` until the handle is done."""
        return self._push(grads, "push")

    def pull_async(self, names: Optional[Iterable[str]] = None,
                   out: Optional[Mapping[str, np.ndarray]] = None) -> Handle:
        """Start a pull; returns a :class:`Handle` whose ``wait()`` gives the parameters.

        Do not read or write ``out`` arrays until the handle is done.
        """
        self._check_open()
        names = list(self._map.tensors) if names is None else list(names)
        if not names:
            raise ConfigError("nothing to pull: this client has initialized no tensors; call client.init({...}) "
                              "first" if not self._map.tensors else "nothing to pull: names is empty")
        outputs = self._outputs(names, out)
        handle = Handle(self._calls, "pull", outputs)
        for part in self._plans.pull(tuple(names)):
            self._senders[part.shard].pull(handle, part, self._clock)
        return handle

    def push_pull_async(self, grads: Mapping[str, Any], out: Optional[Mapping[str, np.ndarray]] = None) -> Handle:
        """Start a push_pull; returns a :class:`Handle` whose ``wait()`` gives the updated parameters.

        Do not modify ``grads`` nor touch ``out`` arrays until the handle is done.
        """
        return self._push(grads, "push_pull", out)

    def stats(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Each shard's counters (keys, bytes, pushes, pulls, rounds, queue depths, ...), in shard order."""
        self._check_open()
        handle = Handle(self._calls, "stats", None)
        for sender in self._senders:
            sender.send(handle, wire.encode_stats_request)
        handle.wait(timeout)
        return [handle._answers[s] for s in range(len(self.servers))]

    def checkpoint(self, timeout: Optional[float] = None) -> list[str]:
        """Ask every shard to write a checkpoint now; returns each one's file, in shard order.

        Raises
        ------
        ServerError
            When a shard has no checkpoint directory (``psrt server --checkpoint-dir``) or cannot write.
        """
        self._check_open()
        handle = Handle(self._calls, "checkpoint", None)
        for sender in self._senders:
            sender.send(handle, wire.encode_checkpoint_request)
        handle.wait(timeout)
        return [handle._answers[s] for s in range(len(self.servers))]

    # ------------------------------------------------------------------ embedding tables
    def init_embedding(self, name: str, dim: int, optimizer: Optional[Optimizer] = None, *,
                       initial: Optional[Any] = None, num_rows: Optional[int] = None, dtype: Any = np.float32,
                       init: str = "normal", std: float = 0.01, low: float = -0.05, high: float = 0.05,
                       seed: int = 0, admit_after: int = 1, capacity: Optional[int] = None,
                       ttl: Optional[float] = None, max_pending: Optional[int] = None,
                       timeout: Optional[float] = None) -> None:
        """Create (or join) the embedding table ``name``; the first definition wins and the rest must agree.

        Parameters
        ----------
        name : str
            The table's name.
        dim : int
            Row length.
        optimizer : Optimizer, optional
            The row-wise optimizer (torch's sparse semantics; :class:`psrt.AdaGrad` as ``torch.optim.Adagrad``,
            :class:`psrt.Adam` as ``torch.optim.SparseAdam``); ``SGD(lr=0.01)`` when omitted.
        initial : array, optional
            ``(num_rows, dim)`` rows of a fixed table, set where a row does not exist yet.
        num_rows : int, optional
            A fixed table's size (implied by ``initial``); ids outside ``[0, num_rows)`` are refused. Without
            it (and ``initial``) the table is dynamic: any int64 id, rows made on first touch.
        dtype : dtype
            float32 (default) or float64.
        init, std, low, high : str, float
            How rows made on first touch start: ``"normal"`` (mean 0, deviation ``std``), ``"uniform"`` (on
            ``[low, high)``) or ``"zeros"``; a pure function of ``(seed, id)``
            (:func:`psrt.kernels.rows.init_rows`), so shards, workers and restarted jobs agree.
        seed : int
            The table's seed.
        admit_after : int
            An id gets a row on its ``admit_after``-th push to its shard (that push is applied; the ones before
            are counted, not applied, and a pull returns the id's initial value without making a row). 1 (the
            default): a row on first touch.
        capacity : int, optional
            The most rows of the table a shard holds: making one more evicts the least recently pushed row with
            its optimizer state (an evicted id starts over, admission included). Default: no bound.
        ttl : float, optional
            Rows not pushed for ``ttl`` seconds are evicted (lazily, when the table is next used; sweeps run at
            most every ``ttl / 16``). Default: never.
        max_pending : int, optional
            The most ids a shard counts towards admission, exactly (a bounded map: past it the least recently
            pushed pending ids are forgotten, so an id is never admitted early). Default 2**20; needs
            ``admit_after > 1``.
        timeout : float, optional
            Seconds to wait for the shards.

        Raises
        ------
        ConfigError
            On a bad argument, or when the table exists with another definition (a ``ServerError``).
        """
        self._check_open()
        self._embedding.init_embedding(name, dim, optimizer, initial, num_rows, dtype, init, std, low, high, seed,
                                       timeout, admit_after=admit_after, capacity=capacity, ttl=ttl,
                                       max_pending=max_pending)

    def table_stats(self, name: str, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """The table ``name``'s counters on each shard, in shard order: ``rows`` (held), ``evicted``,
        ``admitted`` (rows made), ``pending`` (ids counted but not yet admitted), ``forgotten`` (pending ids
        dropped), ``bytes`` (allocated for rows, optimizer state, index and pending counts), ``version``.

        Raises
        ------
        ServerError
            When a shard does not have the table (call :meth:`init_embedding` first).
        """
        self._check_open()
        handle = Handle(self._calls, "table_stats", None)
        for sender in self._senders:
            sender.send(handle, lambda rid: wire.encode_table_stats(rid, name))
        handle.wait(timeout)
        return [handle._answers[s] for s in range(len(self.servers))]

    def pull_rows(self, name: str, ids: Any, timeout: Optional[float] = None,
                  out: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows of ``ids`` (any order, repeats allowed) as a ``(len(ids), dim)`` array.

        In sync mode, after this worker's :meth:`push_rows` the rows include that push's round.

        Parameters
        ----------
        name : str
            The table.
        ids : array of int
            Row ids.
        timeout : float, optional
            Seconds to wait.
        out : numpy.ndarray, optional
            A C-contiguous, writable ``(len(ids), dim)`` array of the table's dtype to receive into.
        """
        return self.pull_rows_async(name, ids, out=out).wait(timeout)

    def pull_rows_async(self, name: str, ids: Any, out: Optional[np.ndarray] = None) -> RowsHandle:
        """Start a :meth:`pull_rows`; returns a handle whose ``wait()`` gives the rows."""
        self._check_open()
        return self._embedding.pull_rows_async(name, ids, out)

    def push_rows(self, name: str, ids: Any, grads: Any, timeout: Optional[float] = None) -> None:
        """Push gradient rows of ``ids``; rows of repeated ids are summed (then, in sync mode, averaged over W).

        Parameters
        ----------
        name : str
            The table.
        ids : array of int
            Row ids, any order, repeats allowed.
        grads : numpy.ndarray
            ``(len(ids), dim)`` gradient rows of the table's dtype.
        timeout : float, optional
            Seconds to wait until every shard has taken its part.
        """
        self.push_rows_async(name, ids, grads).wait(timeout)

    def push_rows_async(self, name: str, ids: Any, grads: Any) -> Handle:
        """Start a :meth:`push_rows`; do not modify ``grads`` until the handle is done."""
        self._check_open()
        return self._embedding.push_rows_async(name, ids, grads)

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every worker of the job has reached this barrier (needs a scheduler when W > 1).

        Raises
        ------
        ServerError
            When the scheduler's deadline passes first; the message names the ranks that never arrived.
        """
        self._check_open()
        if self._link is None:
            if self._num_workers == 1:
                return
            raise ConfigError("barrier() needs a scheduler: create the client with psrt.Client() under "
                              "`psrt launch` or with PSRT_SCHEDULER set")
        self._barriers += 1
        self._link.barrier(f"barrier-{self._barriers}", self._start_timeout + 10.0 if timeout is None else timeout)

    def close(self, failure: Optional[str] = None) -> None:
        """Close the sockets, telling the scheduler this worker is done; replies in flight are discarded.

        Never raises; returns within seconds whatever the job's state. A client still open at interpreter exit
        is closed then (:mod:`psrt.worker.exits`). ``failure``: the program failed (one line saying how); the scheduler
        is told so, and ends a fixed job at once, naming this worker (an elastic job goes on without it).
        """
        if self._closed:
            return
        self._closed = True
        self._close_lanes(timeout=0.5)
        self._calls.close()
        if self._link is not None:
            if failure is not None and self._heartbeat is not None:
                # First: the scheduler's word ends the others, and this process goes first (its other workers, in a
                # job that cannot go on without this one, end with it).
                self._heartbeat.stop(failure=None if self._elastic else failure)
            try:
                self._link.done() if failure is None else self._link.failed(failure)
            except PsrtError:
                pass  # the job is ending either way; the scheduler may already be gone
            if self._heartbeat is not None:
                self._heartbeat.stop()  # after done: until then the scheduler still expects heartbeats
            self._link.close()
        # The last client of the process terminates the shared context; the heartbeat's socket has a context of
        # its own (psrt.control.link), so this never waits for it.
        transport.release_context(self._ctx)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self.close(failure=exits.failure_of(exc))  # never raises: the user's exception stays the one reported

    def __del__(self) -> None:  # a forgotten close() must not leave a context behind
        try:
            if getattr(self, "_calls", None) is not None:
                self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ sending
    def _close_lanes(self, timeout: float) -> None:
        """Tell the shards this client is done with its lanes, so that they free its shared memory now; best
        effort, at most ``timeout`` seconds: a shard that does not hear it drops the lane when it needs the room."""
        generations = self._lanes.release()
        if not generations:
            return
        handle = Handle(self._calls, "lane_close", None)
        try:
            for shard, generation in generations.items():
                self._senders[shard].send(handle, lambda rid, g=generation: wire.encode_lane_close(rid, g))
            handle.wait(timeout)
        except PsrtError:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLostError("this client is closed")

    def _outputs(self, names: Iterable[str], out: Optional[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Destination arrays: the caller's ``out`` where given (checked), else reused or fresh ones."""
        return self._receive.outputs(names, self._map.tensors, out)

    def _blocking(self, grads: Mapping[str, Any], op: str, timeout: Optional[float],
                  out: Optional[Mapping[str, np.ndarray]]) -> Optional[dict[str, np.ndarray]]:
        """A push or push_pull waited for at once: across a network to sync shards its pieces may be paced (the
        wait sends the rest as the shards answer), as :class:`~psrt.worker.pacing.Pacing` finds faster."""
        pacing = self._pacing
        if pacing is None:
            return self._push(grads, op, out).wait(timeout)
        key = (op, tuple(grads))
        way = pacing.way(key)
        result = self._push(grads, op, out, way).wait(timeout)
        pacing.ended(key, way, time.perf_counter())
        return result

    def _push(self, grads: Mapping[str, Any], op: str, out: Optional[Mapping[str, np.ndarray]] = None,
              way: Optional[int] = None) -> Handle:
        if self._closed:
            self._check_open()
        # typing.Mapping's isinstance check is slow; a plain dict, the usual argument, skips it.
        if (type(grads) is not dict and not isinstance(grads, Mapping)) or not grads:
            raise ConfigError("grads must be a non-empty dict of name -> array")
        arrays = {}
        tensors = self._map.tensors
        for name, g in grads.items():
            spec = tensors.get(name)
            if spec is None:
                raise ConfigError(f"tensor {name!r} was never initialized; call client.init() with it first")
            shape, dtype = spec
            a = np.ascontiguousarray(g)
            if a.dtype is not dtype and a.dtype != dtype:
                raise PsrtTypeError(f"gradient {name!r} has dtype {a.dtype} but the tensor is {dtype}; "
                                    f"cast it with .astype(np.{dtype.name})")
            if a.shape != shape:
                raise ConfigError(f"gradient {name!r} has shape {a.shape} but the tensor has shape {shape}")
            arrays[name] = a
        outputs = self._receive.outputs(arrays, tensors, out) if op == "push_pull" else None
        handle = Handle(self._calls, op, outputs)
        self._clock += 1  # ssp: this worker's count of pushes, this one included
        pull, clock, senders = op == "push_pull", self._clock, self._senders
        for part in self._plans.push(tuple(arrays), pull):
            senders[part.shard].push(handle, part, arrays, pull, clock, way)
        return handle
