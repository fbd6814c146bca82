"""Flow-matching samplers with Gaussian transition log-probs, and the rollout loop.

Convention (DESIGN.md): x_σ = (1 − σ)·x0 + σ·ε, the network predicts v = ε − x0, σ runs from 1
(noise) to 0 (image). The model is called with timestep = σ · 1000 (diffusers'
``FlowMatchEulerDiscreteScheduler`` with ``num_train_timesteps=1000``); this module only deals in σ.

Every transition here is affine in (x, v) plus isotropic Gaussian noise,

    x′ = c_x·x + c_v·v + std·ε,    ε ~ N(0, I),    mean μ = c_x·x + c_v·v,

with per-row scalars c_x, c_v, std. The four kinds differ only in those scalars (see
:func:`step_coefficients`). Precision: all step and log-prob math is fp32 whatever the input dtype;
``prev_sample`` is cast back to the input dtype (it is the state fed to the next model call) and its
log-prob is taken of that cast sample, so re-scoring a cached sample reproduces the log-prob
exactly. ``mean``, ``std`` and ``log_prob`` stay fp32.

Log-prob reduction: the Gaussian log-density of x′ under N(μ, std²·I) is *averaged* over the
non-batch elements (Flow-GRPO, Liu et al. 2025, ``sde_step_with_logprob``), so a PPO ratio is the
per-element geometric mean ratio and ``clip_range`` is on that scale. Where std = 0 (ODE steps, and
the singular steps of ``cps``/``stepwise``) the density does not exist and ``log_prob`` is NaN, so
any accidental use poisons a loss loudly instead of silently contributing 0: select trainable steps
by indexing with the SDE window, never by multiplying with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

KINDS = ("ode", "flow_grpo", "cps", "stepwise")
# (x (B, ...), sigma (B,)) -> v (B, ...); classifier-free guidance, if any, lives inside.
VelocityFn = Callable[[Tensor, Tensor], Tensor]
# (x (M, ...), sigma (M,), rows (M,) long indices into the full batch) -> v (M, ...).
RowVelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class StepResult(NamedTuple):
    """One transition x → x′.

    prev_sample: (B, ...) x′, input dtype (the given sample when one was scored).
    mean: (B, ...) fp32 μ.
    std: (B,) fp32 per-row standard deviation of x′ (view as (B, 1, ..., 1) to broadcast).
    log_prob: (B,) fp32 mean over non-batch elements of log N(x′; μ, std²); NaN where std = 0.
    """

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor


@dataclass(frozen=True)
class Rollout:
    """A batch of sampled trajectories over one schedule (T steps).

    states: (B, T+1, ...) input dtype, x_T first, final sample last; None if not kept.
    means: (B, T, ...) fp32 transition means (= the next state on ODE steps); None if not kept.
    stds: (B, T) fp32; 0 on ODE steps.
    log_probs: (B, T) fp32; NaN off the window (and wherever std = 0).
    final: (B, ...) the final sample (σ = 0), input dtype.
    sigmas: (T+1,) fp32 schedule.
    window: (T,) bool, which steps were stochastic (trainable).
    velocities: (B, T, ...) fp32 model outputs per step, or None if not kept.
    """

    states: Tensor | None
    means: Tensor | None
    stds: Tensor
    log_probs: Tensor
    final: Tensor
    sigmas: Tensor
    window: Tensor
    velocities: Tensor | None


def timesteps_sigmas(num_steps: int, *, shift: float) -> Tensor:
    """σ schedule of diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift)`` for ``num_steps``.

    Returns (num_steps + 1,) fp32, decreasing from 1.0 to a final 0.0; step i goes from
    sigmas[i] to sigmas[i + 1]. The model's timestep for step i is sigmas[i] * 1000.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    # Imported here: diffusers costs seconds to import and only the schedule needs it.
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.to(torch.float32).clone()


