"""How much of one round's policy gradient is signal? (the decisive-experiment search)

GRPO's update direction is the likelihood-ratio gradient Σ A_{i,k} ∇ log p_θ(x_{k+1} | x_k): each
pair contributes A · ε/σ · ∂μ/∂θ, a draw of the SDE's D-dimensional noise ε pushed through the
network. Its expectation is the useful direction; its spread grows with D. This benchmark rolls
out one batch on fixed training prompts, assigns credit with each method's rule, splits the
prompt groups into `--parts` disjoint parts and computes each part's gradient of the GRPO
surrogate at the on-policy point (ratio = 1, no clip active) on the LoRA weights. For gradients
g_j = s + n_j (shared signal s, independent noise n_j) the mean pairwise cosine estimates
|s|² / (|s|² + |n|²) = SNR² / (1 + SNR²) at the part's size; SNR² grows linearly with the
trajectories averaged, which gives the batch a gradient step would need to point the right way
more often than not (SNR = 1).

Which prompts the parts share decides which signal the cosine counts: group g is prompt
g mod P and falls in part g mod 4. With P a multiple of 4 the parts' prompts are disjoint and
the cosine counts only the signal prompts share; with P odd every part holds every prompt (per
draw of `--groups-per-prompt`) and it counts each prompt's own signal too. On the default
recipe the two differ: −0.04 ± 0.15 (P = 24) against +0.155 ± 0.11 (P = 25), 4 draws, 8
trajectories per group (reports/search.md, session 17 §1). The default P = 6 lies between
(parts 0 and 2 share their prompts, as do 1 and 3).

Rows: each method with the `geneval` reward; flow_grpo with a shared initial noise per group and
a three-step SDE window; and the control reward `brightness` (mean image intensity, smooth and
dense) that any working policy gradient should pick up.

    python benchmarks/gradient_snr.py            # ~15 min on one core

writes reports/gradient_snr.json and reports/gradient_snr.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = {  # name -> (method, overrides); the reward is params.yaml's unless overridden
    "flow_grpo": ("flow_grpo", []),
    "stepwise": ("stepwise", []),
    "tp_grpo": ("tp_grpo", []),
    "flow_grpo, shared x_T, window 0-3": (
        "flow_grpo",
        ["rollout.shared_noise=true", "rollout.window_end=3"],
    ),
    "flow_grpo, brightness reward": ("flow_grpo", ["score.rewards={brightness: 1}"]),
}


def part_gradients(backend, batch, settings, groups: torch.Tensor, parts: int) -> torch.Tensor:
    """(parts, K, P) on-policy surrogate gradients on the LoRA weights (P entries), one per part
    of the prompt groups and per trained step column K."""
    from pipeline.grpo import lora_parameters, pair_terms

    params = lora_parameters(backend.transformer)
    traj, col = batch.pairs()
    n_cols = batch.advantages.shape[1]
    part_of_pair = groups[traj] % parts
    out = torch.zeros(parts, n_cols, sum(p.numel() for p in params))
    for part, k in itertools.product(range(parts), range(n_cols)):
        pick = (part_of_pair == part) & (col == k)
        for p in params:
            p.grad = None
        log_prob, old, adv, _, _ = pair_terms(backend, batch, traj[pick], col[pick], settings)
        (-(adv * torch.exp(log_prob - old))).sum().backward()
        out[part, k] = torch.cat([p.grad.flatten() for p in params])
    return out


def pairwise_cosines(grads: torch.Tensor) -> torch.Tensor:
    """grads (parts, P) -> the cosines of every pair of parts, (parts (parts - 1) / 2,)."""
    unit = torch.nn.functional.normalize(grads, dim=1)
    i, j = torch.triu_indices(len(grads), len(grads), offset=1)
    return (unit @ unit.T)[i, j]


def snr1_bound(cosine: float, cosines: torch.Tensor, trajectories: int) -> float | None:
    """Fewest trajectories per gradient step for SNR = 1 that the measurement allows: with c the
    cosine's upper 95 % bound (mean + 2 standard errors over the pairs), SNR² ≤ c / (1 − c) at
    `trajectories`, and SNR² grows linearly with them. None when even c is ≥ 0.5 (resolved)."""
    upper = cosine + 2.0 * float(cosines.std()) / len(cosines) ** 0.5
    if upper >= 0.5:
        return None
    return trajectories * (1.0 - upper) / max(upper, 1e-6)


def base_round(cfg, method: str, n_prompts: int, *, seed: int, groups_per_prompt: int = 1):
    """One round of the base policy (a fresh LoRA) on `n_prompts` evenly spaced training prompts,
    each drawn `groups_per_prompt` times: (backend, schedule, rollout, GenEval lines of its
    trajectories, the NFE counter). Shared with the search's scratch measurements."""
    from pipeline import layout
    from pipeline.policy import Policy
    from pipeline.rounds import CountingVelocity, Schedule, rollout_round

    backend = Policy.create(cfg).backend
    schedule = Schedule.from_config(cfg)
    prompts = layout.load_prompts(cfg, "train")
    chosen = list(range(0, len(prompts), max(len(prompts) // n_prompts, 1)))[:n_prompts]
    indices = chosen * groups_per_prompt
    counter = CountingVelocity(backend, cfg.sampling.guidance)
    rollout = rollout_round(
        backend, prompts, indices, schedule, cfg, method=method, seed=seed, round_index=0,
        run_id="snr", model_version="base", counter=counter,
    )  # fmt: skip
    metadata = [prompts[i] for i in indices for _ in range(cfg.rollout.group_size)]
    return backend, schedule, rollout, metadata, counter


def measure(name: str, args) -> dict:
    from pipeline.config import load_config
    from pipeline.grpo import UpdateBatch
    from pipeline.rewards import RewardMix
    from pipeline.rounds import (
        assign_credit,
        estimators_for,
        reward_matrix,
        score_round,
        update_settings,
    )

    method, overrides = ROWS[name]
    cfg = load_config(args.params, [f"train.method={method}", *overrides])
    start = time.perf_counter()
    backend, schedule, rollout, metadata, counter = base_round(
        cfg, method, args.prompts, seed=args.seed, groups_per_prompt=args.groups_per_prompt
    )
    rewards = RewardMix(cfg, cfg.score.rewards)
    table = score_round(
        backend, rollout, metadata, rewards, cfg, estimators=estimators_for(method, cfg),
        schedule=schedule, counter=counter,
    ).table  # fmt: skip
    credit = assign_credit(method, table, rollout.group_ids, schedule, cfg)
    last_state = torch.tensor([schedule.sigmas.numel() - 1])
    final = reward_matrix(table, "final", "mix", rollout.num_trajectories, last_state)[:, 0]
    group_std = final.view(-1, cfg.rollout.group_size).std(dim=1, correction=0)  # group-major rows
    batch = UpdateBatch(
        states=rollout.states, log_probs=rollout.log_probs, sigmas=rollout.sigmas,
        steps=schedule.steps, advantages=credit.advantages,
        embeds=backend.encode_prompts(rollout.prompts),
    )  # fmt: skip
    # The policy-gradient surrogate only: no KL term, so no reference pass.
    settings = dataclasses.replace(update_settings(cfg, schedule), kl_beta=0.0)
    grads = part_gradients(backend, batch, settings, rollout.group_ids, 4)
    trajectories_per_part = rollout.num_trajectories // 4
    cosines = pairwise_cosines(grads.sum(dim=1))
    overall = float(cosines.mean())
    per_step = [float(pairwise_cosines(grads[:, k]).mean()) for k in range(grads.shape[1])]
    norms = grads.sum(dim=0).norm(dim=1) / 4
    return {
        "row": name,
        "method": method,
        "reward": ",".join(cfg.score.rewards),
        "overrides": overrides,
        "trajectories": rollout.num_trajectories,
        "trajectories_per_part": trajectories_per_part,
        "reward_mean": float(final.mean()),
        "groups_without_variance": float((group_std < 1e-6).float().mean()),
        "cosine": overall,
        "cosine_spread": float(cosines.std()),  # over the part pairs
        "cosine_per_step": per_step,
        "grad_norm_per_step": norms.tolist(),
        "trajectories_for_snr1_at_least": snr1_bound(overall, cosines, trajectories_per_part),
        "seconds": time.perf_counter() - start,
    }


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Policy-gradient signal per round (`benchmarks/gradient_snr.py`)",
        "",
        f"Command: `{command}`. Base policy (fresh LoRA), one batch per row, the groups split "
        "into 4 disjoint parts; cosine = mean pairwise cosine of the parts' surrogate gradients "
        "(≈ SNR²/(1+SNR²) at a part's size, 0 for pure noise; ± its spread over the 6 pairs).",
        "",
        "| row | trajectories per part | reward mean | groups w/o variance | cosine | cosine per "
        "trained step | gradient norm, last / first trained step | trajectories per gradient step "
        "for SNR = 1 (95 % bound) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        need = r["trajectories_for_snr1_at_least"]
        lines.append(
            f"| {r['row']} | {r['trajectories_per_part']} | {r['reward_mean']:.3f} | "
            f"{r['groups_without_variance']:.2f} | {r['cosine']:+.3f} ± {r['cosine_spread']:.3f} | "
            + " ".join(f"{c:+.2f}" for c in r["cosine_per_step"])
            + f" | {r['grad_norm_per_step'][-1] / r['grad_norm_per_step'][0]:.0f}×"
            + f" | {'resolved' if need is None else f'≥ {need:,.0f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(REPO / "params.yaml"))
    parser.add_argument("--prompts", type=int, default=6, help="training prompts, evenly spaced")
    parser.add_argument("--groups-per-prompt", type=int, default=8)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", type=Path, default=REPO / "reports")
    args = parser.parse_args()
    from pipeline.io import write_json, write_text

    rows = []
    for name in args.rows:
        rows.append(measure(name, args))
        print(f"{name}: cosine {rows[-1]['cosine']:+.3f} ({rows[-1]['seconds']:.0f} s)")
    command = "python benchmarks/gradient_snr.py"
    write_json(args.out / "gradient_snr.json", {"command": command, "rows": rows})
    write_text(args.out / "gradient_snr.md", markdown(rows, command))


if __name__ == "__main__":
    main()
