"""Model shape lists and sizes (``psrt.emulation.models``)."""

from __future__ import annotations

import math

import pytest

from psrt import ConfigError
from psrt.emulation.models import MODELS, model_bytes, model_tensors


@pytest.mark.parametrize("spec", [*MODELS, "1MB", "4MiB", "4097"])
def test_model_bytes_sums_the_float32_tensors(spec):
    assert model_bytes(spec) == 4 * sum(math.prod(shape) for _, shape in model_tensors(spec))
    assert model_bytes(model_tensors(spec)) == model_bytes(spec)


def test_model_bytes_of_known_models():
    assert model_bytes("resnet50") == 4 * 25_557_032
    assert model_bytes("1MB") == 1_000_000 and model_bytes("4MiB") == 4 << 20
    assert model_bytes([("w", (3, 4)), ("b", (4,))]) == 64
    with pytest.raises(ConfigError, match="neither a shipped model"):
        model_bytes("resnet9000")
