"""`advantages` stage: per-method credit assignment from a round's score table.

Writes `<run>/advantages/round=<r>.parquet`: one row per (trajectory, trained step) with the
advantage, the per-step signal, the turning-point flag and flow_grpo's final-reward advantage.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout, rounds
from pipeline.config import Config
from pipeline.io import atomic_path
from pipeline.trajectories import advantages_file, read_rollout, read_scores


def credit_table(
    credit: rounds.Credit, steps: torch.Tensor, group_ids: torch.Tensor
) -> pd.DataFrame:
    n, k = credit.advantages.shape
    return pd.DataFrame(
        {
            "trajectory": torch.arange(n).repeat_interleave(k).numpy(),
            "group_id": group_ids.repeat_interleave(k).numpy(),
            "k": torch.arange(k).repeat(n).numpy(),
            "step": steps.repeat(n).numpy(),
            "advantage": credit.advantages.flatten().numpy(),
            "step_reward": credit.step_rewards.flatten().numpy(),
            "turning_point": credit.turning_points.flatten().numpy(),
            "final_advantage": credit.final_advantages.repeat_interleave(k).numpy(),
        }
    )


@task(name="advantages", cache_policy=NO_CACHE)
def advantages(cfg: Config, run: Path | None = None, round_index: int = 0) -> dict[str, float]:
    run = Path(run) if run else layout.train_run(cfg)
    rollout = read_rollout(run / "rollouts", round_index)
    schedule = rounds.Schedule.of_rollout(rollout, cfg)
    try:
        credit = rounds.assign_credit(
            rollout.method, read_scores(run / "rollouts", round_index), rollout.group_ids,
            schedule, cfg,
        )  # fmt: skip
    except ValueError as exc:  # non-finite values, named by pipeline.credit
        raise rounds.RoundError(f"round {round_index}: {exc}") from exc
    table = credit_table(credit, schedule.steps, rollout.group_ids)
    with atomic_path(advantages_file(run, round_index)) as tmp:
        table.to_parquet(tmp, compression="zstd", index=False)
    sign_flip = torch.sign(credit.advantages) != torch.sign(credit.final_advantages)[:, None]
    metrics = {
        "credit/advantage_abs_mean": float(credit.advantages.abs().mean()),
        "credit/sign_differs_from_final": float(sign_flip.float().mean()),
        "credit/turning_point_rate": float(credit.turning_points.float().mean()),
    }
    for k, step in enumerate(schedule.steps.tolist()):
        metrics[f"credit/abs_step_reward_step{step}"] = float(
            credit.step_rewards[:, k].abs().mean()
        )
    return metrics
