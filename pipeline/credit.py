"""Credit assignment: per-trajectory / per-step advantages for the three methods.

N trajectories, K SDE (trainable) steps in denoising order, group_ids (N,) integer ids marking
prompt groups (any values, any order: groups need not be contiguous). Every normalization is
(x − mean) / (std + 1e-4) with the population std (ddof 0), clipped to ±clip (Flow-GRPO, Liu et al.
2025). All math is fp32; outputs are fp32. Non-finite inputs raise ValueError naming the first
offending trajectory, so a round stops before anything is written.

Methods (DESIGN.md table):
- ``flow_grpo``: the final reward, normalized per prompt group, used for every step.
- ``stepwise`` (Savani et al. 2026): gains g_k = r_{k+1} − r_k of the reward of the x̂0 estimate
  at consecutive window boundary states; joint normalization pools all N_g·K gains of a group
  (mean-centred and scaled together, which keeps the larger early gains large), ``per_step``
  normalizes each column per group (the paper's ablation). ``final_steps`` = n > 0 gives the
  last n trained steps flow_grpo's final-reward advantage instead (a hybrid rule: the gains where
  they track the true per-step advantage better, the final reward at the last steps, where only
  the ODE follows and the final reward is exact up to the earlier steps' luck).
- ``tp_grpo`` (Tong et al. 2026, TurningPoint-GRPO): incremental rewards d_k = R_k − R_{k−1} of ODE
  completions, replaced at turning points by the aggregated R_sde − R_{k−1}; normalized per step
  per group.
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-4
NORMALIZATIONS = ("joint", "per_step")


def flow_grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, global_std: bool, clip: float = 5.0
) -> Tensor:
    """(r − group mean) / (std + 1e-4), std of the group or, with ``global_std``, of all N.

    rewards: (N,); group_ids: (N,) integer. Returns (N,) fp32 clipped to ±clip.
    """
    rewards = _as_column(rewards, "reward")  # (N, 1)
    inverse, n_groups = _group_index(group_ids, rewards.shape[0])
    mean, std = _group_moments(rewards, inverse, n_groups, pool_columns=True)
    if global_std:
        std = rewards.std(correction=0).expand_as(rewards)
    return _finish(rewards - mean, std, clip)[:, 0]


def stepwise_gains(step_rewards: Tensor) -> Tensor:
    """g_k = r_{k+1} − r_k: (N, K+1) rewards, noisiest state first → (N, K) fp32 gains.

    The gains of a trajectory telescope: their sum is r_K − r_0 (final minus first estimate).
    """
    step_rewards = _as_matrix(step_rewards, "step reward", min_columns=2)
    return step_rewards[:, 1:] - step_rewards[:, :-1]  # (N, K)


def stepwise_advantages(
    step_rewards: Tensor,
    group_ids: Tensor,
    *,
    normalization: str = "joint",
    clip: float = 5.0,
) -> Tensor:
    """Normalized stepwise gains (Savani et al. 2026, Stepwise-Flow-GRPO).

    step_rewards: (N, K+1) rewards of the x̂0 estimates at the K+1 window boundary states,
    noisiest first, last = final image; group_ids: (N,). ``joint``: one mean/std over all N_g·K
    gains of a prompt group; ``per_step``: mean/std per column per group. Returns (N, K) fp32,
    clipped to ±clip.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    gains = stepwise_gains(step_rewards)  # (N, K)
    inverse, n_groups = _group_index(group_ids, gains.shape[0])
    mean, std = _group_moments(gains, inverse, n_groups, pool_columns=normalization == "joint")
    return _finish(gains - mean, std, clip)


