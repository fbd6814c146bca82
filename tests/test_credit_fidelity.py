"""The credit-fidelity benchmark's statistics (`benchmarks/credit_fidelity.py`): correlations
of group-centred advantages, whole-group resamples, the Monte Carlo noise correction."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.credit_fidelity import centred, fidelity, group_resamples, step_correlations

GROUPS = torch.tensor([0, 0, 1, 1])


def test_correlations_are_of_values_centred_per_group_by_hand():
    rule = torch.tensor([[1.0, 3.0], [-1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
    truth = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 5.0], [0.0, 3.0]])
    # centred: rule [1, -1, 1, -1] and [1, -1, -1, 1]; truth [1, -1, .5, -.5] and [-.5, .5, 1, -1]
    assert centred(rule, GROUPS)[:, 0].tolist() == [1.0, -1.0, 1.0, -1.0]
    rho = step_correlations(centred(rule, GROUPS), centred(truth, GROUPS))
    assert rho[0].item() == pytest.approx(3 / (2 * math.sqrt(2.5)))  # 3 / (|rule| |truth|)
    assert rho[1].item() == pytest.approx((-0.5 - 0.5 - 1 - 1) / (2 * math.sqrt(2.5)))
    assert rho[2].item() == pytest.approx(0.0)  # pooled: the two steps' products cancel


def test_a_rule_that_is_the_true_advantage_up_to_scale_and_group_offsets_scores_one():
    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(6).repeat_interleave(8)
    truth = torch.randn(48, 3, generator=gen)
    offsets = torch.randn(6, 3, generator=gen)[groups]  # what a group's baseline removes
    noisy = truth + 0.5 * torch.randn(48, 3, generator=gen)
    rules = {"reference": noisy, "exact": 2.0 * truth + offsets}
    result = fidelity(rules, truth, (truth, truth), groups, group_resamples(groups, 50, seed=0))
    exact = result["rules"]["exact"]
    assert exact["rho"] == pytest.approx([1.0] * 4)
    assert [end for ci in exact["rho_ci95"] for end in ci] == pytest.approx([1.0] * 8)
    assert result["reliability"] == pytest.approx([1.0] * 4)  # identical halves: no noise
    assert exact["rho_corrected"] == pytest.approx(exact["rho"])
    reference = result["rules"]["reference"]["rho"]
    assert exact["minus_reference"] == pytest.approx([1 - r for r in reference])
    assert all(lo > 0 for lo, _ in exact["minus_reference_ci95"])
    assert "minus_reference" not in result["rules"]["reference"]


def test_the_correction_recovers_the_correlation_with_the_noise_free_advantage():
    """A rule that is exactly A*, scored against a Monte Carlo A* as noisy as A* itself: the
    measured ρ falls to about √(reliability) ≈ 0.71, the corrected one is about 1 again."""
    gen = torch.Generator().manual_seed(1)
    groups = torch.arange(200).repeat_interleave(8)
    exact = torch.randn(1600, 2, generator=gen)
    halves = tuple(exact + 2**0.5 * torch.randn(1600, 2, generator=gen) for _ in range(2))
    measured = (halves[0] + halves[1]) / 2  # noise variance (2 + 2) / 4 = 1 = the signal's
    resamples = group_resamples(groups, 10, seed=0)
    result = fidelity({"rule": exact}, measured, halves, groups, resamples)
    rule = result["rules"]["rule"]
    assert result["reliability"] == pytest.approx([0.5] * 3, abs=0.05)
    assert rule["rho"] == pytest.approx([0.5**0.5] * 3, abs=0.05)
    assert rule["rho_corrected"] == pytest.approx([1.0] * 3, abs=0.05)


def test_resamples_draw_whole_prompt_groups():
    groups = torch.tensor([3, 3, 3, 7, 7, 7, 9, 9, 9])
    for rows in group_resamples(groups, 20, seed=2):
        drawn = groups[rows]
        assert rows.numel() == 9
        for start in range(0, 9, 3):  # each block of three rows is one whole group
            assert sorted(rows[start : start + 3].tolist()) == sorted(
                (groups == drawn[start]).nonzero().flatten().tolist()
            )
