"""Session 38 scratch measurement (reports/search.md, session 38): the share of a run's prompt
groups whose G final rewards are all equal (zero advantage, no signal), from its score table.

    python reports/search/degenerate_groups.py data/train/flow_grpo-s0 [RUN ...]

Reads the run's score table (`pipeline.trajectories.read_scores`, kept for every round), the
final mixed reward of each trajectory, and each trajectory's `group_id` from the finals table.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.trajectories import FINALS, open_dataset, read_scores  # noqa: E402


def degenerate_share(run: Path) -> tuple[float, float, int]:
    """(share of groups with one reward for all members, mean final reward, groups counted)."""
    scores = read_scores(run / "rollouts")
    final = scores[(scores.estimator == "final") & (scores.reward == "mix")]
    groups = open_dataset(run / "rollouts", FINALS).to_table(
        columns=["round", "trajectory", "group_id"]
    )
    final = final.merge(groups.to_pandas(), on=["round", "trajectory"], validate="one_to_one")
    spread = final.groupby(["round", "group_id"]).value.agg(lambda v: v.max() - v.min())
    return float((spread == 0).mean()), float(final.value.mean()), len(spread)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="data/train/<run>")
    args = parser.parse_args()
    for run in args.runs:
        share, reward, groups = degenerate_share(run)
        print(f"{run}: {share:.3f} of {groups} groups degenerate, mean final reward {reward:.3f}")


if __name__ == "__main__":
    main()