def sde_window(num_steps: int, *, start: int = 0, end: int | None = None, kind: str) -> Tensor:
    """Which steps of a ``timesteps_sigmas`` schedule are stochastic and trainable.

    Steps start..end-1 (slice semantics); ``end`` defaults to num_steps - 1, which leaves out the
    final step as Flow-GRPO does. Steps whose std is 0 for ``kind`` are always left out: every step
    for ``ode``, the first step (σ = 1) for ``stepwise``, the last step (σ′ = 0) for ``cps`` and
    ``stepwise``. Assumes the schedule starts at σ = 1 and ends at 0, as ``timesteps_sigmas`` does.
    Returns (num_steps,) bool.
    """
    _check_kind(kind)
    end = num_steps - 1 if end is None else end
    if not 0 <= start <= end <= num_steps:
        raise ValueError(f"need 0 <= start <= end <= {num_steps}, got start={start}, end={end}")
    window = torch.zeros(num_steps, dtype=torch.bool)
    window[start:end] = True
    if kind == "ode":
        window[:] = False
    if kind == "stepwise":
        window[0] = False
    if kind in ("cps", "stepwise"):
        window[-1] = False
    return window


def step_coefficients(
    sigma: Tensor,
    sigma_next: Tensor,
    *,
    kind: str,
    eta: float,
    sigma_max: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (c_x, c_v, std) of the transition x′ = c_x·x + c_v·v + std·ε.

    sigma, sigma_next: (B,) fp32. Returns three (B,) fp32 tensors. With Δ = σ′ − σ < 0,
    x̂0 = x − σv, x̂1 = x + (1 − σ)v (DESIGN.md "Samplers"):

    - ``ode`` (Euler): x′ = x + Δ·v.
    - ``flow_grpo`` (Liu et al. 2025, Flow-GRPO: Euler–Maruyama step of the marginal-preserving
      SDE, s = a·√(σ/(1−σ)), a = eta): μ = x + [v + s²/(2σ)·(x + (1−σ)v)]·Δ, std = s·√(−Δ).
      At σ = 1 the denominator 1 − σ is replaced by 1 − sigma_max (the schedule's second σ), as
      the official code does.
    - ``cps`` (Wang & Yu 2025, coefficients-preserving sampling, a = eta):
      std = σ′·sin(aπ/2), μ = (1 − σ′)·x̂0 + √(σ′² − std²)·x̂1.
    - ``stepwise`` (Savani et al. 2026, DDIM-style): std = η·σ′·√(1 − σ), same μ as ``cps``.

    Expanding μ in x and v gives the coefficients below; at eta = 0 every kind is the Euler step.

    Marginals: ``flow_grpo`` discretizes an SDE with the ODE's marginals. ``cps`` and ``stepwise``
    are exact only when x̂0, x̂1 are exact (point-mass data); with posterior means their std,
    which does not shrink with the step size, loses the posterior variance of x0 at every
    stochastic step, so the sample variance contracts (measured on 1-D Gaussian data of variance
    2 with the exact velocity, 400 steps all stochastic: cps a = 0.7 → 1.44, stepwise η = 1 →
    1.41, flow_grpo → 2.02). Keep their windows short, as Flow-GRPO-Fast and TP-GRPO do.
    """
    _check_kind(kind)
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    dt = sigma_next - sigma  # Δ, (B,)
    if kind == "ode":
        return torch.ones_like(sigma), dt, torch.zeros_like(sigma)
    if kind == "flow_grpo":
        at_start = sigma >= 1.0
        if sigma_max is None and bool(at_start.any()):
            raise ValueError(
                "flow_grpo at sigma = 1 needs sigma_max (the schedule's second sigma) for the "
                "noise-scale denominator sqrt(sigma / (1 - sigma))"
            )
        denominator = 1 - torch.where(at_start, torch.full_like(sigma, sigma_max or 0.0), sigma)
        noise_scale = eta * torch.sqrt(sigma / denominator)  # s
        drift = noise_scale**2 / (2 * sigma)  # s²/(2σ)
        c_x = 1 + drift * dt
        c_v = (1 + drift * (1 - sigma)) * dt
        return c_x, c_v, noise_scale * torch.sqrt(-dt)
    if eta > 1:
        raise ValueError(f"{kind} needs eta in [0, 1] (std <= sigma_next), got {eta}")
    if kind == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2)
    else:  # stepwise
        std = eta * sigma_next * torch.sqrt(1 - sigma)
    x1_weight = torch.sqrt((sigma_next**2 - std**2).clamp_min(0))  # √(σ′² − std²)
    # μ = (1 − σ′)(x − σv) + w(x + (1 − σ)v)
    c_x = (1 - sigma_next) + x1_weight
    c_v = -sigma * (1 - sigma_next) + x1_weight * (1 - sigma)
    return c_x, c_v, std


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Mean over non-batch elements of log N(sample; mean, std²); NaN where std = 0.

    sample, mean: (B, ...); std: (B,). Returns (B,) fp32. With a per-row std the element mean
    equals −mean((x′ − μ)²)/(2·std²) − log std − ½·log 2π, computed that way (one reduction).
    """
    non_batch = tuple(range(1, sample.ndim))
    mean_square = (sample.float() - mean.float()).square().mean(dim=non_batch)  # (B,)
    std = std.float()
    log_prob = -mean_square / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    return torch.where(std > 0, log_prob, torch.full_like(log_prob, math.nan))


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    kind: str,
    eta: float,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    sigma_max: float | None = None,
    generator: torch.Generator | None = None,
) -> StepResult:
    """One transition from σ to σ′ (< σ) of sampler ``kind`` (see :func:`step_coefficients`).

    x, v: (B, ...) with at least one non-batch dim; sigma, sigma_next: floats or (B,) tensors.
    With ``prev_sample`` given, score it (no noise drawn); else x′ = μ + std·noise with ``noise``
    (B, ...) if given, else standard normal noise from ``generator`` (on x's device). ``ode`` draws
    no noise. ``sigma_max`` is required by ``flow_grpo`` at σ = 1.
    """
    if x.shape != v.shape or x.ndim < 2:
        raise ValueError(f"x and v must share a (B, ...) shape, got {tuple(x.shape)}, {v.shape}")
    if noise is not None and prev_sample is not None:
        raise ValueError("give either noise (to draw a sample) or prev_sample (to score one)")
    batch = x.shape[0]
    sigma_rows = _per_row(sigma, batch, x.device)  # (B,)
    sigma_next_rows = _per_row(sigma_next, batch, x.device)  # (B,)
    c_x, c_v, std = step_coefficients(
        sigma_rows, sigma_next_rows, kind=kind, eta=eta, sigma_max=sigma_max
    )
    mean = _affine(x, v, c_x, c_v)  # (B, ...) fp32
    if prev_sample is None:
        if kind == "ode":
            prev_sample = mean.to(x.dtype)
        else:
            if noise is None:
                noise = torch.randn(
                    x.shape, generator=generator, device=x.device, dtype=torch.float32
                )
            prev_sample = (mean + _rows(std, x.ndim) * noise.float()).to(x.dtype)
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} != x {tuple(x.shape)}")
    return StepResult(prev_sample, mean, std, gaussian_log_prob(prev_sample, mean, std))


