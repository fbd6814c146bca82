"""A null control for GRPO on ShapesWorld: the same run with each round's rewards shuffled
within their prompt groups before credit assignment.

Every group keeps its own set of rewards (so the advantages have the default run's sizes, and
the same groups are degenerate), but which trajectory gets which reward is a seeded random
permutation: the update carries no information about which images the judge preferred. What a
placebo run gains over the base is what GRPO's update gains without the reward's signal (drift,
sharpening by the surrogate itself); what the default run gains beyond it is learning.

    python reports/search/placebo/placebo.py train --method flow_grpo --seed S [-S k=v ...]
    creditflow evaluate --policy flow_grpo-sS

Run it in a copy of the project: the run is written where a plain `creditflow train` writes
it. The permutation is seeded by (train seed, round), so a run reproduces. The training reward
logged per round is the judge's, unshuffled.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
from torch import Tensor

from pipeline import rounds
from stages import cli

_assign_credit = rounds.assign_credit


def shuffled_within_groups(table: pd.DataFrame, group_ids: Tensor, seed: int) -> pd.DataFrame:
    """The score table with each trajectory's rows relabelled to a random member of its group.

    table: score rows with a `trajectory` column; group_ids: (N,) group of each trajectory.
    A permutation within every group, so each group's multiset of rewards is unchanged.
    """
    rng = np.random.default_rng(seed)
    groups = group_ids.numpy()
    target = np.arange(groups.size)
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        target[members] = rng.permutation(members)
    shuffled = table.copy()
    shuffled["trajectory"] = target[table["trajectory"].to_numpy()]
    return shuffled


def placebo_credit(method, table, group_ids, schedule, cfg, **kwargs):
    round_index = int(table["round"].iloc[0])
    table = shuffled_within_groups(table, group_ids, seed=cfg.train.seed * 100_003 + round_index)
    return _assign_credit(method, table, group_ids, schedule, cfg, **kwargs)


if __name__ == "__main__":
    rounds.assign_credit = placebo_credit
    sys.argv[0] = "creditflow"
    cli.main()
