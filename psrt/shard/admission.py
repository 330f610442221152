"""What a shard checks before a request may change anything: the keys exist, shapes and dtypes match, the worker
belongs to the job, gradients are finite. Each check raises :class:`~psrt.errors.RequestRefused` (the worker
gets an error reply with its code), so a refused request leaves every parameter as it was.
"""

from __future__ import annotations

from psrt import kernels, wire
from psrt.errors import RequestRefused
from psrt.shard.store import Entry, Key, Store

__all__ = ["entry_of", "check_shape", "validate_push"]


def entry_of(store: Store, key: Key) -> Entry:
    """The entry of ``key``; ``unknown_key`` when the shard does not hold it."""
    entry = store.get(key)
    if entry is None:
        raise RequestRefused("unknown_key", f"tensor {key[0]!r} part {key[1]} is not initialized on this shard")
    return entry


def check_shape(entry: Entry, meta: wire.TensorMeta) -> None:
    """``mismatch`` unless the message's tensor has the key's dtype and element count."""
    param = entry.param
    if (param.dtype is not meta.dtype and param.dtype != meta.dtype) or param.size != meta.count:
        # Clients check a push's shapes before sending: a part of another length comes from an init of another
        # shape, or from a worker that cut the tensor into other pieces.
        hint = ("" if param.size == meta.count else
                ": another worker initialized it with another shape, or cut it into other pieces, or the job whose "
                "checkpoint this shard restored did (every worker must list the shards alike, all by loopback or "
                "ipc:// endpoints, which cut for one host, or none, and set PSRT_PIPELINE alike; a client that "
                "leaves PSRT_PIPELINE at auto cuts its first tensors as restored shards hold them)")
        raise RequestRefused(
            "mismatch",
            f"tensor {meta.name!r} part {meta.part} holds {param.size} x {param.dtype} but the "
            f"message has {meta.count} x {meta.dtype}{hint}",
        )


def validate_push(store: Store, req: wire.PushRequest, nonfinite: str) -> list[Entry]:
    """The entries a push updates, once every check passed (``nonfinite``: ``"reject"`` or ``"allow"``)."""
    if not store.is_member(req.worker):
        raise RequestRefused("not_member", f"worker {req.worker} is not a member of this elastic job (it left, "
                                           "or was taken for dead): register again to rejoin")
    entries = []
    held = store.entries
    for i, meta in enumerate(req.tensors):
        entry = held.get(meta.key)
        if entry is None:
            entry = entry_of(store, meta.key)  # says which
        check_shape(entry, meta)
        if nonfinite == "reject" and not kernels.all_finite(req.array(i)):
            raise RequestRefused(
                "nonfinite", f"gradient of {meta.name!r} part {meta.part} has NaN or Inf; nothing was applied"
            )
        entries.append(entry)
    return entries
