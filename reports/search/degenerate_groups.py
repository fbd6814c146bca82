"""Session 38 scratch measurement (reports/search.md, session 38): the share of a run's prompt
groups whose G final rewards are all equal (zero advantage, no signal), from its score table.

    python reports/search/degenerate_groups.py data/train/flow_grpo-s0 [RUN ...] [--group-size 8]

Reads the run's score table (`pipeline.trajectories.read_scores`, kept for every round), the
final mixed reward of each trajectory; trajectories of one group are consecutive, as the rollout
writes them.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.trajectories import read_scores  # noqa: E402


def degenerate_share(run: Path, group_size: int) -> tuple[float, float, int]:
    """(share of groups with one reward for all members, mean final reward, groups counted)."""
    scores = read_scores(run / "rollouts")
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
