"""Credit assignment against hand-computed values (rewards chosen dyadic, so exact in fp32)."""

import math

import pytest
import torch

from pipeline.credit import (
    flow_grpo_advantages,
    stepwise_advantages,
    stepwise_gains,
    stepwise_hybrid_advantages,
    tp_grpo_advantages,
    tp_grpo_step_rewards,
    tp_grpo_turning_points,
)

EPS = 1e-4


def t(values):
    return torch.tensor(values, dtype=torch.float32)


# Two prompt groups, non-contiguous and not numbered from 0: group 7 = rows 0, 2; group 3 = rows
# 1, 3, 4.
GROUPS = torch.tensor([7, 3, 7, 3, 3])
REWARDS = t([1.0, 0.0, 3.0, 2.0, 4.0])


def test_flow_grpo_group_std():
    # group 7: {1, 3}, mean 2, std 1. group 3: {0, 2, 4}, mean 2, std sqrt(8/3).
    s7, s3 = 1.0 + EPS, math.sqrt(8 / 3) + EPS
    expected = t([-1 / s7, -2 / s3, 1 / s7, 0.0, 2 / s3])
    got = flow_grpo_advantages(REWARDS, GROUPS, global_std=False)
    torch.testing.assert_close(got, expected)


def test_flow_grpo_global_std():
    # all five rewards: mean 2, population variance (1 + 4 + 1 + 0 + 4) / 5 = 2.
    s = math.sqrt(2) + EPS
    expected = t([-1 / s, -2 / s, 1 / s, 0.0, 2 / s])
    got = flow_grpo_advantages(REWARDS, GROUPS, global_std=True)
    torch.testing.assert_close(got, expected)


def test_flow_grpo_clips():
    # 29 zeros and one 1: advantage (29/30) / (sqrt(29)/30 + eps) = 5.38 > 5.
    rewards = torch.zeros(30)
    rewards[4] = 1.0
    groups = torch.zeros(30, dtype=torch.long)
    assert 29 / (math.sqrt(29) + 30 * EPS) > 5
    got = flow_grpo_advantages(rewards, groups, global_std=False)
    assert got[4] == 5.0
    torch.testing.assert_close(got[0], torch.tensor(-(1 / 30) / (math.sqrt(29) / 30 + EPS)))
    assert flow_grpo_advantages(rewards, groups, global_std=False, clip=100.0)[4] > 5.38


def test_flow_grpo_constant_group_is_zero():
    got = flow_grpo_advantages(
        t([0.5, 0.5, 0.5]), torch.zeros(3, dtype=torch.long), global_std=False
    )
    assert torch.equal(got, torch.zeros(3))


def test_stepwise_gains_telescope():
    step_rewards = torch.rand(6, 5, generator=torch.Generator().manual_seed(0))
    gains = stepwise_gains(step_rewards)
    assert gains.shape == (6, 4)
    torch.testing.assert_close(gains.sum(1), step_rewards[:, -1] - step_rewards[:, 0])


# One group of two trajectories, K = 2: A = [0, 1, 3] -> gains [1, 2]; B = [0, 3, 3] -> [3, 0].
STEP_REWARDS = t([[0.0, 1.0, 3.0], [0.0, 3.0, 3.0]])
ONE_GROUP = torch.tensor([0, 0])


def test_stepwise_joint_normalization():
    # all four gains {1, 2, 3, 0}: mean 1.5, population variance 1.25.
    s = math.sqrt(1.25) + EPS
    expected = t([[-0.5 / s, 0.5 / s], [1.5 / s, -1.5 / s]])
    got = stepwise_advantages(STEP_REWARDS, ONE_GROUP, normalization="joint")
    torch.testing.assert_close(got, expected)


def test_stepwise_per_step_normalization():
    # column 1: {1, 3}, mean 2, std 1; column 2: {2, 0}, mean 1, std 1.
    s = 1.0 + EPS
    expected = t([[-1 / s, 1 / s], [1 / s, -1 / s]])
    got = stepwise_advantages(STEP_REWARDS, ONE_GROUP, normalization="per_step")
    torch.testing.assert_close(got, expected)


def test_stepwise_groups_are_separate():
    # Stacking a second group (ids swapped in order) leaves each group's advantages unchanged.
    other = t([[1.0, 1.0, 2.0], [1.0, 2.0, 2.0]])
    both = stepwise_advantages(
        torch.cat([other, STEP_REWARDS]), torch.tensor([5, 5, 2, 2]), normalization="joint"
    )
    torch.testing.assert_close(both[2:], stepwise_advantages(STEP_REWARDS, ONE_GROUP))
    torch.testing.assert_close(both[:2], stepwise_advantages(other, ONE_GROUP))


def test_stepwise_rejects_unknown_normalization():
    with pytest.raises(ValueError, match="normalization"):
        stepwise_advantages(STEP_REWARDS, ONE_GROUP, normalization="global")


