"""Does each credit rule's advantage track the policy's true per-step advantage?

GRPO weighs each trained step's ∇ log p(x_{k+1} | x_k) by an advantage. With the reward only at
the end, the step's true advantage is A*_k = V(x_{k+1}) − V(x_k), where V(x) is the expected
final reward when the policy carries on from x (its SDE over the rest of the window, then the
ODE). The credit rules stand in for it:

- flow_grpo: the final reward R, group-normalized, at every step. R − V(x_k) is A*_k plus the
  luck of the other steps: noisy, not biased;
- stepwise: the gain f(x_{k+1}) − f(x_k) of the reward f of an ODE estimate of the clean image
  (a coarse or the exact completion, or Tweedie's x − σv at no NFE), jointly normalized. No
  luck of later steps in it, but biased where f differs from V;
- tp_grpo: ODE-completion increments, R − f(x_k) at turning points, normalized per step.

The benchmark rolls out the base policy with each SDE (Flow-GRPO's, the DDIM-style one) on a
prompt file (default: the search's pool of 24 test lines, where GRPO learns), estimates V at
every window boundary state by Monte Carlo (`--continuations` continuations with the policy's
own sampler, each judged), and scores each rule's advantages against A*, per trained step and
pooled over the steps (the advantages as trained, so a rule's scale across steps counts):

- ρ: Pearson correlation over trajectories, both sides centred per prompt group (what a
  group's baseline leaves), the share of the rule's variation that tracks A*; with a 95 %
  bootstrap CI over prompt groups, and its difference to flow_grpo's rule on the same rounds
  (paired: the same resamples);
- ρ corrected: ρ over the square root of A*'s Monte Carlo reliability (its split-half
  correlation, Spearman–Brown), the correlation with the noise-free A*;
- sign: how often the trained advantage's sign is the centred A*'s (ties left out).

    python benchmarks/credit_fidelity.py     # 37 min at two threads (session 46)

writes reports/credit_fidelity.json and reports/credit_fidelity.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
POOL = REPO / "reports/search/oracle/pool24/prompts.jsonl"
SAMPLERS = ("flow_grpo", "stepwise")
RULES = {  # row name -> (method whose credit rule it is, overrides of its scoring)
    "flow_grpo (final reward)": ("flow_grpo", []),
    "stepwise (ODE gains, 3 Euler steps)": ("stepwise", []),
    "stepwise (ODE gains, exact completion)": ("stepwise", ["score.completion_steps=0"]),
    "stepwise (Tweedie gains)": ("stepwise", ["score.estimator=tweedie"]),
    "tp_grpo (3 Euler steps)": ("tp_grpo", []),
}


def centred(values: Tensor, group_ids: Tensor) -> Tensor:
    """(N, K) values minus their prompt group's mean per column; group_ids (N,)."""
    groups, inverse = group_ids.unique(return_inverse=True)
    sums = torch.zeros(groups.numel(), values.shape[1], dtype=values.dtype)
    sums.index_add_(0, inverse, values)
    counts = torch.bincount(inverse, minlength=groups.numel()).to(values.dtype)[:, None]
    return values - (sums / counts)[inverse]


def step_correlations(rule: Tensor, truth: Tensor, rows: Tensor | None = None) -> Tensor:
    """(K+1,) Pearson correlations of (N, K) values already centred per group (no further mean):
    one per column, then all columns pooled; over `rows` (a resample's row indices) if given."""
    if rows is not None:
        rule, truth = rule[rows], truth[rows]
    per_step = (rule * truth).sum(dim=0) / (rule.norm(dim=0) * truth.norm(dim=0))
    pooled = (rule * truth).sum() / (rule.norm() * truth.norm())
    return torch.cat([per_step, pooled[None]])


def group_resamples(group_ids: Tensor, draws: int, seed: int) -> list[Tensor]:
    """`draws` row-index sets, each the rows of the prompt groups drawn with replacement: a
    group's centring stays valid in every resample."""
    members = [(group_ids == g).nonzero().flatten() for g in group_ids.unique()]
    rng = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(members), (draws, len(members)), generator=rng)
    return [torch.cat([members[i] for i in pick.tolist()]) for pick in picks]


