"""`rollout` stage: G trajectories per prompt with the method's SDE, cached to Parquet.

Writes `<run>/rollouts/{steps,finals}/round=<r>/` (pipeline.trajectories).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from pipeline import distributed, layout, rounds
from pipeline.config import Config
from pipeline.policy import Policy, restore
from pipeline.trajectories import RoundRollout, write_rollout


@task(name="rollout", cache_policy=NO_CACHE)
def rollout(
    cfg: Config, run: Path | None = None, round_index: int = 0, policy: Policy | None = None
) -> dict[str, float]:
    ranks = distributed.current()
    run = Path(run) if run else layout.train_run(cfg)
    policy = policy or restore(cfg, run, before_round=round_index)
    prompts = layout.training_prompts(cfg)
    schedule = rounds.Schedule.from_config(cfg)
    counter = rounds.CountingVelocity(policy.backend, cfg.sampling.guidance)
    chosen = rounds.select_prompts(
        prompts, cfg.rollout.prompts_per_round, seed=cfg.train.seed, round_index=round_index
    )
    n = len(chosen) * cfg.rollout.group_size
    steps = schedule.sigmas.numel() - 1
    start = time.perf_counter()
    desc = f"rollout {round_index}: {n} traj x {steps} steps"
    with tqdm(
        total=len(range(n)[distributed.shard(n, ranks)]) * steps, unit="step", desc=desc,
        leave=False, disable=not ranks.is_main,
    ) as bar:  # fmt: skip
        result = rounds.rollout_round(
            policy.backend,
            prompts,
            chosen,
            schedule,
            cfg,
            method=cfg.train.method,
            seed=cfg.train.seed,
            round_index=round_index,
            run_id=run.name,
            model_version=f"{run.name}@{round_index}",
            counter=counter,
            progress=bar,
            ranks=ranks,
        )
    shards = distributed.gather_objects(result, ranks)
    seconds = time.perf_counter() - start
    if ranks.is_main:  # one writer per round: the shards gathered
        write_rollout(run / "rollouts", RoundRollout.concat(shards), overwrite=True)
    distributed.barrier(ranks)
    nfe = float(distributed.all_reduce(torch.tensor(float(counter.nfe)), ranks))
    return {
        "time/rollout_s": seconds,
        "cost/rollout_nfe": nfe,
        "perf/trajectories_per_s": n / seconds,
        "perf/nfe_per_s": nfe / seconds,
    }
