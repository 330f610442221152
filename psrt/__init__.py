"""psrt: a Cython-accelerated parameter-server runtime on ZeroMQ.

Workers embed a :class:`Client` in their training loop; it pushes gradients to shard servers, which sum them
and apply a named optimizer with compiled kernels, and pulls fresh parameters back.

Importing psrt starts no threads and opens no sockets.
"""

from __future__ import annotations

try:
    from psrt import _core  # noqa: F401  (the compiled kernels; everything below needs them)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "psrt's compiled core (psrt._core) is missing or failed to load: "
        f"{exc}. Build it with `pip install -e .` from the source tree (needs a C compiler and Cython>=3), "
        "or install a built wheel. If psrt is installed and you are inside its source tree, Python is importing "
        "the uncompiled sources from the current directory: run from elsewhere. psrt has no pure-Python fallback."
    ) from exc

from psrt.errors import (
    AuthenticationError,
    BindError,
    ConfigError,
    ConnectionLostError,
    KernelArgumentError,
    KernelTypeError,
    PeerFailedError,
    ProtocolError,
    PsrtError,
    PsrtTimeoutError,
    PsrtTypeError,
    ServerError,
    ShardTimeoutError,
)
from psrt.memory import tune_allocator
from psrt.optim import SGD, AdaGrad, Adam, AdamW, Optimizer
from psrt.worker.client import Client, Handle

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Handle",
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "AdaGrad",
    "PsrtError",
    "BindError",
    "AuthenticationError",
    "ConfigError",
    "KernelArgumentError",
    "KernelTypeError",
    "ProtocolError",
    "PeerFailedError",
    "ServerError",
    "PsrtTimeoutError",
    "PsrtTypeError",
    "ShardTimeoutError",
    "ConnectionLostError",
    "tune_allocator",
    "__version__",
]