def interval(draws: Tensor) -> list[list[float]]:
    """(D, M) bootstrap draws -> M [2.5 %, 97.5 %] percentile intervals."""
    levels = torch.tensor([0.025, 0.975], dtype=draws.dtype)
    # a resample whose advantages are constant in a column has no correlation there (NaN)
    return torch.nanquantile(draws, levels, dim=0).T.tolist()


def fidelity(
    advantages: dict[str, Tensor],
    truth: Tensor,
    halves: tuple[Tensor, Tensor],
    group_ids: Tensor,
    resamples: list[Tensor],
) -> dict:
    """Each rule's agreement with the Monte Carlo A*, per trained step and pooled over steps.

    advantages: rule name -> (N, K) trained advantages, the first rule the reference the others
    are compared with; truth: (N, K) A*; halves: A* from each half of the continuations. Per rule:
    ρ (K+1: the steps, then pooled) with bootstrap CIs over prompt groups, ρ corrected for A*'s
    Monte Carlo noise, ρ minus the reference's ρ (paired CI: the same resamples) and the sign
    agreement per step; per round: A*'s split-half reliability and its std per step.
    """
    true = centred(truth.double(), group_ids)
    half_a, half_b = (centred(h.double(), group_ids) for h in halves)
    r_half = step_correlations(half_a, half_b)
    reliability = 2 * r_half / (1 + r_half)  # Spearman–Brown: the mean of both halves
    # 1 / √reliability; undefined where the halves do not correlate (too few continuations)
    attenuation = torch.where(reliability > 0, reliability.clamp(min=1e-12).rsqrt(), torch.nan)
    rules, reference = {}, None
    for name, adv in advantages.items():
        rule = centred(adv.double(), group_ids)
        rho = step_correlations(rule, true)
        draws = torch.stack([step_correlations(rule, true, rows) for rows in resamples])
        decided = (adv != 0) & (true != 0)
        agree = ((adv.sign() == true.sign()) & decided).sum(dim=0) / decided.sum(dim=0).clamp(min=1)
        rules[name] = {
            "rho": rho.tolist(),
            "rho_ci95": interval(draws),
            "rho_corrected": (rho * attenuation).tolist(),
            "sign_agreement": agree.tolist(),
        }
        if reference is None:
            reference = rho, draws
        else:
            rules[name]["minus_reference"] = (rho - reference[0]).tolist()
            rules[name]["minus_reference_ci95"] = interval(draws - reference[1])
    return {
        "reference": next(iter(advantages)),
        "reliability": reliability.tolist(),
        "true_std": true.std(dim=0, correction=0).tolist(),
        "rules": rules,
    }


def monte_carlo_values(
    backend, rollout, schedule, metadata, rewards, final, *, continuations, seed, batch
):
    """(N, K+1, C) final rewards of C continuations from each window boundary state; final (N,)
    is the rollout's own final rewards.

    A boundary state every trajectory of a group shares (x_T with a shared noise, or its
    deterministic successor) has the same value across the group: centring removes it, so it is
    not sampled (zeros). A state with no stochastic step left is completed by the ODE the
    rollout itself ran, so its value is the trajectory's own final reward.
    """
    from pipeline import sampling

    n, boundary = rollout.num_trajectories, schedule.boundary_states.tolist()
    values = torch.zeros(n, len(boundary), continuations, dtype=torch.float64)
    embeds = backend.encode_prompts(rollout.prompts)
    noise = torch.Generator().manual_seed(seed)
    for j, b in enumerate(boundary):
        states = rollout.states[:, b]
        if not centred(states.flatten(1).double(), rollout.group_ids).any():
            continue
        if not bool(schedule.window[b:].any()):
            values[:, j] = final[:, None]
            continue
        rows = torch.arange(n).repeat_interleave(continuations)  # (N*C,) trajectory-major
        finals = []
        for chunk in tqdm(rows.split(batch), desc=f"continuations from state {b}", unit="batch"):
            with torch.no_grad():
                out = sampling.sample(
                    lambda x, s, _e=embeds[chunk]: backend.velocity(
                        x, s, _e, guidance=schedule.guidance
                    ),
                    states[chunk],
                    schedule.sigmas[b:],
                    kind=schedule.kind,
                    eta=schedule.eta,
                    window=schedule.window[b:],
                    generator=noise,
                    keep_states=False,
                )
                images = backend.decode(out.final)
            finals.append(rewards(images, [metadata[i] for i in chunk.tolist()])["mix"].double())
        values[:, j] = torch.cat(finals).view(n, continuations)
    return values


