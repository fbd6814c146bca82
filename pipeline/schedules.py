"""Learning-rate schedules shared by pretraining and GRPO: a factor on the peak lr."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int | None = None, min_factor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps; then constant, or with ``total`` a cosine decay to
    ``min_factor`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None:
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
