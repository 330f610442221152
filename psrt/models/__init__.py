"""Tensor shape lists of real networks, for load generation: ResNet-50, VGG-16 and BERT-base.

Each list holds the trainable tensors of the torchvision / Hugging Face model in registration order (see the
``source`` and ``note`` fields of each JSON file). :func:`model_tensors` also accepts a size such as ``"100MB"``
or ``"4MiB"`` and then builds a synthetic model of that many float32 bytes.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources

from psrt.errors import ConfigError

__all__ = ["MODELS", "load", "model_tensors", "parse_size"]

#: Names of the shipped shape lists.
MODELS = ("resnet50", "vgg16", "bert-base")

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


def model_tensors(spec: str, partition_bytes: int = 4 << 20) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape), ...]`` of a shipped model, or of a synthetic float32 model of the given size.

    A synthetic model is one tensor per ``partition_bytes`` (the last one smaller), named ``t0``, ``t1``, ...
    """
    if spec in MODELS:
        return [(t["name"], tuple(t["shape"])) for t in load(spec)["tensors"]]
    try:
        nbytes = parse_size(spec)
    except ConfigError:
        raise ConfigError(f"model {spec!r} is neither a shipped model ({', '.join(MODELS)}) nor a size such as "
                          "100MB") from None
    count = max(1, nbytes // 4)
    per = max(1, partition_bytes // 4)
    n = math.ceil(count / per)
    return [(f"t{i}", (min(per, count - i * per),)) for i in range(n)]
