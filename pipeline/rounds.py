"""One GRPO round as library calls: rollout -> score -> advantages -> update.

The stages and the training flow call these; they hold no I/O. Shapes: N trajectories
(prompts_per_round · G, group-major), T schedule steps, K trained (SDE-window) steps, states
(N, T+1, C, H, W) with x_T first. The window's K+1 *boundary states* b_0..b_K are the states
before each trained step plus the one after the last; their clean-image rewards drive the
step-wise credit of `stepwise` and `tp_grpo`. Because every step after the window is a
deterministic ODE step, the completion of b_K *is* the final image, so column K is R(x0).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from pipeline import credit, distributed, sampling
from pipeline.config import Config, CreditflowError
from pipeline.distributed import SINGLE, Ranks
from pipeline.grpo import UpdateBatch, UpdateSettings, grpo_update, lora_state_dict
from pipeline.rewards import REWARDS, RewardMix
from pipeline.trajectories import RoundRollout


class RoundError(CreditflowError):
    """A round cannot go on (non-finite rewards or advantages); nothing is checkpointed."""


#: The clean-image estimators each method's credit needs besides the final reward.
METHOD_ESTIMATORS = {"flow_grpo": (), "stepwise": ("stepwise",), "tp_grpo": ("ode_completion",)}


def estimators_for(method: str, cfg: Config) -> tuple[str, ...]:
    """The estimators `score_round` must compute for `method` (stepwise's is `score.estimator`)."""
    needed = METHOD_ESTIMATORS[method]
    return tuple(cfg.score.estimator if name == "stepwise" else name for name in needed)


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (run seed, round, phase): resumable by design."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))


@dataclass(frozen=True)
class Schedule:
    """The round's sampling plan: sigmas (T+1,), window (T,) bool, steps (K,) trained indices."""

    kind: str
    eta: float
    guidance: float
    sigmas: Tensor
    window: Tensor
    steps: Tensor

    @classmethod
    def from_config(cls, cfg: Config, kind: str | None = None) -> Schedule:
        kind = kind or cfg.sampler
        sigmas = sampling.timesteps_sigmas(cfg.sampling.num_steps, shift=cfg.sampling.shift)
        window = sampling.sde_window(
            cfg.sampling.num_steps,
            start=cfg.rollout.window_start,
            end=cfg.sde_window_end,
            kind=kind,
        )
        steps = window.nonzero().flatten()
        if steps.numel() == 0:
            raise ValueError(f"the SDE window of sampler {kind!r} holds no trainable step")
        hybrid, k = cfg.advantages.final_reward_steps, steps.numel()
        if cfg.train.method == "stepwise" and hybrid >= k:
            raise ValueError(
                f"advantages.final_reward_steps={hybrid} leaves none of the {k} trained steps of "
                f"sampler {kind!r} its step-wise gain: use a value below {k}, or flow_grpo for "
                "the final reward at every step"
            )
        eta = cfg.rollout.eta.get(kind, 0.0)
        return cls(kind, eta, cfg.sampling.guidance, sigmas, window, steps)

    @classmethod
    def of_rollout(cls, rollout: RoundRollout, cfg: Config) -> Schedule:
        """The plan a cached round was sampled with (its sampler, eta, sigmas and window, read
        from the cache); params that would sample it otherwise are an error, not a silent
        re-interpretation of the round."""
        planned = cls.from_config(cfg, kind=rollout.sampler)
        cached = cls(
            rollout.sampler,
            rollout.eta,
            cfg.sampling.guidance,
            rollout.sigmas.to(planned.sigmas.dtype),
            rollout.window.bool(),
            rollout.window.nonzero().flatten(),
        )
        differs = [
            name
            for name, same in (
                ("eta", math.isclose(planned.eta, cached.eta, rel_tol=1e-6)),
                ("sigmas (sampling.num_steps/shift)", torch.equal(planned.sigmas, cached.sigmas)),
                ("SDE window (rollout.window_*)", torch.equal(planned.window, cached.window)),
            )
            if not same
        ]
        if differs:
            raise CreditflowError(
                f"round {rollout.round} was sampled with another {', '.join(differs)} than the "
                "params give: use the params it was sampled with, or roll the round out again"
            )
        return cached

    @property
    def boundary_states(self) -> Tensor:
        """(K+1,) state indices b_0..b_K (the window is contiguous by construction)."""
        return torch.cat([self.steps, self.steps[-1:] + 1])


class CountingVelocity:
    """Velocity calls of a backend for fixed prompt rows, counting model evaluations (NFEs).

    One NFE is one sample through the denoiser; classifier-free guidance costs two.
    """

    def __init__(self, backend, guidance: float):
        self.backend = backend
        self.guidance = guidance
        self.nfe = 0

    def bind(self, embeds, on_call=None) -> sampling.VelocityFn:
        """A velocity function for these prompt rows; `on_call(n)` runs after each call.

        Called with `rows` (indices into the bound rows) it conditions only those rows, as
        `sampling.ode_complete` asks; without, on all of them.
        """
        branches = 1 if self.guidance == 1 else 2

        def velocity(x: Tensor, sigma: Tensor, rows: Tensor | None = None) -> Tensor:
            self.nfe += x.shape[0] * branches
            rows_embeds = embeds if rows is None else embeds[rows]
            v = self.backend.velocity(x, sigma, rows_embeds, guidance=self.guidance)
            if on_call is not None:
                on_call(x.shape[0])
            return v

        return velocity


def select_prompts(prompts: Sequence[dict], n: int, *, seed: int, round_index: int) -> list[int]:
    """Indices of the round's n prompts: a seeded draw without replacement per round."""
    rng = np.random.default_rng(derived_seed(seed, round_index, "prompts"))
    return sorted(rng.choice(len(prompts), size=min(n, len(prompts)), replace=False).tolist())


def rollout_round(
    backend,
    prompts: Sequence[dict],
    prompt_indices: Sequence[int],
    schedule: Schedule,
    cfg: Config,
    *,
    method: str,
    seed: int,
    round_index: int,
    run_id: str,
    model_version: str,
    counter: CountingVelocity,
    progress=None,
    ranks: Ranks = SINGLE,
) -> RoundRollout:
    """G trajectories for each chosen prompt, sampled as one batch (group-major rows).

    `progress` (a tqdm bar over denoising steps, total = trajectories x T) advances by the
    batch rows of each model call. Over several ranks each samples its shard of the round's
    rows (`distributed.shard`) with the noise one process would draw for them.
    """
    group_size = cfg.rollout.group_size
    n_all = len(prompt_indices) * group_size
    mine = distributed.shard(n_all, ranks)
    rows = [prompts[i] for i in prompt_indices for _ in range(group_size)][mine]
    embeds = backend.encode_prompts([row["prompt"] for row in rows])
    noise_gen = generator(seed, round_index, "rollout")
    x_T = sampling.initial_noise(
        len(prompt_indices),
        group_size,
        backend.latent_shape,
        shared=cfg.rollout.shared_noise,
        generator=noise_gen,
    )  # (N, C, H, W)
    with torch.no_grad():
        on_call = progress.update if progress is not None else None
        result = sampling.sample(
            counter.bind(embeds, on_call),
            x_T[mine],
            schedule.sigmas,
            kind=schedule.kind,
            eta=schedule.eta,
            window=schedule.window,
            generator=noise_gen,
            keep_velocities=True,  # the clean-image estimates of `score` start from them
            noise_rows=(n_all, mine) if ranks.distributed else None,
        )
        images = backend.decode(result.final)
    # log-probs are NaN off the window by design; a non-finite state or image is what breaks
    for what, values in (("state", result.states), ("image", images)):
        if not torch.isfinite(values).all():
            raise RoundError(
                f"rollout: non-finite {what} in round {round_index} (the policy's weights or "
                "model.dtype?); nothing was cached"
            )
    n = len(rows)
    return RoundRollout(
        run_id=run_id,
        round=round_index,
        method=method,
        sampler=schedule.kind,
        eta=schedule.eta,
        model_version=model_version,
        states=result.states,
        means=result.means,
        stds=result.stds,
        log_probs=result.log_probs,
        sigmas=result.sigmas,
        window=result.window,
        images=images,
        prompt_ids=[
            str(prompts[i].get("id", i)) for i in prompt_indices for _ in range(group_size)
        ][mine],
        prompts=[row["prompt"] for row in rows],
        tags=[row["tag"] for row in rows],
        group_ids=torch.arange(len(prompt_indices)).repeat_interleave(group_size)[mine],
        sample_idx=torch.arange(group_size).repeat(len(prompt_indices))[mine],
        seeds=torch.full((n,), derived_seed(seed, round_index, "rollout"), dtype=torch.long),
        velocities=result.velocities,
    )


@dataclass
class ScoreResult:
    """A round's score table plus the decoded estimates of a few trajectories."""

    table: pd.DataFrame  # columns trajectory, step, estimator, reward, value
    estimate_images: Tensor  # (M, 3, H, W)
    estimate_keys: pd.DataFrame  # trajectory, step, estimator per image
    stats: dict[str, float] = field(default_factory=dict)


def clean_estimates(
    backend,
    rollout: RoundRollout,
    traj: Tensor,
    state: Tensor,
    *,
    estimator: str,
    substeps: int,
    completion_steps: int,
    counter: CountingVelocity,
    batch_size: int,
) -> Tensor:
    """x̂0 of states (traj[m], state[m]), each (M,) long, in batches -> (M, C, H, W).

    tweedie: x − σ v; ode_substeps: T′ Euler substeps to 0 (Savani et al. 2026);
    ode_completion: the rest of the rollout's schedule, deterministically (Tong et al. 2026), in
    at most `completion_steps` Euler steps (0 = all). The velocity the rollout computed at each
    state (its cache keeps it; `counter` guides as the rollout did, `sampling.guidance`) is the
    first model call of every one of them, so it is reused: Tweedie costs no call, the others
    one fewer.
    """
    out = []
    for start in range(0, traj.numel(), batch_size):
        t, s = traj[start : start + batch_size], state[start : start + batch_size]
        x = rollout.states[t, s]  # (b, C, H, W)
        v0 = None if rollout.velocities is None else rollout.velocities[t, s]
        velocity = counter.bind(backend.encode_prompts([rollout.prompts[i] for i in t.tolist()]))
        with torch.no_grad():
            if estimator == "ode_completion":
                out.append(
                    sampling.ode_complete(
                        velocity, x, s, rollout.sigmas, max_steps=completion_steps,
                        first_velocity=v0,
                    )
                )  # fmt: skip
            else:
                steps = 1 if estimator == "tweedie" else substeps
                out.append(
                    sampling.ode_substeps(velocity, x, rollout.sigmas[s], steps, first_velocity=v0)
                )
    return torch.cat(out)


def most_nonmonotonic(estimates: Tensor, final: Tensor, limit: int) -> Tensor:
    """The `limit` trajectories whose reward path wanders most, for the report's figure.

    estimates: (N, K) rewards of the clean-image estimates along the steps; final: (N,) final
    rewards. A path is [estimates..., final]; its excess variation is its total variation minus
    its net change (0 when monotonic). Returns the chosen trajectory indices, ascending; ties
    go to the lower index.
    """
    path = torch.cat([estimates, final[:, None]], dim=1).double()  # (N, K+1)
    excess = path.diff(dim=1).abs().sum(dim=1) - (path[:, -1] - path[:, 0]).abs()
    return torch.argsort(-excess, stable=True)[:limit].sort().values


def score_round(
    backend,
    rollout: RoundRollout,
    metadata: Sequence[dict],
    rewards: RewardMix,
    cfg: Config,
    *,
    estimators: Sequence[str],
    schedule: Schedule,
    counter: CountingVelocity,
    ranks: Ranks = SINGLE,
) -> ScoreResult:
    """Rewards of the final images and of the requested estimates at the boundary states.

    `metadata` (N,) is each trajectory's GenEval line. `estimators` may hold `tweedie`,
    `ode_substeps` and `ode_completion`; the final image is always scored. Over several ranks
    each scores its shard of the trajectories and every rank gets the whole round's result.
    """
    n_all = rollout.num_trajectories
    mine = distributed.shard(n_all, ranks)
    rollout, metadata, offset = rollout.rows(mine), metadata[mine], mine.start
    n = rollout.num_trajectories
    boundary = schedule.boundary_states[:-1]  # (K,): b_K's estimate is the final image
    frames, keep_images, keep_keys = [], [], []
    reward_calls = 0

    def add(values: dict[str, Tensor], traj: Tensor, step: Tensor, estimator: str) -> None:
        for name, value in values.items():
            frames.append(
                pd.DataFrame(
                    {
                        "trajectory": traj.numpy() + offset,
                        "step": step.numpy(),
                        "estimator": estimator,
                        "reward": name,
                        "value": value.double().numpy(),
                    }
                )
            )

    all_traj = torch.arange(n)
    traj = all_traj.repeat_interleave(boundary.numel())  # (N*K,) trajectory-major
    state = boundary.repeat(n)
    batch = cfg.score.batch_size
    batches = list(zip(traj.split(batch), state.split(batch), strict=True))
    # Rewards are scored on a second thread, batch by batch, while the network computes the next
    # batch's estimates: ShapesWorld's detector runs in worker processes, so its cost hides
    # behind the model calls instead of adding to them. Same batches, same values.
    with ThreadPoolExecutor(1, thread_name_prefix="rewards") as rewarding:
        final_job = rewarding.submit(rewards, rollout.images, metadata)
        start = time.perf_counter()
        estimated = {}  # estimator -> (its decoded images per batch, their reward jobs)
        for estimator in estimators:
            estimated[estimator] = [], []
            for traj_b, state_b in batches:
                x0 = clean_estimates(
                    backend,
                    rollout,
                    traj_b,
                    state_b,
                    estimator=estimator,
                    substeps=cfg.score.ode_substeps,
                    completion_steps=cfg.score.completion_steps,
                    counter=counter,
                    batch_size=cfg.score.batch_size,
                )
                with torch.no_grad():
                    image_b = backend.decode(x0)  # (b, 3, H, W)
                estimated[estimator][0].append(image_b)
                estimated[estimator][1].append(
                    rewarding.submit(rewards, image_b, [metadata[i] for i in traj_b.tolist()])
                )
        final = final_job.result()
        add(final, all_traj, torch.full((n,), rollout.num_steps), "final")
        reward_calls += n
        for estimator, (batch_images, jobs) in estimated.items():
            values = {name: torch.cat([job.result()[name] for job in jobs]) for name in final}
            images = torch.cat(batch_images)  # (N*K, 3, H, W)
            add(values, traj, state, estimator)
            reward_calls += traj.numel()
            picked = most_nonmonotonic(
                values["mix"].view(n, boundary.numel()), final["mix"], cfg.score.estimate_images
            )
            shown = torch.isin(traj, picked)
            keep_images.append(images[shown])
            keep_keys.append(
                pd.DataFrame(
                    {
                        "trajectory": traj[shown].numpy() + offset,
                        "step": state[shown].numpy(),
                        "estimator": estimator,
                    }
                )
            )
    table = pd.concat(frames, ignore_index=True)
    if keep_images:
        estimate_images, keys = torch.cat(keep_images), pd.concat(keep_keys, ignore_index=True)
    else:
        estimate_images = rollout.images[:0]
        keys = pd.DataFrame({"trajectory": [], "step": [], "estimator": []})
    stats = {
        "cost/score_reward_calls": float(reward_calls),
        "time/estimates_s": time.perf_counter() - start,
    }
    result = ScoreResult(table, estimate_images, keys, stats)
    if ranks.distributed:
        result = _whole_round(distributed.gather_objects(result, ranks), n_all, schedule, cfg)
    return result


def _whole_round(shards: Sequence[ScoreResult], n: int, schedule: Schedule, cfg: Config):
    """The ranks' score results of their shards as one round's: the tables joined, and of the
    decoded estimates those of the round's most non-monotonic trajectories (each is among its
    shard's, which every shard kept)."""
    table = pd.concat([s.table for s in shards], ignore_index=True)
    keys = pd.concat([s.estimate_keys for s in shards], ignore_index=True)
    images = torch.cat([s.estimate_images for s in shards])
    final = reward_matrix(table, "final", "mix", n, torch.tensor([schedule.sigmas.numel() - 1]))
    keep = np.zeros(len(keys), dtype=bool)
    for estimator in keys.estimator.unique():
        boundary = reward_matrix(table, estimator, "mix", n, schedule.boundary_states[:-1])
        picked = most_nonmonotonic(boundary, final[:, 0], cfg.score.estimate_images)
        keep |= ((keys.estimator == estimator) & keys.trajectory.isin(picked.tolist())).to_numpy()
    stats = {
        "cost/score_reward_calls": sum(s.stats["cost/score_reward_calls"] for s in shards),
        "time/estimates_s": max(s.stats["time/estimates_s"] for s in shards),
    }
    keys = keys[keep].reset_index(drop=True)
    return ScoreResult(table, images[torch.from_numpy(keep)], keys, stats)


def check_finite(table: pd.DataFrame) -> None:
    """Stop the round on a NaN/inf reward, naming the first trajectory that has one."""
    bad = table[~np.isfinite(table.value.to_numpy())]
    if len(bad):
        row = bad.iloc[0]
        raise RoundError(
            f"reward {row.reward!r} of trajectory {int(row.trajectory)} is {row.value} "
            f"({row.estimator} estimate at state {int(row.step)})"
        )


def reward_matrix(
    table: pd.DataFrame, estimator: str, reward: str, n: int, steps: Tensor
) -> Tensor:
    """(n, len(steps)) fp64 values of `estimator`/`reward` at state indices `steps`."""
    rows = table[(table.estimator == estimator) & (table.reward == reward)]
    wide = rows.pivot(index="trajectory", columns="step", values="value")
    wide = wide.reindex(index=range(n), columns=steps.tolist())
    if wide.isna().to_numpy().any():
        raise ValueError(f"score table lacks {estimator}/{reward} values for some states")
    return torch.from_numpy(wide.to_numpy(dtype=np.float64, copy=True))


def final_verdicts(
    table: pd.DataFrame, rollout: RoundRollout, metadata: Sequence[dict], cfg: Config
) -> Tensor:
    """(N,) bool GenEval verdicts of a round's final images.

    The dense `geneval` reward is 1 exactly when GenEval judges an image correct
    (`pipeline.geneval.partial_score`), so a round scored with it is judged from its score table
    rather than by running the detector over the same images again; otherwise the detector
    judges them.
    """
    n = rollout.num_trajectories
    if "geneval" in cfg.score.rewards:
        final = torch.tensor([rollout.num_steps])
        return reward_matrix(table, "final", "geneval", n, final)[:, 0] == 1.0
    return REWARDS["geneval_strict"](cfg)(rollout.images, metadata).bool()


@dataclass
class Credit:
    """Advantages (N, K) of the trained steps plus diagnostics for the report."""

    advantages: Tensor
    step_rewards: Tensor  # (N, K) per-step signal before normalisation
    turning_points: Tensor  # (N, K) bool (tp_grpo only; all False otherwise)
    final_advantages: Tensor  # (N,) flow_grpo's advantage, for the sign comparison


def assign_credit(
    method: str,
    table: pd.DataFrame,
    group_ids: Tensor,
    schedule: Schedule,
    cfg: Config,
    *,
    reward: str = "mix",
    stepwise_estimator: str | None = None,
) -> Credit:
    """Turn a round's scores into (N, K) advantages with `method`'s rule (pipeline.credit)."""
    n = group_ids.numel()
    k = schedule.steps.numel()
    adv_cfg = cfg.advantages
    final = reward_matrix(table, "final", reward, n, torch.tensor([schedule.sigmas.numel() - 1]))[
        :, 0
    ]
    final_adv = credit.flow_grpo_advantages(
        final, group_ids, global_std=adv_cfg.global_std, clip=adv_cfg.clip
    )
    turning = torch.zeros(n, k, dtype=torch.bool)
    if method == "flow_grpo":
        step_rewards = final[:, None].expand(n, k)
        advantages = final_adv[:, None].expand(n, k)
    else:
        estimator = (
            "ode_completion" if method == "tp_grpo" else (stepwise_estimator or cfg.score.estimator)
        )
        boundary = reward_matrix(table, estimator, reward, n, schedule.boundary_states[:-1])
        columns = torch.cat([boundary, final[:, None]], dim=1)  # (N, K+1), last = R(x0)
        if method == "stepwise":
            step_rewards = credit.stepwise_gains(columns)
            step_rewards[:, k - adv_cfg.final_reward_steps :] = final[:, None]
            advantages = credit.stepwise_hybrid_advantages(
                columns,
                final_adv,
                group_ids,
                final_steps=adv_cfg.final_reward_steps,
                normalization=adv_cfg.normalization,
                clip=adv_cfg.clip,
            )
        else:
            switches = {
                "consistency": adv_cfg.tp_consistency,
                "first_step": adv_cfg.tp_first_step,
                "balance": adv_cfg.tp_balance,
            }
            turning = credit.tp_grpo_turning_points(final, columns, **switches)
            step_rewards = credit.tp_grpo_step_rewards(final, columns, turning)
            advantages = credit.tp_grpo_advantages(step_rewards, group_ids, clip=adv_cfg.clip)
    return Credit(advantages.float().contiguous(), step_rewards.float(), turning, final_adv.float())


def update_settings(cfg: Config, schedule: Schedule) -> UpdateSettings:
    up = cfg.update
    return UpdateSettings(
        kind=schedule.kind,
        eta=schedule.eta,
        guidance=schedule.guidance,
        clip_range=up.clip_range,
        kl_beta=up.kl_beta,
        inner_epochs=up.inner_epochs,
        minibatch_size=up.minibatch_size,
        max_grad_norm=up.max_grad_norm,
        micro_batch_size=up.micro_batch_size,
    )


def update_round(
    backend,
    optimizer: torch.optim.Optimizer,
    rollout: RoundRollout,
    advantages: Tensor,
    schedule: Schedule,
    cfg: Config,
    *,
    seed: int,
    round_index: int,
    ranks: Ranks = SINGLE,
) -> dict[str, float]:
    """One GRPO update of the LoRA weights from a round's cached transitions (rollout and
    advantages (N, K) of the whole round; over several ranks each computes its shard's pairs)."""
    mine = distributed.shard(rollout.num_trajectories, ranks)
    held = rollout.rows(mine)
    batch = UpdateBatch(
        states=held.states,
        log_probs=held.log_probs,
        sigmas=rollout.sigmas,
        steps=schedule.steps,
        advantages=advantages[mine],
        embeds=backend.encode_prompts(held.prompts),
        first_trajectory=mine.start,
        round_trajectories=rollout.num_trajectories,
    )
    settings = update_settings(cfg, schedule)
    metrics = grpo_update(
        backend, optimizer, batch, settings, generator=generator(seed, round_index, "update"),
        ranks=ranks,
    )  # fmt: skip
    check_update_finite(backend, metrics, round_index)
    # Forward passes per sample: CFG doubles each, the KL reference adds one more of each.
    per_pair = (1 if settings.guidance == 1 else 2) * (2 if settings.kl_beta > 0 else 1)
    pairs = advantages.numel() * settings.inner_epochs
    return metrics | {"cost/update_nfe": float(pairs * per_pair)}


def check_update_finite(backend, metrics: dict[str, float], round_index: int) -> None:
    """Raise RoundError naming what went non-finite in an update (loss, gradient norm or a LoRA
    weight), before anything is checkpointed."""
    bad = [name for name in ("train/loss", "train/grad_norm") if not math.isfinite(metrics[name])]
    bad += [
        f"LoRA weight {name}"
        for name, weight in lora_state_dict(backend.transformer).items()
        if not torch.isfinite(weight).all()
    ][:3]
    if bad:
        raise RoundError(
            f"update: non-finite {', '.join(bad)} in round {round_index} (update.lr too high?); "
            "nothing was checkpointed"
        )
