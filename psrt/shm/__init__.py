"""Shared-memory segments between a shard and the workers on its host: files in /dev/shm, mapped by both.

A shard that serves over shared memory owns every segment: it creates each file with ``O_CREAT | O_EXCL`` and
mode 0600 (only its own user can map it), reserves the space with ``posix_fallocate`` (a full tmpfs fails here
with ENOSPC rather than with SIGBUS at the first write), and maps it. Names are per shard process and per job:
``psrt-<tag>-<pid>-beacon``, ``psrt-<tag>-<pid>-g<generation>`` (a worker's lane) and
``psrt-<tag>-<pid>-a<generation>`` (parameters every worker of the host may read), where ``tag`` is derived from
the endpoint the shard serves (one job per endpoint); :class:`SegmentName` builds and parses them.
``multiprocessing.shared_memory`` is avoided on purpose: its resource
tracker unlinks segments other processes still use and warns about "leaks" in processes that only attached.

Lifetime: a worker unlinks a segment's file as soon as it has mapped it, so the memory lives exactly as long as
the two mappings and a crash of either process leaks nothing but what the other still maps. What a crash can
leave behind (a beacon, or a segment no worker mapped yet) is removed when the shard exits, and a shard
starting on the host removes the leftovers of dead shards (a restart on the same endpoint: its predecessor's).

Every segment starts with a 64-byte header: ``PSRTSHM1``, the generation, the size. The generation lets a
reader tell a segment from another one reused under the same lane; tensor bytes lie at 64-byte aligned
offsets after the header.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np

from psrt.control.process import pid_alive
from psrt.errors import ConfigError

__all__ = ["SHM_DIR", "HEADER_BYTES", "ALIGN", "SegmentName", "Segment", "Beacon", "endpoint_tag", "valid_name",
           "available", "remove_leftovers", "aligned"]

#: Where segments live: a tmpfs every process of the host shares.
SHM_DIR = Path("/dev/shm")
#: Bytes before the first tensor: the segment header.
HEADER_BYTES = 64
#: Alignment of every tensor area (a cache line; more than any dtype needs).
ALIGN = 64

_MAGIC = b"PSRTSHM1"
_HEADER = struct.Struct("<8sQQ")
#: A name a shard may give a worker: one file directly in SHM_DIR, never a path.
_NAME = re.compile(r"psrt-([0-9a-f]{12})-([0-9]{1,10})-(?:beacon|([ga])([0-9]{1,19}))")


@dataclass(frozen=True)
class SegmentName:
    """The name of a file a shard makes in :data:`SHM_DIR`: ``psrt-<tag>-<pid>-<kind>``.

    Attributes
    ----------
    tag : str
        12 hex digits derived from the endpoint the shard serves (:func:`endpoint_tag`).
    pid : int
        The shard's process: a file whose process is gone is a leftover (:func:`remove_leftovers`).
    kind : str
        :attr:`BEACON`, :attr:`LANE` (a worker's segment) or :attr:`ARENA` (parameters every worker of the
        host may read).
    generation : int
        The segment's number (unique per shard process); 0 for the beacon.
    """

    tag: str
    pid: int
    kind: str
    generation: int = 0

    BEACON: ClassVar[str] = "beacon"
    LANE: ClassVar[str] = "g"
    ARENA: ClassVar[str] = "a"

    @classmethod
    def parse(cls, name: object) -> Optional[SegmentName]:
        """The parts of ``name``, or None when it is not one a shard creates (a worker opens nothing else, and
        never a path)."""
        match = _NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            return None
        tag, pid, kind, generation = match.groups()
        return cls(tag, int(pid), kind or cls.BEACON, int(generation or 0))

    @classmethod
    def own(cls, tag: str, kind: str, generation: int = 0) -> SegmentName:
        """The name of this process's beacon or segment ``generation``."""
        return cls(tag, os.getpid(), kind, generation)

    def sibling(self, kind: str, generation: int) -> SegmentName:
        """The name of another file of the same shard process (a worker finds the shared parameters so)."""
        return SegmentName(self.tag, self.pid, kind, generation)

    def __str__(self) -> str:
        last = self.kind if self.kind == self.BEACON else f"{self.kind}{self.generation}"
        return f"psrt-{self.tag}-{self.pid}-{last}"


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def endpoint_tag(endpoint: str) -> str:
    """The 12 hex digits that name a shard's segments after the endpoint it serves."""
    return hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def valid_name(name: str) -> bool:
    """Whether ``name`` is one a shard creates (a worker opens nothing else, and never a path)."""
    return SegmentName.parse(name) is not None