def test_stepwise_hybrid_gives_the_last_steps_the_final_advantage():
    # K = 3: the first two gains are STEP_REWARDS' ([1, 2] and [3, 0]), normalized jointly among
    # themselves (the joint case above); the last step takes the final reward's advantage.
    step_rewards = torch.cat([STEP_REWARDS, t([[2.0], [5.0]])], dim=1)
    final = t([-0.75, 0.75])
    got = stepwise_hybrid_advantages(step_rewards, final, ONE_GROUP, final_steps=1)
    expected = stepwise_advantages(STEP_REWARDS, ONE_GROUP, normalization="joint")
    torch.testing.assert_close(got, torch.cat([expected, final[:, None]], dim=1))
    two = stepwise_hybrid_advantages(step_rewards, final, ONE_GROUP, final_steps=2)
    torch.testing.assert_close(two[:, 1:], final[:, None].expand(2, 2))  # one gain: ±1
    torch.testing.assert_close(two[:, 0], t([-1.0, 1.0]) / (1.0 + EPS))


def test_stepwise_hybrid_without_final_steps_is_the_papers_rule():
    step_rewards = torch.rand(6, 4, generator=torch.Generator().manual_seed(1))
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for normalization in ("joint", "per_step"):
        assert torch.equal(
            stepwise_hybrid_advantages(
                step_rewards, torch.ones(6), groups, final_steps=0, normalization=normalization
            ),
            stepwise_advantages(step_rewards, groups, normalization=normalization),
        )


@pytest.mark.parametrize("final_steps", [-1, 2, 3])
def test_stepwise_hybrid_keeps_at_least_one_gain(final_steps):
    with pytest.raises(ValueError, match=r"0 <= final_steps < 2"):
        stepwise_hybrid_advantages(STEP_REWARDS, t([0.0, 0.0]), ONE_GROUP, final_steps=final_steps)


# TP-GRPO, K = 5. R_0..R_5 = [.5, .25, .125, .625, .75, .875], R_sde = 1: Δ = .5 > 0,
# d = [-.25, -.125, .5, .125, .125], s = [-, -, +, +, +]. k = 3 flips (s_2 < 0 < s_3) and is
# consistent (d_3 > 0, R_sde − R_3 = .375 > 0). k = 1: d_1 < 0 but R_sde − R_1 > 0, not consistent.
FIVE_STEP_FINAL = t([1.0])
FIVE_STEP = t([[0.5, 0.25, 0.125, 0.625, 0.75, 0.875]])


def tp_rewards(final, completions, **switches):
    """Step rewards at the turning points of `switches` (the two calls `assign_credit` makes)."""
    turning = tp_grpo_turning_points(final, completions, **switches)
    return tp_grpo_step_rewards(final, completions, turning)


def test_tp_five_step_turning_point():
    mask = tp_grpo_turning_points(FIVE_STEP_FINAL, FIVE_STEP)
    assert mask.tolist() == [[False, False, True, False, False]]
    rewards = tp_rewards(FIVE_STEP_FINAL, FIVE_STEP)
    # k = 3 gets R_sde − R_2 = 1 − .125; the rest keep d_k.
    assert rewards.tolist() == [[-0.25, -0.125, 0.875, 0.125, 0.125]]


def test_tp_without_turning_points_is_increments():
    # Monotone rise, consistent with Δ > 0 throughout: no flip at k >= 2; with the first-step rule
    # off there is no turning point at all and the step rewards are exactly d_k.
    final, completions = t([1.0]), t([[0.0, 0.25, 0.5, 0.75]])
    assert not tp_grpo_turning_points(final, completions, first_step=False).any()
    assert tp_rewards(final, completions, first_step=False).tolist() == [[0.25, 0.25, 0.25]]


# First-step cases (K = 2), no flips at k = 2:
#   row 0: d_1 = .25 > 0, Δ = .5 > 0, R_sde − R_1 = .25 > 0      -> consistent and s_1 > 0.
#   row 1: d_1 = .5 > 0,  Δ = .25 > 0, R_sde − R_1 = −.25 < 0    -> s_1 > 0 but not consistent.
#   row 2: d_1 = −.25,    Δ = .5,      R_sde − R_1 = .75         -> neither.
FIRST_FINAL = t([1.0, 0.75, 1.0])
FIRST = t([[0.5, 0.75, 0.875], [0.5, 1.0, 1.0], [0.5, 0.25, 0.25]])


def test_tp_first_step_rule():
    on = tp_grpo_turning_points(FIRST_FINAL, FIRST, balance=False)
    assert on[:, 0].tolist() == [True, False, False]
    off = tp_grpo_turning_points(FIRST_FINAL, FIRST, consistency=False, balance=False)
    assert off[:, 0].tolist() == [True, True, False]
    none = tp_grpo_turning_points(FIRST_FINAL, FIRST, first_step=False, balance=False)
    assert not none[:, 0].any()
    # At k = 1 the aggregated reward is R_sde − R_0 = Δ.
    rewards = tp_rewards(FIRST_FINAL, FIRST, consistency=False, balance=False)
    assert rewards[:, 0].tolist() == [0.5, 0.25, -0.25]