def sample(
    velocity_fn: VelocityFn,
    x_T: Tensor,
    sigmas: Tensor,
    *,
    kind: str,
    eta: float,
    window: Tensor,
    generator: torch.Generator | None = None,
    keep_states: bool = True,
    keep_velocities: bool = False,
    noise_rows: tuple[int, slice] | None = None,
) -> Rollout:
    """Roll out B trajectories from x_T (B, ...) over ``sigmas`` (T+1,).

    Steps where ``window`` (T,) is True use ``kind``; the others are ``ode``. Noise is drawn for
    the whole batch per stochastic step from ``generator`` (on x_T's device), so a seeded rollout
    is reproducible for the same batch composition. ``noise_rows`` (B_all, rows) makes x_T rows
    ``rows`` of a B_all-row batch (a rank's shard of a round): each step draws the whole batch's
    noise and keeps those rows, so the shards sample what one process would. The loop keeps
    everything on x_T's device: the schedule and window are read to host once, buffers are
    preallocated, no per-step sync.
    """
    num_steps = _check_schedule(sigmas)
    if window.shape != (num_steps,) or window.dtype != torch.bool:
        raise ValueError(f"window must be a ({num_steps},) bool tensor, got {window.shape}")
    _check_kind(kind)
    batch, device = x_T.shape[0], x_T.device
    sigma_list = sigmas.tolist()
    stochastic = window.tolist()
    sigma_max = sigma_list[1]
    # Row-wise σ for every step, contiguous so each velocity call gets a plain (B,) tensor.
    sigma_rows = sigmas.to(device, torch.float32)[:, None].expand(-1, batch).contiguous()

    def buffer(length: int, dtype: torch.dtype) -> Tensor:
        return torch.empty((batch, length, *x_T.shape[1:]), dtype=dtype, device=device)

    states = buffer(num_steps + 1, x_T.dtype) if keep_states else None
    means = buffer(num_steps, torch.float32) if keep_states else None
    velocities = buffer(num_steps, torch.float32) if keep_velocities else None
    stds = torch.zeros((batch, num_steps), dtype=torch.float32, device=device)
    log_probs = torch.full((batch, num_steps), math.nan, dtype=torch.float32, device=device)

    if noise_rows is not None and len(range(noise_rows[0])[noise_rows[1]]) != batch:
        raise ValueError(f"noise_rows {noise_rows} does not select x_T's {batch} rows")
    x = x_T
    for i in range(num_steps):
        v = velocity_fn(x, sigma_rows[i])
        noise = None
        if noise_rows is not None and stochastic[i] and kind != "ode":
            whole = torch.randn(
                (noise_rows[0], *x.shape[1:]), generator=generator, device=device,
                dtype=torch.float32,
            )  # fmt: skip
            noise = whole[noise_rows[1]]
        step = sde_step(
            x,
            v,
            sigma_list[i],
            sigma_list[i + 1],
            kind=kind if stochastic[i] else "ode",
            eta=eta,
            noise=noise,
            sigma_max=sigma_max,
            generator=generator,
        )
        if states is not None:
            states[:, i] = x
            means[:, i] = step.mean
        if velocities is not None:
            velocities[:, i] = v
        if stochastic[i]:
            stds[:, i] = step.std
            log_probs[:, i] = step.log_prob
        x = step.prev_sample

    if states is not None:
        states[:, num_steps] = x
    return Rollout(
        states=states,
        means=means,
        stds=stds,
        log_probs=log_probs,
        final=x,
        sigmas=sigmas.to(torch.float32),
        window=window,
        velocities=velocities,
    )