def available(directory: Path = SHM_DIR) -> bool:
    """Whether this host has a shared-memory directory psrt can create files in."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def remove_leftovers(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments and beacons of this user's dead shards; returns their names.

    A shard killed with SIGKILL cannot clean up after itself; the next shard started on the host does it (its
    own user's files only: the pid in each name says whether the shard that made it is still alive).
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parsed = SegmentName.parse(name)
        if parsed is None:
            continue
        pid = parsed.pid
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            if os.stat(directory / name, follow_symlinks=False).st_uid == os.geteuid():
                os.unlink(directory / name)
                removed.append(name)
        except OSError:
            pass  # another shard removed it first
    return removed


class Segment:
    """One mapped segment: created by a shard (:meth:`create`) or opened by a worker (:meth:`attach`).

    Attributes
    ----------
    name : str
        The file's name in :data:`SHM_DIR`.
    generation : int
        The number the shard gave this segment (unique per shard process).
    size : int
        Bytes mapped, the header included.
    """

    def __init__(self, name: str, generation: int, size: int, buf: mmap.mmap, path: Optional[Path]) -> None:
        self.name = name
        self.generation = generation
        self.size = size
        self._buf = buf
        self._path = path  # set while this process should remove the file

    @classmethod
    def create(cls, name: str, generation: int, size: int, directory: Path = SHM_DIR) -> Segment:
        """Create, reserve and map a new segment of ``size`` bytes (header included), mode 0600.

        Raises
        ------
        OSError
            When the file exists already (``EEXIST``) or the space cannot be reserved (``ENOSPC``).
        """
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a filesystem without fallocate: at least the size is right
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        _HEADER.pack_into(buf, 0, _MAGIC, generation, size)
        return cls(name, generation, size, buf, path)

    @classmethod
    def attach(cls, name: str, generation: int, size: int, directory: Path = SHM_DIR) -> Segment:
        """Map the segment a shard created, check its header and unlink its file (the mapping keeps it alive).

        Raises
        ------
        ConfigError
            When the name is not a segment's, or the file is not the shard's segment as announced (another
            owner, mode, size or generation).
        OSError
            When it cannot be opened (another host's shard: it does not exist here).
        """
        parsed = SegmentName.parse(name)
        if parsed is None or parsed.kind == SegmentName.BEACON:
            raise ConfigError(f"{name!r} is not a psrt segment name")
        segment = cls._map(name, generation, size, directory, writable=True)
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            pass
        return segment

    @classmethod
    def read_only(cls, name: str, generation: int, directory: Path = SHM_DIR) -> Segment:
        """Map a segment of parameters a shard shares with every worker of its host, read-only (its file stays).

        Raises
        ------
        ConfigError
            When the name is not such a segment's, or the file is not the shard's as announced.
        OSError
            When it cannot be opened.
        """
        parsed = SegmentName.parse(name)
        if parsed is None or parsed.kind != SegmentName.ARENA:
            raise ConfigError(f"{name!r} is not a psrt parameter segment name")
        return cls._map(name, generation, None, directory, writable=False)

    @classmethod
    def _map(cls, name: str, generation: int, size: Optional[int], directory: Path, writable: bool) -> Segment:
        """Open and map a shard's segment after checking owner, mode, size (None: whatever the file has) and
        header."""
        fd = os.open(directory / name, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            size = st.st_size if size is None else size
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size != size or size <= HEADER_BYTES:
                raise ConfigError(f"segment {name} is not the shard's as announced (owner, mode or size differ)")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        magic, gen, got = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC or gen != generation or got != size:
            buf.close()
            raise ConfigError(f"segment {name} has generation {gen} and size {got}, expected {generation} "
                              f"and {size}")
        return cls(name, generation, size, buf, None)

    def array(self, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
        """A flat view of ``count`` values of ``dtype`` at ``offset`` (the caller has checked the bounds)."""
        return np.frombuffer(self._buf, dtype=dtype, count=count, offset=offset)

    def holds(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` is an aligned area after the header and inside the segment."""
        return (type(offset) is int and offset >= HEADER_BYTES and offset % ALIGN == 0
                and offset + nbytes <= self.size)

    def unlink(self) -> None:
        """Remove the file if this process still should (the mapping stays valid)."""
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None


class Beacon:
    """A shard's proof of where it runs: a small 0600 file holding a random token.

    A worker that can read the token from the file the shard names, and send it back, shares the shard's host
    and /dev/shm; a worker on another host (whatever address it used) cannot.
    """

    def __init__(self, tag: str, directory: Path = SHM_DIR) -> None:
        self.name = str(SegmentName.own(tag, SegmentName.BEACON))
        self.token = secrets.token_hex(16)
        self._path = directory / self.name
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.token.encode())
        finally:
            os.close(fd)

    @staticmethod
    def read(name: str, directory: Path = SHM_DIR) -> Optional[str]:
        """The token in the beacon ``name`` on this host, or None when there is no such beacon here."""
        parsed = SegmentName.parse(name)
        if parsed is None or parsed.kind != SegmentName.BEACON:
            return None
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.read(fd, 64).decode("ascii", "replace")
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Remove the beacon file."""
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
