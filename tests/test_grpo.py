"""GRPO update: the PPO-clip loss by hand, LoRA-only training, and on-policy log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline import rounds
from pipeline.config import load_config
from pipeline.grpo import (
    UpdateBatch,
    adapters_disabled,
    kl_to_reference,
    lora_parameters,
    pair_terms,
    ppo_clip_loss,
)
from pipeline.layout import load_prompts
from pipeline.policy import Policy


def test_ppo_clip_loss_by_hand():
    # ratios e^0.1 ≈ 1.10517 and e^-0.1 ≈ 0.904837, clip range 0.05.
    new = torch.tensor([0.1, 0.1, -0.1, -0.1])
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = ppo_clip_loss(new, old, adv, clip_range=0.05)
    # A>0, r>1+ε: max(-1.10517, -1.05) = -1.05;  A<0, r>1+ε: max(1.10517, 1.05) = 1.10517
    # A>0, r<1-ε: max(-0.904837, -0.95) = -0.904837;  A<0, r<1-ε: max(0.904837, 0.95) = 0.95
    expected = torch.tensor([-1.05, math.exp(0.1), -math.exp(-0.1), 0.95])
    torch.testing.assert_close(loss, expected)
    assert stats["clipped"].tolist() == [True] * 4
    torch.testing.assert_close(stats["approx_kl"], torch.full((4,), 0.005))


def test_kl_to_reference_by_hand():
    mean = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    std = torch.tensor([2.0, 1.0])
    # row 0: mean((1, 4)) = 2.5, / (2 * 4) = 0.3125; row 1: 0
    torch.testing.assert_close(kl_to_reference(mean, ref, std), torch.tensor([0.3125, 0.0]))


@pytest.fixture
def tiny(tiny_project):
    cfg = load_config(tiny_project / "params.yaml")
    policy = Policy.create(cfg)
    schedule = rounds.Schedule.from_config(cfg)
    prompts = load_prompts(cfg, "train")
    result = rounds.rollout_round(
        policy.backend, prompts, [0, 5], schedule, cfg, method="flow_grpo", seed=0,
        round_index=0, run_id="t", model_version="t",
        counter=rounds.CountingVelocity(policy.backend, cfg.sampling.guidance),
    )  # fmt: skip
    return cfg, policy, schedule, result


def _batch(policy, result, schedule, advantages):
    return UpdateBatch(
        states=result.states,
        log_probs=result.log_probs,
        sigmas=result.sigmas,
        steps=schedule.steps,
        advantages=advantages,
        embeds=policy.backend.encode_prompts(result.prompts),
    )


def test_recomputed_log_probs_are_on_policy_for_every_step(tiny):
    cfg, policy, schedule, result = tiny
    n, k = result.num_trajectories, schedule.steps.numel()
    batch = _batch(policy, result, schedule, torch.zeros(n, k))
    traj, col = batch.pairs()
    settings = rounds.update_settings(cfg, schedule)
    log_prob, old, *_ = pair_terms(policy.backend, batch, traj, col, settings)
    ratio = torch.exp(log_prob - old)
    assert ratio.shape == (n * k,)
    assert (ratio - 1).abs().max() < 1e-6


def test_update_changes_only_lora_and_reference_stays_base(tiny):
    cfg, policy, schedule, result = tiny
    transformer = policy.backend.transformer
    before = {name: p.detach().clone() for name, p in transformer.named_parameters()}
    text_before = [p.detach().clone() for p in policy.backend.text_encoder.parameters()]
    x, sigma = result.states[:, 1], result.sigmas[1].expand(result.num_trajectories)
    embeds = policy.backend.encode_prompts(result.prompts)
    with torch.no_grad():
        v_base = policy.backend.velocity(x, sigma, embeds, guidance=cfg.sampling.guidance)

    advantages = torch.randn(
        result.num_trajectories, schedule.steps.numel(), generator=torch.Generator().manual_seed(0)
    )
    metrics = rounds.update_round(
        policy.backend, policy.optimizer, result, advantages, schedule, cfg, seed=0, round_index=0
    )
    assert metrics["train/ratio_dev_first"] < 1e-6
    changed = {n for n, p in transformer.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "the update changed nothing"
    assert all("lora_" in name for name in changed)
    assert any("lora_B" in name for name in changed)
    assert all(
        torch.equal(a, b)
        for a, b in zip(text_before, policy.backend.text_encoder.parameters(), strict=True)
    )
    assert len(lora_parameters(transformer)) > 0
    with torch.no_grad():
        v_policy = policy.backend.velocity(x, sigma, embeds, guidance=cfg.sampling.guidance)
        with adapters_disabled(transformer):
            v_ref = policy.backend.velocity(x, sigma, embeds, guidance=cfg.sampling.guidance)
    assert torch.equal(v_ref, v_base)
    assert not torch.equal(v_policy, v_base)
