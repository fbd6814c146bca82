"""The control experiment of the decisive-experiment issue: with a reward whose gradient signal
is strong (`brightness`, mean image intensity), do the credit rules differ, per round and at
equal NFE? Reads the committed runs, trains nothing.

Runs (one per method and seed; `reports/search/<method>-s<seed>/rounds.json`), made with

    creditflow train --method M --seed S -S "score.rewards={brightness: 1}" -S train.rounds=15 \\
        -S train.eval_every=0 -S update.lr=3e-3 -S update.clip_range=0.05 -S update.kl_beta=0

on the code of the time. Session 7's runs (`reports/search/`) used the estimators of then (stepwise
T' = 5 substeps, tp_grpo exact completions); session 8's (`reports/search/coarse3/`, same command)
the cheaper defaults since (3-step completions, the rollout's velocity reused), with flow_grpo's
runs copied from session 7 (a flow_grpo round uses no estimator; every method's round 0
reward equals session 7's, the same rollout).

For a seed, the three methods draw the same prompts and initial noise in a given round, so
per-round differences are paired. The reward of round r is measured on the policy trained for r
rounds (its rollout comes before its update), i.e. after r × (the method's NFE per round).

- per round: mean over rounds 5-14 of (method − flow_grpo), with a 95 % bootstrap CI over seeds
  and rounds (`pipeline.report.bootstrap_difference`, rounds in place of prompts);
- joint vs per-step normalization (stepwise; runs `stepwise-s<seed>-per_step/`, the same command
  with `-S advantages.normalization=per_step`, read when every seed has one): the same per-round
  difference, joint − per-step; both spend the same NFEs a round, so it is also equal compute;
- equal NFE: each method's reward after the largest number of rounds that fits in flow_grpo's
  budget of 14 rounds, same bootstrap over seeds (one value per seed).

    python benchmarks/brightness_control.py

writes reports/brightness_control.json and reports/brightness_control.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pipeline.io import write_json, write_text
from pipeline.report import bootstrap_difference

METHODS = ("flow_grpo", "stepwise", "tp_grpo")
PER_STEP = "stepwise_per_step"  # stepwise with -S advantages.normalization=per_step
DEFAULT_RUNS = Path("reports/search")
DEFAULT_SEEDS = [12, 13, 14, 15]
LATE = slice(5, 15)  # rounds 5-14: after the first updates have had an effect


def run_dir(root: Path, method: str, seed: int) -> Path:
    """`<method>-s<seed>`, or `stepwise-s<seed>-per_step` for the per-step normalization."""
    if method == PER_STEP:
        return root / f"stepwise-s{seed}-per_step"
    return root / f"{method}-s{seed}"


def load_runs(root: Path, seeds: list[int]) -> dict[str, np.ndarray]:
    """({method: (S, R) training reward per seed and round}, {method: mean NFE per round}); the
    per-step variant only when every seed has it."""
    rewards, nfe = {}, {}
    for method in (*METHODS, PER_STEP):
        files = [run_dir(root, method, s) / "rounds.json" for s in seeds]
        if method == PER_STEP and not all(f.is_file() for f in files):
            continue
        rows = [json.loads(f.read_text()) for f in files]
        rewards[method] = np.array([[r["reward/mean"] for r in seed_rows] for seed_rows in rows])
        nfe[method] = float(np.mean([r["cost/round_nfe"] for seed_rows in rows for r in seed_rows]))
    return rewards, nfe


def claim(a: np.ndarray, b: np.ndarray) -> dict:
    diff, (low, high) = bootstrap_difference(a, b, np.zeros(a.shape[1], int))
    return {"diff": diff, "ci95": [low, high], "separated": bool(low > 0 or high < 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=DEFAULT_RUNS)
    parser.add_argument("--seeds", type=int, nargs="+", default=DEFAULT_SEEDS)
    parser.add_argument("--out", type=Path, default=Path("reports/brightness_control"))
    args = parser.parse_args()
    rewards, nfe = load_runs(args.runs, args.seeds)
    budget = (rewards["flow_grpo"].shape[1] - 1) * nfe["flow_grpo"]
    rounds_at_budget = {m: min(int(budget // nfe[m]), rewards[m].shape[1] - 1) for m in rewards}
    at_budget = {m: rewards[m][:, [rounds_at_budget[m]]] for m in rewards}
    command = "python benchmarks/brightness_control.py" + (
        "" if args.runs == DEFAULT_RUNS else f" --runs {args.runs} --out {args.out}"
    )
    if args.seeds != DEFAULT_SEEDS:
        command += " --seeds " + " ".join(map(str, args.seeds))
    result = {
        "command": command,
        "runs": str(args.runs),
        "seeds": args.seeds,
        "nfe_per_round": nfe,
        "first3_last5": {
            m: [float(rewards[m][:, :3].mean()), float(rewards[m][:, -5:].mean())] for m in rewards
        },
        "per_round": {
            f"{m}_vs_flow_grpo": claim(rewards[m][:, LATE], rewards["flow_grpo"][:, LATE])
            for m in rewards
            if m != "flow_grpo"
        },
        "equal_nfe": {
            "nfe": budget,
            "rounds": rounds_at_budget,
            "reward": {m: at_budget[m][:, 0].tolist() for m in rewards},
            **{
                f"{m}_vs_flow_grpo": claim(at_budget[m], at_budget["flow_grpo"])
                for m in rewards
                if m != "flow_grpo"
            },
        },
    }
    if PER_STEP in rewards:  # same NFE per round: per round is also equal compute
        late = (rewards["stepwise"][:, LATE], rewards[PER_STEP][:, LATE])
        result["per_round"]["joint_vs_per_step"] = claim(*late)
    write_json(args.out.with_suffix(".json"), result)
    write_text(args.out.with_suffix(".md"), markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    def row(name: str, c: dict) -> str:
        verdict = "separated" if c["separated"] else "not separated"
        low, high = c["ci95"]
        return f"| {name} | {c['diff']:+.3f} | [{low:+.3f}, {high:+.3f}] | {verdict} |"

    eq = result["equal_nfe"]
    lines = [
        "# Control reward `brightness`: credit rules per round and at equal NFE",
        "",
        f"Seeds {', '.join(map(str, result['seeds']))}; lr 3e-3, clip 0.05, β 0, 15 rounds × 48"
        f" trajectories (`{result['command']}`, runs in `{result['runs']}/`; their command is in"
        " the script's docstring). Training reward = mean brightness of the round's 48 images.",
        "",
        "| method | NFE / round | reward, first 3 rounds → last 5 (mean over seeds) |",
        "|---|---|---|",
        *(
            f"| {m} | {result['nfe_per_round'][m]:.0f} | {a:.3f} → {b:.3f} |"
            for m, (a, b) in result["first3_last5"].items()
        ),
        "",
        "| claim | difference | 95 % CI (bootstrap) | |",
        "|---|---|---|---|",
        *(row(f"per round (5–14): {k}", c) for k, c in result["per_round"].items()),
        *(
            row(f"equal NFE ({eq['nfe']:.0f}): {k}", eq[k])
            for k in eq
            if k.endswith("_vs_flow_grpo")
        ),
        "",
        "At equal NFE each method is read after "
        + ", ".join(f"{m} {r} rounds" for m, r in eq["rounds"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
