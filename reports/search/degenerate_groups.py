"""Session 38 scratch measurement (reports/search.md, session 38): the share of a run's prompt
groups whose G final rewards are all equal (zero advantage, no signal), from its score table.

    python reports/search/degenerate_groups.py data/train/flow_grpo-s0 [RUN ...] [--group-size 8]

Reads `<run>/rollouts/scores/round=*/part-*.parquet` (kept for every round), the final mixed
reward of each trajectory; trajectories of one group are consecutive, as the rollout writes them.
"""

import argparse
from pathlib import Path

import pandas as pd


def degenerate_share(run: Path, group_size: int) -> tuple[float, float, int]:
    """(share of groups with one reward for all members, mean final reward, groups counted)."""
    parts = []
    for path in sorted(run.glob("rollouts/scores/round=*/part-*.parquet")):
        table = pd.read_parquet(path)
        table["round"] = int(path.parent.name.split("=")[1])
        parts.append(table)
    if not parts:
        raise SystemExit(f"error: no score tables under {run / 'rollouts/scores'}")
    scores = pd.concat(parts)
    final = scores[(scores.estimator == "final") & (scores.reward == "mix")].copy()
    final["group"] = final.trajectory // group_size
    spread = final.groupby(["round", "group"]).value.agg(lambda v: v.max() - v.min())
    return float((spread == 0).mean()), float(final.value.mean()), len(spread)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="data/train/<run>")
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    for run in args.runs:
        share, reward, groups = degenerate_share(run, args.group_size)
        print(f"{run}: {share:.3f} of {groups} groups degenerate, mean final reward {reward:.3f}")


if __name__ == "__main__":
    main()
