"""Session 35 scratch measurement (reports/search.md, session 35 §5): how much a policy trained
on a small pool of test prompts gains on those prompts, and on the test prompts it never drew,
from the evaluation protocol's verdicts (its x_T differ from every training round's).

    python reports/search/oracle/pool_gain.py OUT.json --pool POOL.jsonl --base data/eval/base \
        --policy DIR/eval/flow_grpo-s0 [...]

POOL.jsonl holds the trained lines (a subset of the test split). For the pool and for the rest
of the test split: GenEval overall (the mean of the tags' means) of the base and of the
policies, and the gain with the report's 95 % bootstrap CI over seeds and prompts
(`pipeline.report.difference`). With `--reference DIR/eval/<run> [...]` (session 42: the credit
rules on the pool), also the policies minus those reference policies on each part.
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent))
import numpy as np  # noqa: E402
from compare import accuracy  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline import report as rep  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.geneval import TAGS  # noqa: E402
from pipeline.io import write_json  # noqa: E402


def split_test(pool_path: Path) -> tuple:
    """The committed config, the test split, and per test prompt whether POOL.jsonl holds it
    (P,) and its tag id (P,)."""
    cfg = load_config(REPO / "params.yaml")
    test = layout.load_prompts(cfg, "test")
    pool = {(m["tag"], m["prompt"]) for m in map(json.loads, pool_path.read_text().splitlines())}
    trained = np.array([(m["tag"], m["prompt"]) in pool for m in test])
    tags = np.array([TAGS.index(m["tag"]) for m in test])
    return cfg, test, trained, tags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pool", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--policy", type=Path, nargs="+", required=True)
    parser.add_argument("--reference", type=Path, nargs="+", default=[])
    args = parser.parse_args()
    cfg, test, trained, tags = split_test(args.pool)
    base = accuracy(cfg, [args.base], test)
    policy = accuracy(cfg, args.policy, test)
    reference = accuracy(cfg, args.reference, test) if args.reference else None
    out: dict = {
        "pool": str(args.pool),
        "policies": [str(p) for p in args.policy],
        "references": [str(p) for p in args.reference],
    }

    def per_seed(runs: np.ndarray, keep: np.ndarray) -> list[float]:
        return rep.geneval_overall(runs[:, keep], tags[keep]).round(4).tolist()

    for name, keep in (("trained prompts", trained), ("other test prompts", ~trained)):
        gain = rep.difference(policy[:, keep], base[:, keep], tags[keep])
        out[name] = {
            "prompts": int(keep.sum()),
            "base": float(rep.geneval_overall(base[0, keep], tags[keep])),
            "policy_per_seed": per_seed(policy, keep),
            "gain": gain,
            "gain_per_tag": rep.tag_gains(policy[:, keep], base[:, keep], tags[keep]),
        }
        print(
            f"{name} ({keep.sum()}): base {out[name]['base']:.3f}, policy "
            f"{out[name]['policy_per_seed']}, {rep.claim_text('gain', gain)}"
        )
        if reference is not None:
            versus = rep.difference(policy[:, keep], reference[:, keep], tags[keep])
            out[name] |= {
                "reference_per_seed": per_seed(reference, keep),
                "minus_reference": versus,
                "minus_reference_per_tag": rep.tag_gains(
                    policy[:, keep], reference[:, keep], tags[keep]
                ),
            }
            print(f"  {rep.claim_text('minus the reference', versus)}")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
