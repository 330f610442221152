"""What the click-through-rate examples (:mod:`psrt.examples.ctr`, :mod:`psrt.examples.criteo`) measure."""

from __future__ import annotations

import numpy as np

__all__ = ["auc"]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (the rank statistic; ties broken by order)."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))
