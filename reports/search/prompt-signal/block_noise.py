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

import math

import torch
from torch import Tensor
from torch.nn.functional import avg_pool2d

from pipeline import sampling

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
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
    rows = x.shape[0]
    sigma = sampling._per_row(sigma, rows, x.device)
    sigma_next = sampling._per_row(sigma_next, rows, x.device)
    c_x, c_v, std = sampling.step_coefficients(
        sigma, sigma_next, kind=kind, eta=eta, sigma_max=sigma_max
    )
    euler = sampling._affine(x, v, torch.ones_like(c_x), sigma_next - sigma)
    mean = euler + block_mean(sampling._affine(x, v, c_x, c_v) - euler, block)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device)
        prev_sample = (mean + std.view(-1, 1, 1, 1) * block_mean(noise, block)).to(x.dtype)
    coordinates = block * avg_pool2d(prev_sample.float() - mean, block)  # Pᵀ(x′ − μ)
    mean_square = coordinates.square().mean(dim=(1, 2, 3))
    log_prob = -mean_square / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    log_prob = torch.where(std > 0, log_prob, torch.full_like(log_prob, math.nan))
    return sampling.StepResult(prev_sample, mean, std, log_prob)