def stepwise_hybrid_advantages(
    step_rewards: Tensor,
    final_advantages: Tensor,
    group_ids: Tensor,
    *,
    final_steps: int,
    normalization: str = "joint",
    clip: float = 5.0,
) -> Tensor:
    """Stepwise advantages on the first K − n trained steps, the final reward's on the last n.

    step_rewards: (N, K+1) as in :func:`stepwise_advantages`; final_advantages: (N,), the
    :func:`flow_grpo_advantages` of the final reward; final_steps: n, 0 ≤ n < K. The first K − n
    gains are normalized among themselves (their own joint or per-step statistics), so every step
    keeps an advantage of unit scale; n = 0 is :func:`stepwise_advantages` exactly. Returns
    (N, K) fp32.
    """
    k = _as_matrix(step_rewards, "step reward", min_columns=2).shape[1] - 1
    if not 0 <= final_steps < k:
        raise ValueError(
            f"final_steps must leave at least one of the {k} trained steps its gain "
            f"(0 <= final_steps < {k}), got {final_steps}"
        )
    final = _as_column(final_advantages, "final advantage")  # (N, 1)
    if final.shape[0] != step_rewards.shape[0]:
        raise ValueError(
            f"final_advantages has {final.shape[0]} rows, step_rewards {step_rewards.shape[0]}"
        )
    early = stepwise_advantages(
        step_rewards[:, : k - final_steps + 1], group_ids, normalization=normalization, clip=clip
    )  # (N, K − n)
    return torch.cat([early, final.expand(-1, final_steps)], dim=1)


def tp_grpo_turning_points(
    final_reward: Tensor,
    completion_rewards: Tensor,
    *,
    consistency: bool = True,
    first_step: bool = True,
    balance: bool = True,
) -> Tensor:
    """Turning-point mask of TP-GRPO (Tong et al. 2026), official-code defaults.

    final_reward: (N,) R_sde of the SDE sample; completion_rewards: (N, K+1), column 0 = R_0 (pure
    ODE from x_T), column k = R_k (ODE completion after k SDE steps). Returns (N, K) bool; column
    k − 1 is step k (1-based as in DESIGN.md). With d_k = R_k − R_{k−1}, Δ = R_sde − R_0,
    s_k = sign(d_k)·sign(Δ) and "consistent" meaning sign(d_k)·sign(R_sde − R_k) > 0:

    - k ≥ 2: s_{k−1} < 0 and s_k > 0, and (``consistency``) consistent.
    - k = 1 (only with ``first_step``): consistent (``consistency``) or s_1 > 0 (without).
    - ``balance``: over the whole batch, split the turning points by the sign of their
      trajectory's Δ and keep min(#pos, #neg) of each side, largest |Δ| first (ties: lower
      trajectory, then earlier step). If a side is empty all are kept; with both sides non-empty a
      turning point whose Δ is exactly 0 belongs to neither and is dropped.
    """
    final, completions = _tp_inputs(final_reward, completion_rewards)
    increments = completions[:, 1:] - completions[:, :-1]  # d, (N, K)
    delta = final - completions[:, 0]  # Δ, (N,)
    trend = increments.sign() * delta.sign()[:, None]  # s, (N, K)
    consistent = increments.sign() * (final[:, None] - completions[:, 1:]).sign() > 0  # (N, K)

    turning = torch.zeros_like(increments, dtype=torch.bool)  # (N, K)
    turning[:, 1:] = (trend[:, :-1] < 0) & (trend[:, 1:] > 0)
    if consistency:
        turning[:, 1:] &= consistent[:, 1:]
    if first_step:
        turning[:, 0] = consistent[:, 0] if consistency else trend[:, 0] > 0
    return _balance(turning, delta) if balance else turning


def tp_grpo_step_rewards(
    final_reward: Tensor, completion_rewards: Tensor, turning_points: Tensor
) -> Tensor:
    """TP-GRPO step rewards: d_k, or R_sde − R_{k−1} at a (kept) turning point.

    final_reward: (N,); completion_rewards: (N, K+1) as in :func:`tp_grpo_turning_points`;
    turning_points: (N, K) bool, that function's mask. Returns (N, K) fp32.
    """
    final, completions = _tp_inputs(final_reward, completion_rewards)
    increments = completions[:, 1:] - completions[:, :-1]  # d_k, (N, K)
    if turning_points.shape != increments.shape:
        raise ValueError(
            f"turning points {tuple(turning_points.shape)} do not match the "
            f"{tuple(increments.shape)} steps of the completion rewards"
        )
    aggregated = final[:, None] - completions[:, :-1]  # R_sde − R_{k−1}, (N, K)
    return torch.where(turning_points, aggregated, increments)


