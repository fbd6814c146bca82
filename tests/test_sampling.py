"""Samplers: steps against the DESIGN.md equations, log-probs against torch.distributions, the
rollout loop's bookkeeping, completions, and marginals against a closed-form Gaussian mixture."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from pipeline.sampling import (
    KINDS,
    completion_paths,
    initial_noise,
    ode_complete,
    ode_substeps,
    sample,
    sde_step,
    sde_window,
    step_coefficients,
    timesteps_sigmas,
)

STOCHASTIC = ("flow_grpo", "cps", "stepwise")


def smooth_velocity(x, sigma):
    """A row-wise nonlinear stand-in for a network: (B, ...) x, (B,) sigma -> (B, ...)."""
    s = sigma.view(-1, *([1] * (x.ndim - 1)))
    return torch.tanh(x) * (1 + s) - 0.3 * s


def row_velocity(x, sigma, rows):
    return smooth_velocity(x, sigma)


def reference_step(x, v, sigma, sigma_next, kind, eta, sigma_max):
    """DESIGN.md "Samplers", written out literally with Python-float σ: (mean, std)."""
    dt = sigma_next - sigma
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    if kind == "ode":
        return x + dt * v, 0.0
    if kind == "flow_grpo":
        s = eta * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
        mean = x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
        return mean, s * math.sqrt(-dt)
    if kind == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2)
    else:
        std = eta * sigma_next * math.sqrt(1 - sigma)
    return (1 - sigma_next) * x0_hat + math.sqrt(sigma_next**2 - std**2) * x1_hat, std


def batch(seed=0, shape=(4, 3, 5, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x.to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.9), (0.7, 0.55), (0.2, 0.0)])
def test_step_matches_design_equations(kind, sigma, sigma_next):
    x, v = batch()
    eta, sigma_max = 0.6, 0.9
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    got = sde_step(x, v, sigma, sigma_next, kind=kind, eta=eta, noise=noise, sigma_max=sigma_max)
    mean, std = reference_step(x, v, sigma, sigma_next, kind, eta, sigma_max)
    torch.testing.assert_close(got.mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.std, torch.full((4,), std), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.prev_sample, mean + std * noise, rtol=1e-5, atol=1e-5)


def test_ode_is_euler_and_draws_no_noise():
    x, v = batch()
    g = torch.Generator().manual_seed(3)
    before = g.get_state()
    got = sde_step(x, v, 0.8, 0.6, kind="ode", eta=0.7, generator=g)
    torch.testing.assert_close(got.prev_sample, x + (0.6 - 0.8) * v)
    assert torch.equal(g.get_state(), before)
    assert torch.equal(got.std, torch.zeros(4))
    assert got.log_prob.isnan().all()


@pytest.mark.parametrize("kind", ["cps", "stepwise"])
def test_zero_eta_is_euler(kind):
    x, v = batch()
    ode = sde_step(x, v, 0.8, 0.6, kind="ode", eta=0.0)
    got = sde_step(x, v, 0.8, 0.6, kind=kind, eta=0.0)
    torch.testing.assert_close(got.prev_sample, ode.prev_sample, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.std, torch.zeros(4))


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_log_prob_matches_torch_normal(kind):
    x, v = batch()
    got = sde_step(x, v, 0.7, 0.6, kind=kind, eta=0.8, generator=torch.Generator().manual_seed(0))
    normal = torch.distributions.Normal(got.mean, got.std.view(-1, 1, 1, 1))
    expected = normal.log_prob(got.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(got.log_prob, expected, rtol=1e-5, atol=1e-5)
    assert got.log_prob.dtype == torch.float32 and got.log_prob.shape == (4,)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_scoring_a_given_sample(kind):
    x, v = batch()
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    scored = sde_step(x, v, 0.7, 0.6, kind=kind, eta=0.8, prev_sample=other)
    assert scored.prev_sample is other
    normal = torch.distributions.Normal(scored.mean, scored.std.view(-1, 1, 1, 1))
    expected = normal.log_prob(other).mean(dim=(1, 2, 3))
    torch.testing.assert_close(scored.log_prob, expected, rtol=1e-5, atol=1e-5)
    # Re-scoring one's own sample gives the same log-prob bit for bit: the PPO ratio is exactly 1.
    own = sde_step(x, v, 0.7, 0.6, kind=kind, eta=0.8)
    rescored = sde_step(x, v, 0.7, 0.6, kind=kind, eta=0.8, prev_sample=own.prev_sample)
    assert torch.equal(torch.exp(rescored.log_prob - own.log_prob), torch.ones(4))


def test_low_precision_input_keeps_fp32_math_and_exact_rescoring():
    x, v = batch(dtype=torch.bfloat16)
    own = sde_step(x, v, 0.7, 0.6, kind="flow_grpo", eta=0.7)
    assert own.prev_sample.dtype == torch.bfloat16
    assert own.mean.dtype == own.std.dtype == own.log_prob.dtype == torch.float32
    rescored = sde_step(x, v, 0.7, 0.6, kind="flow_grpo", eta=0.7, prev_sample=own.prev_sample)
    assert torch.equal(rescored.log_prob, own.log_prob)


def test_flow_grpo_at_sigma_one_uses_sigma_max():
    x, v = batch()
    got = sde_step(x, v, 1.0, 0.9, kind="flow_grpo", eta=0.7, sigma_max=0.9)
    # s = 0.7·√(1 / (1 − 0.9)), std = s·√0.1 = 0.7.
    torch.testing.assert_close(got.std, torch.full((4,), 0.7))
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(x, v, 1.0, 0.9, kind="flow_grpo", eta=0.7)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(x, v, torch.tensor([0.5, 1.0, 0.5, 0.5]), 0.4, kind="flow_grpo", eta=0.7)


def test_singular_steps_have_no_log_prob():
    x, v = batch()
    assert sde_step(x, v, 1.0, 0.9, kind="stepwise", eta=0.7).log_prob.isnan().all()
    for kind in ("cps", "stepwise"):
        last = sde_step(x, v, 0.1, 0.0, kind=kind, eta=0.7)
        assert last.log_prob.isnan().all()
        torch.testing.assert_close(last.prev_sample, x - 0.1 * v)  # x̂0


def test_per_row_sigmas_match_scalar_calls():
    x, v = batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    sigma, sigma_next = torch.tensor([1.0, 0.8, 0.5, 0.3]), torch.tensor([0.9, 0.7, 0.45, 0.1])
    rows = sde_step(x, v, sigma, sigma_next, kind="flow_grpo", eta=0.7, noise=noise, sigma_max=0.9)
    for i in range(4):
        one = sde_step(
            x[i : i + 1],
            v[i : i + 1],
            float(sigma[i]),
            float(sigma_next[i]),
            kind="flow_grpo",
            eta=0.7,
            noise=noise[i : i + 1],
            sigma_max=0.9,
        )
        torch.testing.assert_close(rows.prev_sample[i : i + 1], one.prev_sample)
        torch.testing.assert_close(rows.log_prob[i : i + 1], one.log_prob)


def test_step_argument_errors():
    x, v = batch()
    with pytest.raises(ValueError, match="unknown sampler kind"):
        sde_step(x, v, 0.5, 0.4, kind="ddpm", eta=0.5)
    with pytest.raises(ValueError, match="eta"):
        sde_step(x, v, 0.5, 0.4, kind="stepwise", eta=1.5)
    with pytest.raises(ValueError, match="eta"):
        sde_step(x, v, 0.5, 0.4, kind="flow_grpo", eta=-0.1)
    with pytest.raises(ValueError, match="either noise"):
        sde_step(x, v, 0.5, 0.4, kind="cps", eta=0.5, noise=x, prev_sample=x)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, v, torch.ones(3), 0.4, kind="cps", eta=0.5)


def test_schedule_is_the_diffusers_schedule():
    sigmas = timesteps_sigmas(10, shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
    assert torch.equal(sigmas, scheduler.sigmas.float())
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    # The model's timestep is σ·1000.
    torch.testing.assert_close(scheduler.timesteps.float(), sigmas[:-1] * 1000)
    # The shift moves σ up (more time at high noise), as σ' = shift·σ / (1 + (shift − 1)·σ).
    assert (sigmas[1:-1] > timesteps_sigmas(10, shift=1.0)[1:-1]).all()


def test_sde_window():
    assert sde_window(6, kind="flow_grpo").tolist() == [True] * 5 + [False]
    assert sde_window(6, start=1, end=4, kind="flow_grpo").tolist() == [
        False,
        True,
        True,
        True,
        False,
        False,
    ]
    assert sde_window(6, end=6, kind="flow_grpo").all()
    # std = 0 at σ = 1 for stepwise and at σ' = 0 for cps/stepwise, whatever the range.
    assert sde_window(6, end=6, kind="stepwise").tolist() == [False] + [True] * 4 + [False]
    assert sde_window(6, end=6, kind="cps").tolist() == [True] * 5 + [False]
    assert not sde_window(6, kind="ode").any()
    with pytest.raises(ValueError, match="start"):
        sde_window(6, start=4, end=2, kind="cps")


def rollout(kind="flow_grpo", seed=0, **kwargs):
    sigmas = timesteps_sigmas(8, shift=3.0)
    x_T = initial_noise(2, 3, (2, 4, 4), shared=True, generator=torch.Generator().manual_seed(5))
    window = kwargs.pop("window", sde_window(8, start=1, end=5, kind=kind))
    return sample(
        smooth_velocity,
        x_T,
        sigmas,
        kind=kind,
        eta=0.7,
        window=window,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    ), x_T


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_rollout_bookkeeping_and_on_policy_rescoring(kind):
    result, x_T = rollout(kind, keep_velocities=True)
    window = result.window
    assert result.states.shape == (6, 9, 2, 4, 4) and result.means.shape == (6, 8, 2, 4, 4)
    assert result.stds.shape == result.log_probs.shape == (6, 8)
    assert torch.equal(result.states[:, 0], x_T)
    assert torch.equal(result.states[:, -1], result.final)
    assert result.log_probs[:, ~window].isnan().all() and (result.stds[:, ~window] == 0).all()
    assert result.log_probs[:, window].isfinite().all() and (result.stds[:, window] > 0).all()
    sigmas = result.sigmas
    for i in range(8):
        v = smooth_velocity(result.states[:, i], sigmas[i].expand(6))
        assert torch.equal(result.velocities[:, i], v)
        step = sde_step(
            result.states[:, i],
            v,
            float(sigmas[i]),
            float(sigmas[i + 1]),
            kind=kind if window[i] else "ode",
            eta=0.7,
            prev_sample=result.states[:, i + 1],
            sigma_max=float(sigmas[1]),
        )
        assert torch.equal(step.mean, result.means[:, i])
        if window[i]:
            assert torch.equal(step.log_prob, result.log_probs[:, i])
        else:
            assert torch.equal(result.states[:, i + 1], step.mean)  # deterministic step


def test_seeded_rollouts_are_bit_identical():
    first, _ = rollout(seed=11)
    second, _ = rollout(seed=11)
    other, _ = rollout(seed=12)
    assert torch.equal(first.states, second.states)
    torch.testing.assert_close(first.log_probs, second.log_probs, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(first.final, other.final)


def test_rollout_without_states_has_the_same_final_sample():
    kept, _ = rollout(seed=4)
    lean, _ = rollout(seed=4, keep_states=False)
    assert lean.states is None and lean.means is None and lean.velocities is None
    assert torch.equal(lean.final, kept.final)
    torch.testing.assert_close(lean.log_probs, kept.log_probs, rtol=0, atol=0, equal_nan=True)


def test_rollout_rejects_a_bad_window():
    with pytest.raises(ValueError, match="window"):
        rollout(window=torch.ones(7, dtype=torch.bool))


def test_initial_noise_sharing():
    shared = initial_noise(3, 4, (2, 5), shared=True, generator=torch.Generator().manual_seed(0))
    assert shared.shape == (12, 2, 5)
    groups = shared.view(3, 4, 2, 5)  # (n_groups, G, ...)
    assert (groups == groups[:, :1]).all()
    assert not torch.equal(groups[0, 0], groups[1, 0])
    own = initial_noise(3, 4, (2, 5), shared=False, generator=torch.Generator().manual_seed(0))
    assert own.shape == (12, 2, 5) and torch.unique(own[:, 0, 0]).numel() == 12


def test_one_substep_is_tweedie():
    x, _ = batch()
    sigma = torch.tensor([1.0, 0.7, 0.3, 0.0])
    v = smooth_velocity(x, sigma)
    torch.testing.assert_close(
        ode_substeps(smooth_velocity, x, sigma, 1), x - sigma.view(-1, 1, 1, 1) * v
    )


def test_substeps_equal_the_remaining_uniform_steps():
    sigmas = torch.linspace(1, 0, 11)  # uniform, so T' = T − k substeps land on the same σ's
    x, _ = batch()
    start = torch.tensor([0, 3, 6, 9])
    completed = ode_complete(row_velocity, x, start, sigmas)
    for row, k in enumerate(start.tolist()):
        sub = ode_substeps(smooth_velocity, x[row : row + 1], float(sigmas[k]), 10 - k)
        torch.testing.assert_close(completed[row : row + 1], sub, rtol=1e-5, atol=1e-5)


def test_ode_complete_masks_rows_by_start_index():
    sigmas = timesteps_sigmas(8, shift=3.0)
    x, _ = batch(shape=(5, 2, 3, 3))
    start = torch.tensor([0, 8, 2, 5, 7])
    completed = ode_complete(row_velocity, x, start, sigmas)
    assert torch.equal(completed[1], x[1])  # already at σ = 0: unchanged
    # Each row costs exactly its remaining steps: finished rows leave the batch.
    seen = []
    ode_complete(
        lambda x, s, rows: seen.append(rows.tolist()) or smooth_velocity(x, s), x, start, sigmas
    )
    assert sum(len(r) for r in seen) == sum(8 - k for k in start.tolist())
    assert seen[-1] == [0]
    for row, k in enumerate(start.tolist()):
        alone = ode_complete(row_velocity, x[row : row + 1], torch.tensor([k]), sigmas)
        torch.testing.assert_close(completed[row : row + 1], alone, rtol=0, atol=0)
    # From index 0 it is the rollout's pure-ODE path.
    no_window = torch.zeros(8, dtype=torch.bool)
    ode_rollout = sample(smooth_velocity, x, sigmas, kind="ode", eta=0.0, window=no_window)
    assert torch.equal(
        ode_complete(row_velocity, x, torch.zeros(5, dtype=torch.long), sigmas),
        ode_rollout.final,
    )
    with pytest.raises(ValueError, match="start_index"):
        ode_complete(row_velocity, x, torch.tensor([0, 9, 0, 0, 0]), sigmas)


def test_completion_paths_by_hand():
    start = torch.tensor([0, 7, 9, 10])
    assert completion_paths(start, 10, 3).tolist() == [
        [0, 3, 7, 10],  # 10 remaining steps in 3: indices 0, 3.33, 6.67, 10 rounded
        [7, 8, 9, 10],  # exactly 3 remaining: every one of them
        [9, 10, 10, 10],  # 1 remaining, then done (padded with T)
        [10, 10, 10, 10],  # already at σ = 0
    ]
    assert completion_paths(start, 10, 0).tolist()[1] == [7, 8, 9, 10] + [10] * 7
    with pytest.raises(ValueError, match="max_steps"):
        completion_paths(start, 10, -1)


def test_coarse_completion_covering_the_rest_is_the_exact_completion():
    sigmas = timesteps_sigmas(8, shift=3.0)
    x, _ = batch(shape=(5, 2, 3, 3))
    start = torch.tensor([0, 8, 2, 5, 7])
    exact = ode_complete(row_velocity, x, start, sigmas)
    assert torch.equal(ode_complete(row_velocity, x, start, sigmas, max_steps=8), exact)
    coarse = ode_complete(row_velocity, x, start, sigmas, max_steps=2)
    # Rows with at most 2 steps left complete exactly; the others take 2 larger Euler steps.
    assert torch.equal(coarse[[1, 4]], exact[[1, 4]])
    assert not torch.allclose(coarse[0], exact[0])
    by_hand = x[0:1]
    for i, j in [(0, 4), (4, 8)]:
        by_hand = by_hand + (sigmas[j] - sigmas[i]) * smooth_velocity(by_hand, sigmas[i : i + 1])
    torch.testing.assert_close(coarse[0:1], by_hand, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_steps", [0, 2])
def test_a_known_first_velocity_replaces_the_first_call(max_steps):
    sigmas = timesteps_sigmas(8, shift=3.0)
    x, _ = batch(shape=(5, 2, 3, 3))
    start = torch.tensor([0, 8, 2, 5, 7])
    v0 = smooth_velocity(x, sigmas[start])
    calls = []

    def counted(x_, s_, rows):
        calls.append(rows.numel())
        return smooth_velocity(x_, s_)

    exact = ode_complete(counted, x, start, sigmas, max_steps=max_steps)
    full_cost = sum(calls)
    calls.clear()
    reused = ode_complete(counted, x, start, sigmas, max_steps=max_steps, first_velocity=v0)
    assert torch.equal(reused, exact)
    assert sum(calls) == full_cost - 4  # one call fewer for each of the 4 rows still moving
    for n in (1, 3):
        calls.clear()
        substeps = ode_substeps(lambda x_, s_: calls.append(1) or smooth_velocity(x_, s_), x,
                                sigmas[start], n, first_velocity=v0)  # fmt: skip
        assert len(calls) == n - 1
        # (σ·T′/T′ may round off σ by an ulp: equal to float precision, not bit for bit)
        torch.testing.assert_close(
            substeps, ode_substeps(smooth_velocity, x, sigmas[start], n), rtol=1e-6, atol=1e-6
        )
    with pytest.raises(ValueError, match="first_velocity"):
        ode_complete(counted, x, start, sigmas, first_velocity=v0[:2])


def variance_chain(kind, eta, data_variance, sigmas, window):
    """Exact Var(x) through the sampler for 1-D data N(0, c), whose velocity is linear:
    v = k(σ)·x with k = (σ − (1 − σ)c) / ((1 − σ)²c + σ²). Returns Var at every σ_i."""
    variances = [1.0]
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i : i + 1], sigmas[i + 1 : i + 2]
        s, c = float(sigma), data_variance
        k = (s - (1 - s) * c) / ((1 - s) ** 2 * c + s**2)
        c_x, c_v, std = step_coefficients(
            sigma,
            sigma_next,
            kind=kind if window[i] else "ode",
            eta=eta,
            sigma_max=float(sigmas[1]),
        )
        gain = float(c_x) + float(c_v) * k
        variances.append(gain**2 * variances[-1] + float(std) ** 2)
    return torch.tensor(variances, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["ode", "flow_grpo"])
@pytest.mark.parametrize("data_variance", [0.05, 0.5, 2.0])
def test_linear_gaussian_variance_is_preserved(kind, data_variance):
    # No sampling noise: the variance recursion is exact. 400 steps leave ≤ 2% Euler error.
    sigmas = timesteps_sigmas(400, shift=1.0).double()
    window = sde_window(400, kind=kind)
    final = variance_chain(kind, 0.7, data_variance, sigmas, window)[-1]
    assert abs(final / data_variance - 1) < 0.02


@pytest.mark.parametrize(
    ("kind", "eta"), [("ode", 0.0), ("cps", 0.8), ("stepwise", 0.7), ("stepwise", 1.0)]
)
def test_ddim_style_steps_preserve_coefficients_exactly(kind, eta):
    # Point-mass data (c = 0): x̂0 and x̂1 are exact, so every DDIM-style step lands exactly on
    # the marginal N(0, σ′²) ("coefficients preserving"), at any step count and eta.
    sigmas = timesteps_sigmas(10, shift=3.0).double()
    window = torch.ones(10, dtype=torch.bool)
    window[0] = kind != "stepwise"  # stepwise at σ = 1 has std 0 either way
    variances = variance_chain(kind, eta, 0.0, sigmas, window)
    torch.testing.assert_close(variances, sigmas**2, rtol=1e-5, atol=1e-7)


# A 2-D two-component Gaussian mixture. With x_σ = (1 − σ)x0 + σε, given component j:
# x_σ ~ N((1 − σ)m_j, Σ_j), Σ_j = (1 − σ)²C_j + σ²I, E[ε | x, j] = σΣ_j⁻¹(x − (1 − σ)m_j),
# E[x0 | x, j] = m_j + (1 − σ)C_jΣ_j⁻¹(x − (1 − σ)m_j), and the exact velocity is
# v(x, σ) = Σ_j r_j(x)(E[ε | x, j] − E[x0 | x, j]), r_j ∝ w_j N(x; (1 − σ)m_j, Σ_j).
WEIGHTS = torch.tensor([0.3, 0.7], dtype=torch.float64)
MEANS = torch.tensor([[-2.0, 0.0], [1.5, 1.0]], dtype=torch.float64)
COVS = torch.tensor([[[0.3, 0.1], [0.1, 0.2]], [[0.2, 0.0], [0.0, 0.5]]], dtype=torch.float64)


def gmm_velocity(x, sigma):
    """Exact v = E[ε − x0 | x_σ] of the mixture, in fp64: x (B, 2), sigma (B,) -> (B, 2) fp32."""
    x, s = x.double(), sigma.double()[:, None]  # (B, 2), (B, 1)
    a = 1 - s
    c00 = a**2 * COVS[:, 0, 0] + s**2  # Σ_j entries, (B, J)
    c01 = a**2 * COVS[:, 0, 1]
    c11 = a**2 * COVS[:, 1, 1] + s**2
    det = c00 * c11 - c01**2
    d0, d1 = x[:, :1] - a * MEANS[:, 0], x[:, 1:] - a * MEANS[:, 1]  # x − (1 − σ)m_j, (B, J)
    p0, p1 = (c11 * d0 - c01 * d1) / det, (c00 * d1 - c01 * d0) / det  # Σ_j⁻¹(x − (1 − σ)m_j)
    log_resp = torch.log(WEIGHTS) - 0.5 * (d0 * p0 + d1 * p1) - 0.5 * torch.log(det)
    resp = torch.softmax(log_resp, dim=1)  # r_j, (B, J)
    x0_0 = MEANS[:, 0] + a * (COVS[:, 0, 0] * p0 + COVS[:, 0, 1] * p1)
    x0_1 = MEANS[:, 1] + a * (COVS[:, 1, 0] * p0 + COVS[:, 1, 1] * p1)
    v0 = (resp * (s * p0 - x0_0)).sum(1)
    v1 = (resp * (s * p1 - x0_1)).sum(1)
    return torch.stack([v0, v1], dim=1).float()


@pytest.fixture
def one_thread():
    """Many tiny elementwise ops: one thread is fastest and immune to CPU oversubscription
    (measured 10-50 s with 2 threads on a loaded 2-core machine vs < 1.5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("kind", "eta", "start", "end"),
    [
        ("ode", 0.0, 0, None),
        ("flow_grpo", 0.7, 0, None),  # every step but the last
        ("stepwise", 0.7, 0, None),
        ("cps", 0.8, 0, 3),  # a Flow-GRPO-Fast-style short window (see step_coefficients)
    ],
)
def test_sde_marginals_match_the_mixture(kind, eta, start, end):
    """Tolerance: |mean − exact| ≤ 0.05 and |cov − exact| ≤ 0.2 elementwise (cov entries up to
    2.8). Measured: the 40-step Euler ODE itself is ~0.13 low on the largest entry; the sampling
    error of 50k samples is ~0.02."""
    n, num_steps = 50_000, 40
    generator = torch.Generator().manual_seed(0)
    x_T = torch.randn(n, 2, generator=generator)
    result = sample(
        gmm_velocity,
        x_T,
        timesteps_sigmas(num_steps, shift=1.0),
        kind=kind,
        eta=eta,
        window=sde_window(num_steps, start=start, end=end, kind=kind),
        generator=generator,
        keep_states=False,
    )
    x = result.final.double()
    exact_mean = WEIGHTS @ MEANS
    second_moment = (WEIGHTS[:, None, None] * (COVS + MEANS[:, :, None] * MEANS[:, None, :])).sum(0)
    exact_cov = second_moment - torch.outer(exact_mean, exact_mean)
    assert (x.mean(0) - exact_mean).abs().max() <= 0.05
    assert (torch.cov(x.T) - exact_cov).abs().max() <= 0.2