def test_tp_consistency_constraint():
    # Δ = .25 > 0, d = [−.25, .75]: k = 2 flips the trend, but overshoots: R_2 = 1 > R_sde = .75,
    # so sign(d_2) = + != sign(R_sde − R_2) = −.
    final, completions = t([0.75]), t([[0.5, 0.25, 1.0]])
    assert tp_grpo_turning_points(final, completions).tolist() == [[False, False]]
    loose = tp_grpo_turning_points(final, completions, consistency=False)
    assert loose.tolist() == [[False, True]]
    assert tp_rewards(final, completions, consistency=False).tolist() == [[-0.25, 0.5]]


# Balancing batch (K = 2), one turning point each, all at k = 2:
#   row 0: Δ = +.5,  d = [−.25, .5],   R_sde − R_2 = .25       (positive side, |Δ| = .5)
#   row 1: Δ = +.25, d = [−.125, .25], R_sde − R_2 = .125      (positive side, |Δ| = .25)
#   row 2: Δ = −.25, d = [.25, −.125], R_sde − R_2 = −.375     (negative side)
BAL_FINAL = t([1.0, 0.75, 0.25])
BAL = t([[0.5, 0.25, 0.75], [0.5, 0.375, 0.625], [0.5, 0.75, 0.625]])


def test_tp_balancing():
    raw = tp_grpo_turning_points(BAL_FINAL, BAL, balance=False)
    assert raw.tolist() == [[False, True], [False, True], [False, True]]
    # min(2 positive, 1 negative) = 1 per side: keep row 0 (larger |Δ|) and row 2.
    kept = tp_grpo_turning_points(BAL_FINAL, BAL)
    assert kept.tolist() == [[False, True], [False, False], [False, True]]
    rewards = tp_rewards(BAL_FINAL, BAL)
    # row 0: R_sde − R_1 = .75; row 1 keeps d_2 = .25; row 2: R_sde − R_1 = −.5.
    assert rewards.tolist() == [[-0.25, 0.75], [-0.125, 0.25], [0.25, -0.5]]


def test_tp_balancing_keeps_all_when_one_side_is_empty():
    positive_only = tp_grpo_turning_points(BAL_FINAL[:2], BAL[:2])
    assert positive_only.tolist() == [[False, True], [False, True]]


def test_tp_advantages_per_step_per_group():
    # group 0 = rows 0, 2; group 1 = rows 1, 3 (interleaved).
    step_rewards = t([[1.0, 0.0], [5.0, 2.0], [3.0, 2.0], [5.0, 4.0]])
    groups = torch.tensor([0, 1, 0, 1])
    s = 1.0 + EPS
    # group 0: column {1, 3} -> mean 2, std 1; column {0, 2} -> mean 1, std 1.
    # group 1: column {5, 5} -> std 0 -> 0; column {2, 4} -> mean 3, std 1.
    expected = t([[-1 / s, -1 / s], [0.0, -1 / s], [1 / s, 1 / s], [0.0, 1 / s]])
    torch.testing.assert_close(tp_grpo_advantages(step_rewards, groups), expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda bad: flow_grpo_advantages(
                bad, torch.zeros(9, dtype=torch.long), global_std=False
            ),
            "reward of trajectory 7 is nan",
        ),
        (
            lambda bad: stepwise_advantages(
                torch.stack([bad, bad], 1), torch.zeros(9, dtype=torch.long)
            ),
            "step reward of trajectory 7 is nan",
        ),
        (
            lambda bad: tp_rewards(bad, torch.zeros(9, 3)),
            "final reward of trajectory 7 is nan",
        ),
        (
            lambda bad: tp_rewards(torch.zeros(9), torch.stack([bad] * 3, 1)),
            "completion reward of trajectory 7 is nan",
        ),
        (
            lambda bad: tp_grpo_advantages(bad[:, None], torch.zeros(9, dtype=torch.long)),
            "step reward of trajectory 7 is nan",
        ),
    ],
)
def test_non_finite_rewards_name_the_trajectory(call, message):
    bad = torch.zeros(9)
    bad[7] = math.nan
    bad[8] = math.inf
    with pytest.raises(ValueError, match=message):
        call(bad)


def test_inf_is_reported_with_its_column():
    step_rewards = torch.zeros(4, 3)
    step_rewards[2, 1] = -math.inf
    with pytest.raises(ValueError, match=r"trajectory 2 is -inf \(column 1\)"):
        stepwise_advantages(step_rewards, torch.zeros(4, dtype=torch.long))


def test_shape_errors():
    with pytest.raises(ValueError, match="group_ids"):
        flow_grpo_advantages(REWARDS, GROUPS[:4], global_std=False)
    with pytest.raises(ValueError, match="integer"):
        flow_grpo_advantages(REWARDS, GROUPS.float(), global_std=False)
    with pytest.raises(ValueError, match="rows"):
        tp_rewards(torch.zeros(3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"turning points \(4, 3\) do not match the \(4, 2\)"):
        tp_grpo_step_rewards(torch.zeros(4), torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(N,\)"):
        flow_grpo_advantages(REWARDS[:, None], GROUPS, global_std=False)
    with pytest.raises(ValueError, match="final_advantages has 3 rows, step_rewards 2"):
        stepwise_hybrid_advantages(STEP_REWARDS, torch.zeros(3), ONE_GROUP, final_steps=1)
