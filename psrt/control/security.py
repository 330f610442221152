"""A job's CURVE keys: the key directory's layout, key generation, and loading with clear errors.

A job has two key pairs, written by ``psrt keygen DIR`` in ZeroMQ's certificate format:

====================  ===============================================  ==================================
file                  holds                                            needed by
====================  ===============================================  ==================================
``server.key``        the serving sockets' public key                  every process that connects
``server.key_secret`` the serving sockets' key pair                    servers and the scheduler
``client.key``        the one client public key the job accepts        servers and the scheduler
``client.key_secret`` the client key pair                              workers, servers (to reach the
                                                                       scheduler), ``psrt stats``
====================  ===============================================  ==================================

Secret files are written 0600 in a 0700 directory and refused when group or others may read them, so a
directory copied carelessly fails loudly instead of leaking. The whole directory may be copied to every host;
a host that only runs workers needs ``server.key`` and the client pair alone.

Turning keys on (``PSRT_KEYS=DIR``, or ``--keys DIR``) switches every socket of the process to CURVE: traffic
is encrypted and authenticated, and the serving sockets accept only the job's client key. The ZeroMQ calls live
in :mod:`psrt.transport`; this module only handles paths, files and errors.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from psrt import transport
from psrt.errors import ConfigError

__all__ = ["JobKeys", "KEY_FILES", "keygen", "load_keys"]

#: The files of a key directory, by the pair's name.
KEY_FILES = {"server": ("server.key", "server.key_secret"), "client": ("client.key", "client.key_secret")}

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class JobKeys:
    """The keys one process uses (z85-encoded, as ZeroMQ takes them); secrets never appear in ``repr``.

    Attributes
    ----------
    directory : pathlib.Path
        Where they were read from (named in error messages).
    server_public, client_public : bytes
        The public keys of the job's server and client pairs.
    server_secret : bytes or None
        The serving sockets' secret key (loaded for a serving role only).
    client_secret : bytes or None
        The connecting sockets' secret key (loaded for a connecting role only).
    """

    directory: Path
    server_public: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    server_secret: Optional[bytes] = field(default=None, repr=False)
    client_secret: Optional[bytes] = field(default=None, repr=False)


def _check_secret_mode(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"secret key file {path} may be read by other users (mode {stat.S_IMODE(mode):o}); "
                          f"run chmod 600 {path}")


def _read(directory: Path, name: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"key directory {directory} has no {name}; create a job's keys with `psrt keygen "
                          f"{directory}` (or copy them from the directory the job's other hosts use)")
    try:
        if secret:
            _check_secret_mode(path)
        public, secret_key = transport.read_certificate(path)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read key file {path}: {exc}") from None
    if secret and not secret_key:
        raise ConfigError(f"key file {path} holds no secret key")
    return public, secret_key


def load_keys(directory: Optional[PathLike], serve: bool = False, connect: bool = True) -> Optional[JobKeys]:
    """Read the keys a process needs from a key directory; None when ``directory`` is None or empty (keys off).

    Parameters
    ----------
    directory : str or os.PathLike or None
        The key directory (``PSRT_KEYS``, ``--keys``).
    serve : bool
        Load what a serving socket needs: the server pair and the client public key.
    connect : bool
        Load what a connecting socket needs: the server public key and the client pair.

    Raises
    ------
    ConfigError
        When the directory or a needed file is missing or unreadable, or a secret file is readable by others;
        the message names the path and what to do.
    """
    if directory is None or str(directory) == "":
        return None
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"key directory {path} does not exist (or is not a directory); create a job's keys "
                          f"with `psrt keygen {path}`, or set PSRT_KEYS / --keys to the job's key directory")
    server_public, server_secret = _read(path, KEY_FILES["server"][1 if serve else 0], secret=serve)
    client_public, client_secret = _read(path, KEY_FILES["client"][1 if connect else 0], secret=connect)
    return JobKeys(path, server_public, client_public, server_secret if serve else None,
                   client_secret if connect else None)


def keygen(directory: PathLike) -> JobKeys:
    """Write a job's keys (a server pair and a client pair) into ``directory``, created 0700 when missing.

    Parameters
    ----------
    directory : str or os.PathLike
        Where to write them; it must not hold keys already (a job's keys are never overwritten silently).

    Returns
    -------
    JobKeys
        The keys written, every part loaded.

    Raises
    ------
    ConfigError
        When the directory already holds keys or cannot be created or written.
    """
    path = Path(directory)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create key directory {path}: {exc.strerror}") from None
    if not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory")
    existing = [n for pair in KEY_FILES.values() for n in pair if (path / n).exists()]
    if existing:
        raise ConfigError(f"{path} already holds keys ({', '.join(existing)}); remove them or choose another "
                          "directory")
    try:
        # Generate in a private (0700) directory inside the target, tighten the modes, then move the files in:
        # a secret is never, even briefly, readable by others under a permissive umask.
        staging = Path(tempfile.mkdtemp(prefix=".keygen-", dir=path))
        try:
            for name, (public, secret) in KEY_FILES.items():
                transport.create_certificates(staging, name)
                os.chmod(staging / secret, 0o600)
                os.chmod(staging / public, 0o644)
            for public, secret in KEY_FILES.values():
                os.replace(staging / public, path / public)
                os.replace(staging / secret, path / secret)
        finally:
            for leftover in staging.iterdir():
                leftover.unlink()
            staging.rmdir()
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {path}: {exc.strerror or exc}") from None
    keys = load_keys(path, serve=True, connect=True)
    assert keys is not None
    return keys
