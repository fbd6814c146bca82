"""Session 43 scratch measurement (reports/search.md, session 43): the stepwise method is two
changes from flow_grpo, its credit rule and its DDIM-style SDE. Trained on the 24 pool lines in
all four combinations, this splits stepwise − flow_grpo into the two main effects and their
interaction, each with a 95 % bootstrap CI over seeds and prompts.

    python reports/search/oracle/pool24/factorial.py OUT.json --pool POOL.jsonl \
        --final-flow DIRS --final-ddim DIRS --step-flow DIRS --step-ddim DIRS

Each DIRS is one cell's evaluation folders (one per seed, `results.jsonl` inside): credit
final|step (flow_grpo's final reward | stepwise's gains), SDE flow|ddim (Flow-GRPO's | the
DDIM-style one). Effects are contrasts of the cells' GenEval overall:
  SDE effect     = mean(ddim cells) − mean(flow cells)
  credit effect  = mean(step cells) − mean(final cells)
  interaction    = (step_ddim − step_flow) − (final_ddim − final_flow)
The CIs are `pipeline.report.bootstrap_contrast`'s: each bootstrap replicate redraws every cell's
seeds on their own (independent training runs) and, within each tag, one draw of prompts shared
by all cells (the cells are judged on the same prompts).

On the trained prompts it also gives every effect on the first n seeds of each cell, for n from
3 to all (`by_seeds`): seeds were added a session at a time while the CIs were read, so this
shows how far the estimates moved as they came (session 45); and, on all seeds, each effect's CI
under bootstrap seeds 1-5 (`ci95_other_boot_seeds`), for the effects whose CI ends near 0.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
from compare import accuracy  # noqa: E402
from pool_gain import split_test  # noqa: E402

from pipeline import report as rep  # noqa: E402
from pipeline.io import write_json  # noqa: E402

CELLS = ("final_flow", "final_ddim", "step_flow", "step_ddim")
# Contrast weights over CELLS.
EFFECTS = {
    "sde_ddim_minus_flow": (-0.5, 0.5, -0.5, 0.5),
    "credit_step_minus_final": (-0.5, -0.5, 0.5, 0.5),
    "interaction": (1.0, -1.0, -1.0, 1.0),
    "stepwise_minus_flow_grpo": (-1.0, 0.0, 0.0, 1.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pool", type=Path, required=True)
    for cell in CELLS:
        parser.add_argument(f"--{cell.replace('_', '-')}", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    cfg, test, trained, tags = split_test(args.pool)
    runs = {cell: accuracy(cfg, getattr(args, cell), test) for cell in CELLS}
    out: dict = {
        "pool": str(args.pool),
        "cells": {c: [str(p) for p in getattr(args, c)] for c in CELLS},
    }
    for name, keep in (("trained prompts", trained), ("other test prompts", ~trained)):
        cells = [runs[c][:, keep] for c in CELLS]
        out[name] = {
            "prompts": int(keep.sum()),
            "per_seed": {
                c: rep.geneval_overall(runs[c][:, keep], tags[keep]).round(4).tolist()
                for c in CELLS
            },
            "effects": {e: rep.contrast(cells, w, tags[keep]) for e, w in EFFECTS.items()},
        }
        if name == "trained prompts":
            out[name]["by_seeds"] = {
                n: {
                    e: rep.contrast([c[:n] for c in cells], w, tags[keep])
                    for e, w in EFFECTS.items()
                }
                for n in range(3, min(len(c) for c in cells) + 1)
            }
            out[name]["ci95_other_boot_seeds"] = {
                e: [rep.bootstrap_contrast(cells, w, tags[keep], seed=s)[1] for s in range(1, 6)]
                for e, w in EFFECTS.items()
            }
        print(f"{name} ({keep.sum()}):")
        for effect, claim in out[name]["effects"].items():
            print(f"  {rep.claim_text(effect, claim)}")
        for n, effects in out[name].get("by_seeds", {}).items():
            row = ", ".join(f"{e} {c['diff']:+.3f} {c['ci95'][1]:+.3f}" for e, c in effects.items())
            print(f"  first {n} seeds (diff, upper CI end): {row}")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
