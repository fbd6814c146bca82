"""`score` stage: rewards of a round's final images and of the clean-image estimates its
method's credit needs. Reads the rollout cache, never writes to it.

Writes `<run>/rollouts/{scores,estimate_images}/round=<r>/` (pipeline.trajectories).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import distributed, layout, rounds
from pipeline.config import Config
from pipeline.policy import Policy, restore
from pipeline.rewards import RewardMix
from pipeline.trajectories import read_rollout, write_estimate_images, write_scores


@task(name="score", cache_policy=NO_CACHE)
def score(
    cfg: Config, run: Path | None = None, round_index: int = 0, policy: Policy | None = None
) -> dict[str, float]:
    ranks = distributed.current()
    run = Path(run) if run else layout.train_run(cfg)
    rollout = read_rollout(run / "rollouts", round_index)
    policy = policy or restore(cfg, run, before_round=round_index)
    metadata = layout.trajectory_metadata(cfg, rollout)
    counter = rounds.CountingVelocity(policy.backend, cfg.sampling.guidance)
    schedule = rounds.Schedule.of_rollout(rollout, cfg)
    start = time.perf_counter()
    result = rounds.score_round(
        policy.backend,
        rollout,
        metadata,
        RewardMix(cfg, cfg.score.rewards),
        cfg,
        estimators=rounds.estimators_for(rollout.method, cfg),
        schedule=schedule,
        counter=counter,
        ranks=ranks,
    )
    rounds.check_finite(result.table)
    seconds = time.perf_counter() - start
    if ranks.is_main:
        write_scores(run / "rollouts", round_index, result.table, overwrite=True)
        if len(result.estimate_keys):  # flow_grpo scores no intermediate estimates
            write_estimate_images(
                run / "rollouts", round_index, result.estimate_images, result.estimate_keys,
                overwrite=True,
            )  # fmt: skip
    distributed.barrier(ranks)
    nfe = float(distributed.all_reduce(torch.tensor(float(counter.nfe)), ranks))
    final = result.table[(result.table.estimator == "final") & (result.table.reward == "mix")]
    correct = rounds.final_verdicts(result.table, rollout, metadata, cfg).float()
    by_tag = {}
    for tag, verdict in zip(rollout.tags, correct.tolist(), strict=True):
        by_tag.setdefault(tag, []).append(verdict)
    return result.stats | {
        "reward/mean": float(final.value.mean()),
        "reward/std": float(final.value.std(ddof=0)),
        "train/accuracy": float(correct.mean()),
        **{f"train/accuracy_{tag}": sum(v) / len(v) for tag, v in by_tag.items()},
        "time/score_s": seconds,
        "cost/score_nfe": nfe,
    }
