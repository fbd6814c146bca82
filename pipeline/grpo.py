"""GRPO policy update on LoRA weights: PPO-clip over SDE-window steps, KL to the frozen base.

Recipe (Flow-GRPO, Liu et al. 2025, eqs. 5-7, with the PPO clip of Schulman et al. 2017):
    r_{i,k}  = exp(log p_θ(x_{k+1} | x_k) − log p_old(x_{k+1} | x_k))   (trajectory i, step k)
    L_pg     = mean_{i,k} max(−A_{i,k} r_{i,k}, −A_{i,k} clip(r_{i,k}, 1 − ε, 1 + ε)) · w_k
    L_kl     = mean_{i,k} ‖μ_θ(x_k) − μ_ref(x_k)‖² / (2 σ_k²)                 (elementwise mean)
    L        = L_pg + β L_kl
Log-probs are means over the image elements (pipeline.sampling), so ε is on that scale: a step's
ratio moves far less than a per-element sum would make it. The reference policy is the same
network with its LoRA adapters disabled (peft), so no second copy of the weights exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.distributed import SINGLE, Ranks, all_reduce, sum_gradients
from pipeline.sampling import sde_step


def add_lora(transformer: torch.nn.Module, *, rank: int, alpha: float, targets: list[str]) -> None:
    """Attach a LoRA adapter named "default" to `transformer` and freeze everything else.

    B is zero-initialised (peft's default), so the adapted policy starts equal to the base.
    """
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets)
    )


def lora_parameters(transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for name, p in transformer.named_parameters() if "lora_" in name]


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(transformer).items()}


def load_lora_state(transformer: torch.nn.Module, state: dict[str, Tensor]) -> None:
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(transformer, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"LoRA state has keys the model lacks: {unexpected[:3]}")


@contextmanager
def adapters_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """Evaluate the reference (base) policy: the same module with LoRA switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def ppo_clip_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, *, clip_range: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair clipped surrogate. All inputs (M,) fp32 -> loss (M,), diagnostics (detached).

    Diagnostics: `ratio` (M,), `clipped` (M,) bool where the clip was active, `approx_kl`
    (M,) = ½ (log r)² (Schulman's low-variance estimator of KL(old ‖ new)).
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": ((ratio - 1.0).abs() > clip_range).detach(),
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
    }
    return loss, stats


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """KL between Gaussians of equal std: ‖μ − μ_ref‖² / (2 std²), elementwise mean.

    mean, mean_ref: (M, ...) fp32; std: (M,) -> (M,).
    """
    sq = (mean - mean_ref).pow(2).flatten(1).mean(dim=1)  # (M,)
    return sq / (2.0 * std.pow(2))


@dataclass
class UpdateBatch:
    """What one round contributes to the update (N trajectories, T schedule steps, K trained).

    states: (N, T+1, C, H, W) cached states, x_T first. log_probs: (N, T) rollout log-probs.
    sigmas: (T+1,). steps: (K,) long, schedule indices of the trained (SDE-window) steps.
    advantages: (N, K). embeds: per-trajectory prompt embeddings (N rows).
    step_weights: (K,) per-step loss weights (ones by default; a hook for variants).
    A rank of a multi-process round holds a shard: its N trajectories are rows
    `first_trajectory` .. `first_trajectory` + N − 1 of the round's `round_trajectories`.
    """

    states: Tensor
    log_probs: Tensor
    sigmas: Tensor
    steps: Tensor
    advantages: Tensor
    embeds: object
    step_weights: Tensor | None = None
    first_trajectory: int = 0
    round_trajectories: int | None = None  # None: the batch is the whole round

    def pairs(self) -> tuple[Tensor, Tensor]:
        """(trajectory, window column) index of every pair this batch holds, each (N*K,)."""
        return _pairs(*self.advantages.shape)

    def round_pairs(self) -> tuple[Tensor, Tensor]:
        """(round trajectory, window column) of every pair of the round, each (N_round*K,):
        the order the minibatches are drawn from, the same on every rank."""
        n, k = self.advantages.shape
        return _pairs(self.round_trajectories or n, k)


def _pairs(n: int, k: int) -> tuple[Tensor, Tensor]:
    return torch.arange(n).repeat_interleave(k), torch.arange(k).repeat(n)


@dataclass(frozen=True)
class UpdateSettings:
    kind: str  # SDE kind the rollouts were sampled with
    eta: float
    guidance: float
    clip_range: float
    kl_beta: float
    inner_epochs: int
    minibatch_size: int
    max_grad_norm: float
    micro_batch_size: int = 0  # held pairs per forward/backward (gradient accumulation); 0: all


REFERENCE_CHUNK = 256  # pairs per no-grad reference call: larger batches run faster per NFE


def _transition(backend, batch: UpdateBatch, traj: Tensor, col: Tensor, settings: UpdateSettings):
    """The SDE step of the cached transitions of pairs (traj, col), each (M,), under the
    backend's current weights: the StepResult scoring each cached next state."""
    step = batch.steps[col]  # (M,) schedule index
    x = batch.states[traj, step]  # (M, C, H, W)
    sigma, sigma_next = batch.sigmas[step], batch.sigmas[step + 1]
    v = backend.velocity(x, sigma, batch.embeds[traj], guidance=settings.guidance)
    return sde_step(
        x, v, sigma, sigma_next, kind=settings.kind, eta=settings.eta,
        prev_sample=batch.states[traj, step + 1], sigma_max=float(batch.sigmas[1]),
    )  # fmt: skip


def reference_means(
    backend, batch: UpdateBatch, settings: UpdateSettings, chunk: int = REFERENCE_CHUNK
) -> Tensor:
    """The reference policy's (LoRA off) step means of every trained pair, (N, K, C, H, W) fp32.

    The base weights never train, so one no-grad pass per round, at a large batch, serves every
    minibatch and epoch of the update (instead of a reference call beside each policy call).
    """
    traj, col = batch.pairs()
    means = []
    with torch.no_grad(), adapters_disabled(backend.transformer):
        for start in range(0, traj.numel(), chunk):
            pick = slice(start, start + chunk)
            means.append(_transition(backend, batch, traj[pick], col[pick], settings).mean)
    return torch.cat(means).view(*batch.advantages.shape, *means[0].shape[1:])


def pair_terms(
    backend,
    batch: UpdateBatch,
    traj: Tensor,
    col: Tensor,
    settings: UpdateSettings,
    reference: Tensor | None = None,
):
    """Recompute log-prob (and KL) of the cached transitions of pairs (traj, col), each (M,).

    `reference` (N, K, C, H, W): `reference_means` of the batch, needed when kl_beta > 0.
    Returns log_prob (M,) with grad, old log_prob (M,), advantages (M,), weights (M,), kl (M,).
    """
    result = _transition(backend, batch, traj, col, settings)
    kl = torch.zeros_like(result.log_prob)
    if settings.kl_beta > 0:
        if reference is None:
            raise ValueError("kl_beta > 0 needs the reference means (reference_means)")
        kl = kl_to_reference(result.mean, reference[traj, col], result.std)
    weights = torch.ones_like(result.log_prob)
    if batch.step_weights is not None:
        weights = batch.step_weights[col].float()
    old = batch.log_probs[traj, batch.steps[col]]
    return result.log_prob, old, batch.advantages[traj, col], weights, kl


def grpo_update(
    backend,
    optimizer: torch.optim.Optimizer,
    batch: UpdateBatch,
    settings: UpdateSettings,
    *,
    generator: torch.Generator,
    ranks: Ranks = SINGLE,
) -> dict[str, float]:
    """Inner epochs of shuffled minibatches over all (trajectory, step) pairs; returns metrics.

    `train/ratio_dev_first` is max |r − 1| over the first minibatch, before any optimizer step:
    it must be ~0 (on-policy), a check that rollout and update compute the same log-probs.

    Over several ranks (`batch` then holds this rank's shard of the round) the minibatches are
    drawn from the whole round as one process draws them; each rank computes the terms of the
    minibatch's pairs it holds, divided by the minibatch's size, and the gradients are summed
    over the ranks before the step: every rank takes the step one process would.
    """
    params = lora_parameters(backend.transformer)
    reference = reference_means(backend, batch, settings) if settings.kl_beta > 0 else None
    traj_all, col_all = batch.round_pairs()
    held = batch.advantages.shape[0]
    sums: dict[str, float] = {}
    count = 0
    ratio_min, ratio_max, first_dev = float("inf"), float("-inf"), None
    for _ in range(settings.inner_epochs):
        order = torch.randperm(traj_all.numel(), generator=generator)
        for start in range(0, traj_all.numel(), settings.minibatch_size):
            idx = order[start : start + settings.minibatch_size]
            traj = traj_all[idx] - batch.first_trajectory
            mine = (traj >= 0) & (traj < held)
            optimizer.zero_grad(set_to_none=True)
            parts, extremes = _held_pairs_step(
                backend, batch, traj[mine], col_all[idx][mine], settings, reference, idx.numel()
            )
            sum_gradients(params, ranks)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            optimizer.step()

            dev, neg_min, top = all_reduce(extremes, ranks, "max").tolist()
            if first_dev is None:
                first_dev = dev
            ratio_min, ratio_max = min(ratio_min, -neg_min), max(ratio_max, top)
            totals = all_reduce(parts, ranks).tolist() + [float(grad_norm)]
            for key, value in zip(_SUMMED, totals, strict=True):
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    metrics = {key: total / count for key, total in sums.items()}
    metrics |= {
        "train/ratio_min": ratio_min,
        "train/ratio_max": ratio_max,
        "train/ratio_dev_first": first_dev,
        "train/optimizer_steps": float(count),
    }
    return metrics


def _held_pairs_step(backend, batch, traj, col, settings, reference, size: int):
    """Backward of the clipped loss of the held pairs (traj, col), each (M,) — summed and divided
    by the minibatch's `size`, so that the ranks' parts add up to the minibatch mean (bit for bit
    in one process) — in micro-batches of `settings.micro_batch_size` pairs whose gradients
    accumulate (one when 0). Returns the parts of the `_SUMMED` means but the gradient norm (5,)
    and max |r − 1|, −min r and max r over the held pairs (3,) (0, −inf, −inf when M = 0)."""
    parts, extremes = torch.zeros(5), torch.tensor([0.0, -math.inf, -math.inf])
    chunk = settings.micro_batch_size or max(traj.numel(), 1)
    for start in range(0, traj.numel(), chunk):
        pick = slice(start, start + chunk)
        part, extreme = _pairs_backward(
            backend, batch, traj[pick], col[pick], settings, reference, size
        )
        parts, extremes = parts + part, torch.maximum(extremes, extreme)
    return parts, extremes


def _pairs_backward(backend, batch, traj, col, settings, reference, size: int):
    """`_held_pairs_step` of one micro-batch of M ≥ 1 pairs: (5,) parts and (3,) extremes."""
    log_prob, old, adv, weights, kl = pair_terms(backend, batch, traj, col, settings, reference)
    pg, stats = ppo_clip_loss(log_prob, old, adv, clip_range=settings.clip_range)
    loss = (weights * (pg + settings.kl_beta * kl)).sum() / size
    loss.backward()
    ratio = stats["ratio"]
    parts = torch.stack(
        [
            loss.detach(),
            (weights * pg).sum().detach() / size,
            kl.detach().sum() / size,
            stats["clipped"].float().sum() / size,
            stats["approx_kl"].sum() / size,
        ]
    )
    return parts, torch.stack([(ratio - 1.0).abs().max(), -ratio.min(), ratio.max()])


# per-minibatch values averaged over the update's minibatches, in the order grpo_update sums them
_SUMMED = (
    "train/loss",
    "train/policy_loss",
    "train/kl",
    "train/clipfrac",
    "train/approx_kl",
    "train/grad_norm",
)
