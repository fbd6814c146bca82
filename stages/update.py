"""`update` stage: PPO-clip GRPO on the LoRA weights from a scored round, then a checkpoint.

Reads `<run>/rollouts` and `<run>/advantages/round=<r>.parquet`; writes
`<run>/checkpoints/round-<r>/` (LoRA, optimizer, RNG, the round's metrics).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import distributed, layout, rounds
from pipeline.config import Config
from pipeline.policy import Policy, restore
from pipeline.trajectories import read_advantages, read_rollout


@task(name="update", cache_policy=NO_CACHE)
def update(
    cfg: Config,
    run: Path | None = None,
    round_index: int = 0,
    policy: Policy | None = None,
    round_metrics: dict[str, float] | None = None,
) -> dict[str, float]:
    ranks = distributed.current()
    run = Path(run) if run else layout.train_run(cfg)
    policy = policy or restore(cfg, run, before_round=round_index)
    rollout = read_rollout(run / "rollouts", round_index)
    scheduled = policy.schedule_lr(cfg, run, round_index)
    start = time.perf_counter()
    metrics = rounds.update_round(
        policy.backend,
        policy.optimizer,
        rollout,
        read_advantages(run, round_index),
        rounds.Schedule.of_rollout(rollout, cfg),
        cfg,
        seed=cfg.train.seed,
        round_index=round_index,
        ranks=ranks,
    )
    metrics |= scheduled | {"time/update_s": time.perf_counter() - start}
    if ranks.is_main:  # every rank holds the same weights: one checkpoint
        policy.save(run / "checkpoints", round_index, (round_metrics or {}) | metrics)
    distributed.barrier(ranks)
    return metrics