def tp_grpo_advantages(step_rewards: Tensor, group_ids: Tensor, *, clip: float = 5.0) -> Tensor:
    """Per-step, per-prompt-group normalization of TP-GRPO step rewards.

    step_rewards: (N, K); group_ids: (N,). Returns (N, K) fp32 clipped to ±clip.
    """
    step_rewards = _as_matrix(step_rewards, "step reward")
    inverse, n_groups = _group_index(group_ids, step_rewards.shape[0])
    mean, std = _group_moments(step_rewards, inverse, n_groups, pool_columns=False)
    return _finish(step_rewards - mean, std, clip)


def _group_index(group_ids: Tensor, n: int) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids (N,) to dense indices 0..G−1; return (indices, G)."""
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_moments(
    values: Tensor, inverse: Tensor, n_groups: int, *, pool_columns: bool
) -> tuple[Tensor, Tensor]:
    """Group mean and population std of ``values`` (N, C), broadcast back to (N, C).

    Statistics per (group, column), or per group over all its N_g·C entries with
    ``pool_columns``. Two-pass (centre, then square) for accuracy.
    """
    counts = torch.bincount(inverse, minlength=n_groups).to(values.dtype)[:, None]  # (G, 1)
    if pool_columns:
        counts = counts * values.shape[1]

    def group_mean(x: Tensor) -> Tensor:  # (N, C) -> (N, C or 1)
        sums = x.new_zeros(n_groups, x.shape[1]).index_add_(0, inverse, x)  # (G, C)
        if pool_columns:
            sums = sums.sum(dim=1, keepdim=True)  # (G, 1)
        return (sums / counts)[inverse]

    mean = group_mean(values)
    std = group_mean((values - mean).square()).sqrt()
    return mean.expand_as(values), std.expand_as(values)


def _finish(centred: Tensor, std: Tensor, clip: float) -> Tensor:
    """centred / (std + eps), clipped to ±clip, checked finite."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    advantages = (centred / (std + EPS)).clamp(-clip, clip)
    _check_finite(advantages, "advantage")
    return advantages


def _tp_inputs(final_reward: Tensor, completion_rewards: Tensor) -> tuple[Tensor, Tensor]:
    final = _as_column(final_reward, "final reward")[:, 0]  # (N,)
    completions = _as_matrix(completion_rewards, "completion reward", min_columns=2)  # (N, K+1)
    if completions.shape[0] != final.shape[0]:
        raise ValueError(
            f"final_reward has {final.shape[0]} rows, completion_rewards {completions.shape[0]}"
        )
    return final, completions


def _balance(turning: Tensor, delta: Tensor) -> Tensor:
    """Keep min(#pos, #neg) turning points per sign of Δ, largest |Δ| first; see caller."""
    delta_at = delta[:, None].expand_as(turning)  # (N, K)
    positive, negative = turning & (delta_at > 0), turning & (delta_at < 0)
    n_positive, n_negative = int(positive.sum()), int(negative.sum())
    if n_positive == 0 or n_negative == 0:
        return turning
    keep = min(n_positive, n_negative)
    magnitude = delta_at.abs().flatten()  # (N·K,)

    def largest(side: Tensor) -> Tensor:
        candidates = side.flatten().nonzero().squeeze(1)  # row-major (trajectory, step) order
        order = torch.sort(magnitude[candidates], descending=True, stable=True).indices
        kept = torch.zeros_like(side.flatten())
        kept[candidates[order[:keep]]] = True
        return kept.view_as(side)

    return largest(positive) | largest(negative)


def _as_column(values: Tensor, what: str) -> Tensor:
    """(N,) rewards as an fp32 (N, 1) matrix, checked finite."""
    if values.ndim != 1:
        raise ValueError(f"{what}s must be (N,), got {tuple(values.shape)}")
    return _as_matrix(values[:, None], what)


def _as_matrix(values: Tensor, what: str, *, min_columns: int = 1) -> Tensor:
    """(N, C) rewards as an fp32 matrix, checked finite."""
    if values.ndim != 2 or values.shape[0] == 0 or values.shape[1] < min_columns:
        raise ValueError(f"{what}s must be (N, C>={min_columns}), got {tuple(values.shape)}")
    values = values.float()
    _check_finite(values, what)
    return values


def _check_finite(values: Tensor, what: str) -> None:
    """Raise ValueError naming the first trajectory (row) holding a NaN/inf."""
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        value = float(values[row, column])
        where = f" (column {column})" if values.shape[1] > 1 else ""
        raise ValueError(f"{what} of trajectory {row} is {value}{where}")