def initial_noise(
    n_groups: int,
    group_size: int,
    shape: Sequence[int],
    *,
    shared: bool,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """x_T for ``n_groups`` prompt groups of ``group_size`` samples each.

    Returns (n_groups * group_size, *shape), group-major: rows g·G .. g·G + G − 1 are group g.
    With ``shared`` every sample of a group starts from the same noise.
    """
    rows = n_groups if shared else n_groups * group_size
    noise = torch.randn((rows, *shape), generator=generator, device=device, dtype=dtype)
    return noise.repeat_interleave(group_size, dim=0) if shared else noise


def completion_paths(start_index: Tensor, num_steps: int, max_steps: int = 0) -> Tensor:
    """Schedule indices each row's ODE completion visits, (N, L+1) long, L = min(max_steps, T).

    Row r goes from start_index[r] to T in min(max_steps, T − start_index[r]) Euler steps over
    evenly spaced indices of the remaining schedule (all of them when max_steps is 0 or covers
    the rest, the exact completion), then stays at T (σ = 0: done). start_index: (N,) long.
    """
    if max_steps < 0:
        raise ValueError(f"max_steps must be >= 0 (0 = every remaining step), got {max_steps}")
    length = num_steps if max_steps == 0 else min(max_steps, num_steps)
    start = start_index.double()[:, None]  # (N, 1)
    remaining = num_steps - start
    steps = torch.minimum(remaining, torch.tensor(float(length)))  # (N, 1) steps per row
    j = torch.arange(length + 1, dtype=torch.float64)[None]  # (1, L+1)
    # Evenly spaced in index; a row with fewer steps than L pads with T.
    path = start + torch.where(steps > 0, remaining * j / steps.clamp(min=1), 0.0)
    return torch.minimum(path.round(), torch.tensor(float(num_steps))).long()


def ode_complete(
    velocity_fn: RowVelocityFn,
    x: Tensor,
    start_index: Tensor,
    sigmas: Tensor,
    *,
    max_steps: int = 0,
    first_velocity: Tensor | None = None,
) -> Tensor:
    """Deterministic Euler completion to σ = 0, each row from its own schedule index.

    x: (N, ...), row r being the state at σ = sigmas[start_index[r]]; start_index: (N,) long in
    [0, T]; sigmas: (T+1,) ending in 0. ``max_steps`` > 0 takes at most that many Euler steps
    over the remaining schedule (:func:`completion_paths`; Tong et al. 2026 complete over all
    of it, 0). ``first_velocity`` (N, ...) is the velocity at x when already known (the
    rollout's own evaluation at that state): it replaces the first call. Returns (N, ...) in
    x's dtype. All rows advance together; a row that has reached σ = 0 leaves the batch, so
    ``velocity_fn(x_rows, sigma_rows, rows)`` sees only the rows still moving (``rows`` (M,)
    long, their indices in x, for per-row conditioning).
    """
    num_steps = _check_schedule(sigmas)
    if start_index.shape != (x.shape[0],) or start_index.dtype != torch.long:
        raise ValueError(f"start_index must be ({x.shape[0]},) long, got {start_index.shape}")
    if first_velocity is not None and first_velocity.shape != x.shape:
        raise ValueError(f"first_velocity {tuple(first_velocity.shape)} != x {tuple(x.shape)}")
    if bool((start_index < 0).any() | (start_index > num_steps).any()):
        raise ValueError(f"start_index must lie in [0, {num_steps}]")
    paths = completion_paths(start_index.cpu(), num_steps, max_steps).to(x.device)  # (N, L+1)
    sigmas = sigmas.to(x.device, torch.float32)
    x = x.clone()
    for j in range(paths.shape[1] - 1):
        rows = (paths[:, j] < num_steps).nonzero().flatten()  # (M,) still moving
        if rows.numel() == 0:
            break
        sigma, sigma_next = sigmas[paths[rows, j]], sigmas[paths[rows, j + 1]]  # (M,)
        x_rows = x[rows]
        if j == 0 and first_velocity is not None:
            v = first_velocity[rows]
        else:
            v = velocity_fn(x_rows, sigma, rows)
        # Cast per step, as the rollout does: each state is what the next model call sees.
        x[rows] = _affine(x_rows, v, torch.ones_like(sigma), sigma_next - sigma).to(x.dtype)
    return x


def ode_substeps(
    velocity_fn: VelocityFn,
    x: Tensor,
    sigma: float | Tensor,
    n_substeps: int,
    *,
    first_velocity: Tensor | None = None,
) -> Tensor:
    """x̂0 from T′ = ``n_substeps`` uniform Euler steps from each row's own σ to 0.

    x: (N, ...); sigma: float or (N,). Row r steps through σ_r·(1 − j/T′), j = 0..T′. T′ = 1 is
    Tweedie's estimate x − σ·v (Savani et al. 2026, stepwise rewards). ``first_velocity``
    (N, ...), the velocity at (x, σ) when already known, replaces the first call (so Tweedie
    costs none). Returns (N, ...), x's dtype.
    """
    if n_substeps < 1:
        raise ValueError(f"n_substeps must be >= 1, got {n_substeps}")
    if first_velocity is not None and first_velocity.shape != x.shape:
        raise ValueError(f"first_velocity {tuple(first_velocity.shape)} != x {tuple(x.shape)}")
    sigma = _per_row(sigma, x.shape[0], x.device)  # (N,)
    for j in range(n_substeps):
        sigma_j = sigma * (n_substeps - j) / n_substeps
        sigma_next = sigma * (n_substeps - j - 1) / n_substeps
        v = first_velocity if j == 0 and first_velocity is not None else velocity_fn(x, sigma_j)
        x = _affine(x, v, torch.ones_like(sigma), sigma_next - sigma_j).to(x.dtype)
    return x


def _affine(x: Tensor, v: Tensor, c_x: Tensor, c_v: Tensor) -> Tensor:
    """fp32 c_x·x + c_v·v with per-row (B,) coefficients broadcast over (B, ...)."""
    return torch.addcmul(_rows(c_v, v.ndim) * v.float(), _rows(c_x, x.ndim), x.float())


def _rows(values: Tensor, ndim: int) -> Tensor:
    """(B,) -> (B, 1, ..., 1) with ``ndim`` dims, to broadcast per-row scalars."""
    return values.view(-1, *([1] * (ndim - 1)))


def _per_row(value: float | Tensor, batch: int, device: torch.device) -> Tensor:
    """A float, 0-d or (B,) tensor as a (B,) fp32 tensor on ``device``."""
    if not isinstance(value, Tensor):
        return torch.full((batch,), float(value), dtype=torch.float32, device=device)
    if value.ndim == 0:
        return value.to(device, torch.float32).expand(batch)
    if value.shape != (batch,):
        raise ValueError(f"sigma must be a float or a ({batch},) tensor, got {tuple(value.shape)}")
    return value.to(device, torch.float32)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown sampler kind {kind!r}; expected one of {KINDS}")


def _check_schedule(sigmas: Tensor) -> int:
    """Validate a (T+1,) schedule ending in 0; return T."""
    if sigmas.ndim != 1 or sigmas.shape[0] < 2 or float(sigmas[-1]) != 0.0:
        raise ValueError("sigmas must be a (T+1,) schedule with T >= 1 ending in 0")
    return sigmas.shape[0] - 1