def one_round(backend, schedule, cfg, prompts, rewards, round_index: int, args):
    """One round of the base policy on every prompt (`cfg`: the params with the round's sampler):
    its final rewards (N,), the Monte Carlo A* (N, K) and its two halves, and each rule's trained
    advantages (N, K)."""
    from pipeline.config import load_config
    from pipeline.rounds import (
        CountingVelocity,
        assign_credit,
        derived_seed,
        estimators_for,
        reward_matrix,
        rollout_round,
        score_round,
    )

    rollout = rollout_round(
        backend, prompts, list(range(len(prompts))), schedule, cfg, method="fidelity",
        seed=args.seed, round_index=round_index, run_id="fidelity", model_version="base",
        counter=CountingVelocity(backend, cfg.sampling.guidance),
    )  # fmt: skip
    metadata = [line for line in prompts for _ in range(cfg.rollout.group_size)]
    advantages, tables = {}, {}  # tables: one score table per distinct scoring override
    for name, (method, overrides) in RULES.items():
        rule_cfg = load_config(args.params, [f"rollout.sampler={schedule.kind}", *overrides])
        key = tuple(overrides)
        if key not in tables:
            # tp_grpo's completion, and stepwise's own estimator where an override changes it
            estimators = dict.fromkeys(("ode_completion", *estimators_for("stepwise", rule_cfg)))
            tables[key] = score_round(
                backend, rollout, metadata, rewards, rule_cfg, estimators=tuple(estimators),
                schedule=schedule, counter=CountingVelocity(backend, cfg.sampling.guidance),
            ).table  # fmt: skip
        credit = assign_credit(method, tables[key], rollout.group_ids, schedule, rule_cfg)
        advantages[name] = credit.advantages
    last_state = torch.tensor([schedule.sigmas.numel() - 1])  # every table scores the final images
    final = reward_matrix(tables[()], "final", "mix", rollout.num_trajectories, last_state)[:, 0]
    values = monte_carlo_values(
        backend, rollout, schedule, metadata, rewards, final,
        continuations=args.continuations, batch=args.batch,
        seed=derived_seed(args.seed, round_index, "continuations"),
    )  # fmt: skip
    truth = values.mean(dim=2).diff(dim=1)  # (N, K) A*
    halves = [part.mean(dim=2).diff(dim=1) for part in values.split(args.continuations // 2, 2)]
    return final, truth, halves, advantages


def measure(sampler: str, args) -> dict:
    """`args.rounds` rounds on one SDE, their prompt groups pooled, every rule scored."""
    from pipeline import world
    from pipeline.config import load_config
    from pipeline.policy import Policy
    from pipeline.rewards import RewardMix
    from pipeline.rounds import Schedule

    cfg = load_config(args.params, [f"rollout.sampler={sampler}"])
    if not cfg.rollout.shared_noise:
        raise SystemExit("the group baseline this benchmark centres by needs rollout.shared_noise")
    start = time.perf_counter()
    backend = Policy.create(cfg).backend
    schedule = Schedule.from_config(cfg)
    prompts = world.read_prompts(args.prompts)
    rewards = RewardMix(cfg, cfg.score.rewards)
    rounds = [
        one_round(backend, schedule, cfg, prompts, rewards, r, args) for r in range(args.rounds)
    ]
    # every round's groups are groups of their own: the same prompt, another x_T
    group_ids = torch.arange(len(prompts) * args.rounds).repeat_interleave(cfg.rollout.group_size)
    final = torch.cat([r[0] for r in rounds])
    truth = torch.cat([r[1] for r in rounds])
    halves = tuple(torch.cat([r[2][h] for r in rounds]) for h in (0, 1))
    advantages = {name: torch.cat([r[3][name] for r in rounds]) for name in RULES}
    resamples = group_resamples(group_ids, args.draws, args.seed)
    result = fidelity(advantages, truth, halves, group_ids, resamples)
    for name, rule in result["rules"].items():
        print(f"{sampler} SDE, {name}: ρ " + " ".join(f"{r:+.2f}" for r in rule["rho"]))
    return {
        "sampler": sampler,
        "trained_steps": schedule.steps.tolist(),
        "trajectories": int(final.numel()),
        "rounds": args.rounds,
        "continuations": args.continuations,
        "reward_mean": float(final.mean()),
        "reward_std_in_groups": float(centred(final[:, None], group_ids).std(correction=0)),
        **result,
        "seconds": time.perf_counter() - start,
    }


def _cells(values: list[float], intervals: list[list[float]] | None = None) -> str:
    """A table cell: one line per step (with its CI when given), then the pooled value."""
    texts = [
        f"{v:+.2f}" + ("" if intervals is None else f" [{lo:+.2f}, {hi:+.2f}]")
        for v, (lo, hi) in zip(values, intervals or [(0, 0)] * len(values), strict=True)
    ]
    return "<br>".join(texts[:-1]) + f"<br>all steps: {texts[-1]}"


def markdown(results: list[dict], command: str) -> str:
    lines = [
        "# Credit fidelity: each rule's advantage against the policy's true per-step advantage",
        "",
        f"Command: `{command}`. Base policy, {results[0]['rounds']} rounds on each SDE (every "
        "prompt of each, its own x_T per round); A*_k = V(x_{k+1}) − V(x_k) from Monte Carlo "
        "continuations. Per trained step (noisiest first, then all steps "
        "pooled): ρ with a 95 % bootstrap CI over prompt groups, ρ corrected for the Monte Carlo "
        "noise of A*, ρ minus flow_grpo's rule's on the same rounds (paired CI), and the sign "
        "agreement; `benchmarks/credit_fidelity.py`'s docstring defines them.",
        "",
        "| SDE (trained steps) | rule | ρ [95 % CI] | ρ corrected | ρ − flow_grpo's [95 % CI] "
        "| sign agreement |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, rule in r["rules"].items():
            minus = (
                "reference"
                if "minus_reference" not in rule
                else _cells(rule["minus_reference"], rule["minus_reference_ci95"])
            )
            lines.append(
                f"| {r['sampler']} ({', '.join(map(str, r['trained_steps']))}) | {name} | "
                f"{_cells(rule['rho'], rule['rho_ci95'])} | {_cells(rule['rho_corrected'])} | "
                f"{minus} | " + " ".join(f"{a:.2f}" for a in rule["sign_agreement"]) + " |"
            )
    lines += [
        "",
        "| SDE | trajectories | continuations per state | reward mean | reward std in groups | "
        "std of A* per step | Monte Carlo reliability of A* per step | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['sampler']} | {r['trajectories']} | {r['continuations']} | "
            f"{r['reward_mean']:.3f} | {r['reward_std_in_groups']:.3f} | "
            + " ".join(f"{s:.3f}" for s in r["true_std"])
            + " | "
            + " ".join(f"{x:.2f}" for x in r["reliability"][:-1])
            + f" | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(REPO / "params.yaml"))
    parser.add_argument("--prompts", type=Path, default=POOL, help="GenEval lines (jsonl)")
    parser.add_argument("--continuations", type=int, default=16, help="per boundary state")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds (x_T draws) per SDE")
    parser.add_argument("--batch", type=int, default=512, help="continuation rows per call")
    parser.add_argument("--draws", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--samplers", nargs="*", default=list(SAMPLERS), choices=SAMPLERS)
    parser.add_argument("--out", type=Path, default=REPO / "reports")
    args = parser.parse_args()
    if args.continuations < 2 or args.continuations % 2:
        parser.error("--continuations must be an even number >= 2 (two halves)")
    from pipeline.io import write_json, write_text

    results = [measure(sampler, args) for sampler in args.samplers]
    command = "python benchmarks/credit_fidelity.py"
    write_json(args.out / "credit_fidelity.json", {"command": command, "results": results})
    write_text(args.out / "credit_fidelity.md", markdown(results, command))


if __name__ == "__main__":
    main()
