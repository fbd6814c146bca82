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
    reference_means,
)
from pipeline.layout import load_prompts
from pipeline.policy import Policy
from pipeline.sampling import sde_step


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
def tiny(request, tiny_project, tiny_unet_dir):
    """A rollout of the tiny policy: the MMDiT, or the UNet where a test asks for "unet"."""
    unet = [f"model.path={tiny_unet_dir}"] if getattr(request, "param", "") == "unet" else []
    cfg = load_config(tiny_project / "params.yaml", unet)
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


@pytest.mark.parametrize("tiny", ["mmdit", "unet"], indirect=True)
def test_recomputed_log_probs_are_on_policy_for_every_step(tiny):
    cfg, policy, schedule, result = tiny
    n, k = result.num_trajectories, schedule.steps.numel()
    batch = _batch(policy, result, schedule, torch.zeros(n, k))
    traj, col = batch.pairs()
    settings = rounds.update_settings(cfg, schedule)
    reference = reference_means(policy.backend, batch, settings)
    log_prob, old, _, _, kl = pair_terms(policy.backend, batch, traj, col, settings, reference)
    assert kl.abs().max() < 1e-9  # zero-initialised LoRA B: the policy is still the base
    ratio = torch.exp(log_prob - old)
    assert ratio.shape == (n * k,)
    assert (ratio - 1).abs().max() < 1e-6


@pytest.mark.parametrize("tiny", ["mmdit", "unet"], indirect=True)
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


def test_reference_means_are_the_base_policys_step_means(tiny):
    """One no-grad pass per round (any chunking) gives each pair's reference mean, to 1e-5 (fp32
    kernels block a matmul by its batch size: chunks of 3 and one batch of all pairs differ in
    the last bits, up to 1.7e-6 seen at one thread)."""
    cfg, policy, schedule, result = tiny
    backend = policy.backend
    with torch.no_grad():  # move the policy away from the base
        for p in lora_parameters(backend.transformer):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    batch = _batch(
        policy, result, schedule, torch.zeros(result.num_trajectories, schedule.steps.numel())
    )
    settings = rounds.update_settings(cfg, schedule)
    reference = reference_means(backend, batch, settings, chunk=3)
    traj, col = batch.pairs()
    step = schedule.steps[col]
    x, sigma = result.states[traj, step], result.sigmas[step]

    def means():
        v = backend.velocity(x, sigma, batch.embeds[traj], guidance=cfg.sampling.guidance)
        following = result.states[traj, step + 1]
        sigma_next, sigma_max = result.sigmas[step + 1], float(result.sigmas[1])
        return sde_step(
            x, v, sigma, sigma_next, kind=settings.kind, eta=settings.eta, sigma_max=sigma_max,
            prev_sample=following,
        ).mean  # fmt: skip

    with torch.no_grad(), adapters_disabled(backend.transformer):
        base = means()
    with torch.no_grad():
        adapted = means()
    assert reference.shape == (*batch.advantages.shape, *x.shape[1:])
    torch.testing.assert_close(reference[traj, col], base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, adapted, atol=1e-4)  # the adapters matter here
    with pytest.raises(ValueError, match="reference"):
        pair_terms(backend, batch, traj, col, settings)


def test_micro_batches_accumulate_the_minibatch_gradient(tiny):
    """`update.micro_batch_size` (gradient accumulation) trains the same algorithm: the same
    weights and metrics to 1e-6 as whole minibatches (0), with odd-sized last micro-batches."""
    cfg, policy, schedule, result = tiny
    start = {name: p.detach().clone() for name, p in policy.backend.transformer.named_parameters()}
    advantages = torch.randn(
        result.num_trajectories, schedule.steps.numel(), generator=torch.Generator().manual_seed(1)
    )
    outcome = {}
    for micro in (0, 3):
        run = cfg.model_copy(
            update={"update": cfg.update.model_copy(update={"micro_batch_size": micro})}
        )
        policy = Policy.create(run)  # the same LoRA init: it depends on the seed alone
        metrics = rounds.update_round(
            policy.backend, policy.optimizer, result, advantages, schedule, run, seed=0,
            round_index=0,
        )  # fmt: skip
        weights = {n: p.detach().clone() for n, p in policy.backend.transformer.named_parameters()}
        outcome[micro] = metrics, weights
    (whole, whole_weights), (micro, micro_weights) = outcome[0], outcome[3]
    assert cfg.update.minibatch_size % 3 != 0  # a last, shorter micro-batch in every step
    assert whole["train/optimizer_steps"] > 1
    for key, value in whole.items():
        assert micro[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    moved = [n for n, w in whole_weights.items() if not torch.equal(w, start[n])]
    assert moved
    for name, weight in whole_weights.items():
        torch.testing.assert_close(micro_weights[name], weight, rtol=1e-6, atol=1e-6)
