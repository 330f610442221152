"""Tensor shape lists of real networks, for load generation: ResNet-50, VGG-16 and BERT-base.

Each list holds the trainable tensors of the torchvision / Hugging Face model in registration order (see the
``source`` and ``note`` fields of each JSON file). :func:`model_tensors` also accepts a size such as ``"100MB"``
or ``"4MiB"`` and then builds a synthetic model of that many float32 bytes; :func:`model_bytes` is a model's
size, for the load generator, the performance model and the benchmarks alike.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from typing import Optional, Sequence, Union

from psrt.errors import ConfigError

__all__ = ["MODELS", "load", "model_tensors", "model_bytes", "parse_size", "Tensors"]

#: Names of the shipped shape lists.
MODELS = ("resnet50", "vgg16", "bert-base")

#: A model as ``[(name, shape), ...]``.
Tensors = Sequence[tuple[str, tuple[int, ...]]]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|kib|mib|gib)?\s*$", re.IGNORECASE)
_FACTORS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@cache
def load(name: str) -> dict:
    """The JSON document of a shipped model: ``name``, ``source``, ``total_params`` and ``tensors``."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; shipped models: {', '.join(MODELS)}")
    text = resources.files(__name__).joinpath(f"{name}.json").read_text()
    return json.loads(text)


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"100MB"``, ``"4MiB"`` or a plain integer like ``"4096"``."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"size {text!r} is not a size such as 100MB, 4MiB or 4096")
    unit = m.group(2).lower() if m.group(2) else None
    return int(float(m.group(1)) * _FACTORS[unit])


def model_tensors(spec: str, partition_bytes: int = 4 << 20,
                  layers: Optional[int] = None) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of a shipped model, or of a synthetic float32 model of the given size.

    A synthetic model is one tensor per ``partition_bytes`` (the last one smaller), named ``t0``, ``t1``, ...;
    with ``layers = N``, N tensors of (nearly: the first ones take the remainder) equal size instead, the layers
    an overlapped step pushes one by one (``psrt worker --layers N``). A shipped model has its own tensors.
    """
    if spec in MODELS:
        if layers is not None:
            raise ConfigError(f"--layers splits a sized model (such as 64KB); {spec} has its own "
                              f"{len(load(spec)['tensors'])} tensors: leave --layers out")
        return [(t["name"], tuple(t["shape"])) for t in load(spec)["tensors"]]
    try:
        nbytes = parse_size(spec)
    except ConfigError:
        raise ConfigError(f"model {spec!r} is neither a shipped model ({', '.join(MODELS)}) nor a size such as "
                          "100MB") from None
    count = max(1, nbytes // 4)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= count:
            raise ConfigError(f"--layers must be a whole number from 1 to the model's {count} float32 values, "
                              f"got {layers!r}")
        per, extra = divmod(count, layers)
        return [(f"t{i}", (per + (i < extra),)) for i in range(layers)]
    per = max(1, partition_bytes // 4)
    n = math.ceil(count / per)
    return [(f"t{i}", (min(per, count - i * per),)) for i in range(n)]


def model_bytes(model: Union[str, Tensors]) -> int:
    """Bytes of a model's float32 parameters: the sum over its tensors of 4 x the product of the shape.

    Parameters
    ----------
    model : str or sequence of (name, shape)
        A spec as :func:`model_tensors` takes (a shipped network or a size), or its tensors.

    Examples
    --------
    >>> model_bytes("resnet50")
    102228128
    >>> model_bytes([("w", (3, 4)), ("b", (4,))])
    64
    """
    tensors = model_tensors(model) if isinstance(model, str) else model
    return 4 * sum(math.prod(shape) for _, shape in tensors)
