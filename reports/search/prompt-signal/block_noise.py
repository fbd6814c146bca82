"""Session 17 scratch sampler (issue 19): flow-matching SDE steps that explore only the
block-mean subspace of the latent.

With Π the projection that replaces every b x b patch of each channel by its mean (k = D/b²
directions), a step is x′ = μ_ode + Π(μ − μ_ode) + std·Π ε, μ_ode = x + Δ·v the Euler step and
μ, std the kind's own (`sampling.step_coefficients`): the kind's SDE on the subspace, the ODE on
its complement. For any constant noise covariance Σ the SDE with drift v − ½g²Σ∇log p keeps the
ODE's marginals (the Fokker–Planck terms cancel), so flow_grpo stays marginal-preserving with
Σ = Π (checked numerically on a Gaussian whose covariance differs on Π and its complement:
both variances kept within 6 %, while the unprojected drift shrinks the complement's). The
log-prob is the Gaussian density of the subspace coordinates Pᵀ(x′ − μ) = b·avgpool_b(x′ − μ),
averaged over their k elements, so re-scoring a drawn sample gives the same value (ratio 1).
Why try it: a policy-gradient term is A·ε/σ·∂μ/∂θ with ε D-dimensional, while a GenEval reward
reads layout, count and colour, the low frequencies.
"""

import torch
from torch import Tensor
from torch.nn.functional import avg_pool2d

from pipeline import sampling

_SDE_STEP = sampling.sde_step  # before a caller patches it with block_sde_step


def block_mean(y: Tensor, block: int) -> Tensor:
    """Π y for (B, C, H, W) y: every block x block patch of each channel at its mean (fp32)."""
    pooled = avg_pool2d(y.float(), block)
    return pooled.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)


def block_sde_step(
    x, v, sigma, sigma_next, *, kind, eta, noise=None, prev_sample=None, sigma_max=None,
    generator=None, block: int = 4,
) -> sampling.StepResult:  # fmt: skip
    """`sampling.sde_step` with the noise (and the kind's departure from Euler) on Π only."""
    if kind == "ode" or block == 1:
        return _SDE_STEP(
            x, v, sigma, sigma_next, kind=kind, eta=eta, noise=noise, prev_sample=prev_sample,
            sigma_max=sigma_max, generator=generator,
        )  # fmt: skip
    euler = _SDE_STEP(x, v, sigma, sigma_next, kind="ode", eta=eta).mean
    own = _SDE_STEP(x, v, sigma, sigma_next, kind=kind, eta=eta, prev_sample=x, sigma_max=sigma_max)
    mean, std = euler + block_mean(own.mean - euler, block), own.std
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device)
        prev_sample = (mean + std.view(-1, 1, 1, 1) * block_mean(noise, block)).to(x.dtype)
    coordinates = block * avg_pool2d(prev_sample.float() - mean, block)  # Pᵀ(x′ − μ)
    log_prob = sampling.gaussian_log_prob(coordinates, torch.zeros_like(coordinates), std)
    return sampling.StepResult(prev_sample, mean, std, log_prob)
