"""`rescore` stage: score existing rollouts with another reward mix, without sampling again.

Reads `<rollouts>` (a rollout cache, e.g. `data/train/flow_grpo-s0/rollouts`) and never writes
to it; refuses params that sample differently from the run's record and rounds without a
manifest before any work; writes the new score tables of every round to a temporary directory
that replaces `<out>` (`<out>/scores/round=<r>/`) only when all are done, then compares the new
reward with the one the rollouts were trained on: per-state Spearman rank correlation across
trajectories, and the share of (trajectory, step) advantages whose sign flips. The comparison
goes to `reports/rescore/summary.{json,md}` and MLflow. Under `accelerate launch` every rank
scores its shard of each round's trajectories; the main rank compares and writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from scipy.stats import spearmanr

from pipeline import distributed, layout, rounds
from pipeline.config import Config, ConfigError, check_reward_mix
from pipeline.io import atomic_path, write_json, write_text
from pipeline.policy import check_same_sampling, load_backend, restore
from pipeline.rewards import RewardMix, parse_mix
from pipeline.tracking import log_metrics
from pipeline.trajectories import (
    STEPS,
    cached_rounds,
    list_rounds,
    read_rollout,
    read_scores,
    write_scores,
)


def reward_mix(text: str) -> dict[str, float]:
    try:
        return check_reward_mix(parse_mix(text))
    except ValueError as exc:
        raise ConfigError(f"--rewards: {exc}") from None


def rank_agreement(old, new) -> dict[str, float]:
    """Spearman ρ between old and new "mix" values at each (estimator, state), over trajectories."""
    key = ["estimator", "step", "trajectory"]
    both = old[old.reward == "mix"].merge(
        new[new.reward == "mix"], on=key, suffixes=("_old", "_new")
    )
    rho = {}
    for (estimator, step), rows in both.groupby(["estimator", "step"]):
        if rows.value_old.nunique() > 1 and rows.value_new.nunique() > 1:
            rho[f"spearman/{estimator}_state{step}"] = float(
                spearmanr(rows.value_old, rows.value_new)[0]
            )
    return rho


@task(name="rescore", cache_policy=NO_CACHE)
def rescore(cfg: Config, rollouts: Path, rewards: str, out: Path) -> dict[str, float]:
    rollouts, out = cfg.path(rollouts), cfg.path(out)
    mix = RewardMix(cfg, reward_mix(rewards))
    run = rollouts.parent
    check_same_sampling(cfg, run)  # before any work: the scores must match the rollouts
    done = list_rounds(rollouts, STEPS)
    if not done:
        raise ConfigError(f"--rollouts: no complete round with cached states under {rollouts}")
    if incomplete := sorted(set(cached_rounds(rollouts, STEPS)) - set(done)):
        raise ConfigError(
            f"--rollouts: round {incomplete[0]} under {rollouts} has no manifest (an interrupted "
            "write?); finish or remove that round first"
        )
    ranks = distributed.current()
    scored = _new_scores(cfg, run, rollouts, done, mix, ranks)
    if not ranks.is_main:
        for _ in scored:  # its shard of every round
            pass
        return {}
    # all rounds into a temporary directory, swapped in at the end: `out` never mixes rewards
    with atomic_path(out) as tmp:
        summary, rhos = _compare(cfg, rollouts, scored, tmp)
    report = cfg.path(layout.REPORTS / "rescore")
    write_json(report / "summary.json", summary | {"rollouts": str(rollouts), "rewards": rewards})
    write_text(report / "summary.md", _markdown(rollouts, rewards, summary, rhos[-1]))
    log_metrics({k: v for k, v in summary.items() if "/" not in k})
    return summary


def _new_scores(
    cfg: Config, run: Path, rollouts: Path, done: list[int], mix: RewardMix, ranks
) -> Iterator[tuple[int, object, rounds.Schedule, object]]:
    """(round, rollout, schedule, new score table) of every round in `done`, scored with `mix`
    by the policy that sampled it (over several ranks, each scores a shard; all get the table)."""
    for r in done:
        rollout = read_rollout(rollouts, r)
        has_checkpoints = (run / "checkpoints").is_dir()
        backend = (
            restore(cfg, run, before_round=r).backend if has_checkpoints else load_backend(cfg)
        )
        schedule = rounds.Schedule.of_rollout(rollout, cfg)
        new = rounds.score_round(
            backend, rollout, layout.trajectory_metadata(cfg, rollout), mix, cfg,
            estimators=rounds.estimators_for(rollout.method, cfg), schedule=schedule,
            counter=rounds.CountingVelocity(backend, cfg.sampling.guidance), ranks=ranks,
        ).table  # fmt: skip
        yield r, rollout, schedule, new


def _compare(
    cfg: Config, rollouts: Path, scored: Iterator, out: Path
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Write each round's new scores into `out`; the summary and per-round Spearman ρ against
    the scores the rounds were trained on."""
    summary: dict[str, float] = {}
    flips, rhos = [], []
    for r, rollout, schedule, new in scored:
        rounds.check_finite(new)
        write_scores(out, r, new)
        old = read_scores(rollouts, r).drop(columns="round")
        old_adv = rounds.assign_credit(rollout.method, old, rollout.group_ids, schedule, cfg)
        new_adv = rounds.assign_credit(rollout.method, new, rollout.group_ids, schedule, cfg)
        flips.append(
            float((torch.sign(old_adv.advantages) != torch.sign(new_adv.advantages)).float().mean())
        )
        rho = rank_agreement(old, new)
        rhos.append(rho)
        summary[f"round{r}/sign_flips"] = flips[-1]
    summary["sign_flip_share"] = float(np.mean(flips))
    finals = [v for rho in rhos for k, v in rho.items() if k.startswith("spearman/final")]
    summary["spearman_final"] = float(np.mean(finals)) if finals else float("nan")
    steps = [v for rho in rhos for k, v in rho.items() if not k.startswith("spearman/final")]
    summary["spearman_steps"] = float(np.mean(steps)) if steps else float("nan")
    return summary, rhos


def _markdown(rollouts: Path, rewards: str, summary: dict, last_rho: dict) -> str:
    lines = [
        "# Re-scoring",
        "",
        f"Rollouts `{rollouts}` re-scored with `{rewards}` (rollout files untouched).",
        "",
        f"- advantages whose sign flips: **{summary['sign_flip_share']:.1%}**",
        f"- Spearman ρ of final rewards (mean over rounds): {summary['spearman_final']:.3f}",
        f"- Spearman ρ of intermediate estimates (mean): {summary['spearman_steps']:.3f}",
        "",
        "| estimate at state (last round) | Spearman ρ old vs new |",
        "|---|---|",
        *[
            f"| {key.removeprefix('spearman/')} | {value:.3f} |"
            for key, value in sorted(last_rho.items())
        ],
        "",
    ]
    return "\n".join(lines)
