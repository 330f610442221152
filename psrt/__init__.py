"""psrt: a Cython-accelerated parameter-server runtime on ZeroMQ.

Workers embed a :class:`Client` in their training loop; it pushes gradients to shard servers, which sum them
and apply a named optimizer with compiled kernels, and pulls fresh parameters back.

Importing psrt starts no threads and opens no sockets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    ResourceLimitError,
    ServerError,
    ShardTimeoutError,
)

# The client stack (NumPy, ZeroMQ, the wire codec, ...) loads on first use of a name that needs it, not here: a
# scheduler or a shard process, and ``psrt --help``, import only what their role needs (PEP 562).
_LAZY = {
    "Client": "psrt.worker.client",
    "Handle": "psrt.worker.handles",
    "Optimizer": "psrt.optim",
    "SGD": "psrt.optim",
    "Adam": "psrt.optim",
    "AdamW": "psrt.optim",
    "AdaGrad": "psrt.optim",
    "tune_allocator": "psrt.memory",
}

if TYPE_CHECKING:  # what a type checker and an IDE see: the names, as if imported here
    from psrt.memory import tune_allocator
    from psrt.optim import SGD, AdaGrad, Adam, AdamW, Optimizer
    from psrt.worker.client import Client
    from psrt.worker.handles import Handle


#: The subpackages and modules ``psrt.NAME`` reaches without an import of its own (as when this file imported the
#: client stack); ``psrt.torch`` (it needs torch) and ``psrt.cli`` still want theirs.
_SUBMODULES = frozenset({"checks", "cluster", "config", "control", "dtypes", "emulation", "examples", "kernels",
                         "memory", "optim", "partition", "shard", "shm", "tablespec", "transport", "wire", "worker"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"psrt.{name}")
    else:
        raise AttributeError(f"module 'psrt' has no attribute {name!r}")
    globals()[name] = value  # found once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


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
    "ResourceLimitError",
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
