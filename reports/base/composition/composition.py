"""What a base policy draws for two-class prompts, and whether it places them as stated.

Session 29 (reports/search.md): session 28 read the base's evaluation verdicts as "position fails
only because a named object is missing", which was wrong. This measures it directly. For a saved
ShapesWorld policy, it samples the test prompts with the training sampler as
`benchmarks/base_quality.py` does for its `ode` row (the same seeds, so the same images and the
same GenEval numbers), runs the detector, and reports:

- `geneval`: per-tag GenEval accuracy (equal to base_quality's `ode` row for the same model);
- `drawn`, per two-class tag (two_object, position, color_attr): the share of images holding
  both named classes; one named class two or more times and nothing else ("the same class
  twice": the binding failure); one named class and an object of another class; one named class
  alone; neither named class;
- `relation`: among position images holding both named classes, the share in which the stated
  relation holds (GenEval's rule on the top detection of each class) and the mean share of the
  three other relations on the same images: equal shares mean the layout ignores the relation;
- `color_binding`: among color_attr images holding both named classes, the share judged right.

    OMP_NUM_THREADS=1 python reports/base/composition/composition.py --model data/base/model \
        --label committed
    python reports/base/composition/composition.py --table

writes `<label>.json` beside this file.
"""

import argparse
import copy
import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.detector import detect_batch  # noqa: E402
from pipeline.evaluation import generate  # noqa: E402
from pipeline.geneval import RELATIONS, evaluate, summarize, verdicts  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.models import ShapesBackend  # noqa: E402
from pipeline.world import read_prompts  # noqa: E402

TWO_CLASS = ("two_object", "position", "color_attr")
DRAWN = ("both named", "same class twice", "named and another", "named alone", "neither named")


def drawn_category(meta: dict, detections: dict) -> str:
    """Which of DRAWN an image of a two-class line is, from its detections."""
    named = [clause["class"] for clause in meta["include"]]
    counts = {name: len(found) for name, found in detections.items() if found}
    present = [name for name in named if counts.get(name, 0)]
    if len(present) == 2:
        return "both named"
    if not present:
        return "neither named"
    others = sum(counts.values()) - counts[present[0]]
    if others:
        return "named and another"
    return "same class twice" if counts[present[0]] >= 2 else "named alone"


def with_relation(meta: dict, relation: str) -> dict:
    """A position line's metadata with its relation replaced."""
    changed = copy.deepcopy(meta)
    for clause in changed["include"]:
        if "position" in clause:
            clause["position"][0] = relation
    return changed


def measure(rows: list[dict], detections: list[dict], judged: list[dict]) -> dict:
    """The module docstring's `drawn`, `relation` and `color_binding`; `judged` holds the
    images' GenEval verdicts (`pipeline.geneval.verdicts` of the same rows and detections)."""
    drawn = {tag: Counter() for tag in TWO_CLASS}
    stated, others, colors = [], [], []
    for meta, found, verdict in zip(rows, detections, judged, strict=True):
        if meta["tag"] not in TWO_CLASS:
            continue
        category = drawn_category(meta, found)
        drawn[meta["tag"]][category] += 1
        if category != "both named":
            continue
        if meta["tag"] == "position":
            relation = next(c["position"][0] for c in meta["include"] if "position" in c)
            stated.append(verdict["correct"])
            others.append(
                np.mean(
                    [evaluate(with_relation(meta, r), found)[0] for r in RELATIONS if r != relation]
                )
            )
        elif meta["tag"] == "color_attr":
            colors.append(verdict["correct"])
    return {
        "drawn": {
            tag: {k: counts[k] / sum(counts.values()) for k in DRAWN}
            for tag, counts in drawn.items()
        },
        "relation": {
            "images": len(stated),
            "stated_holds": float(np.mean(stated)),
            "other_relations_hold": float(np.mean(others)),
        },
        "color_binding": {"images": len(colors), "judged_right": float(np.mean(colors))},
    }


def run(args) -> None:
    cfg = load_config(args.params)
    backend = ShapesBackend.from_pretrained(args.model).eval()
    metadata = read_prompts(cfg.path("data/prompts/test.jsonl"))
    rows = [m for m in metadata for _ in range(args.images_per_prompt)]
    seeds = [args.seed * 100_003 + i for i in range(len(rows))]  # base_quality.py's `ode` seeds
    images = generate(
        backend,
        [m["prompt"] for m in rows],
        seeds=seeds,
        num_steps=cfg.sampling.num_steps,
        shift=cfg.sampling.shift,
        guidance=cfg.sampling.guidance,
        batch_size=64,
    )
    detections = detect_batch(images)
    judged = verdicts(rows, detections)
    summary = summarize(judged)
    result = {
        "model": str(
            args.model.absolute().relative_to(REPO)
            if args.model.absolute().is_relative_to(REPO)
            else args.model
        ),
        "images_per_prompt": args.images_per_prompt,
        "seed": args.seed,
        "geneval": {"overall": summary["overall"], **summary["per_tag"]},
        **measure(rows, detections, judged),
    }
    write_json(HERE / f"{args.label}.json", result)
    print(json.dumps(result, indent=1))


def table() -> None:
    print(
        "| base | ODE-10 overall | two_object / position / color_attr | "
        + " | ".join(f"position: {k}" for k in DRAWN)
        + " | position, both drawn: stated / other relations"
        " | color_attr, both drawn: colours right |"
    )
    print("|" + "---|" * (5 + len(DRAWN)))
    for path in sorted(HERE.glob("*.json")):
        r = json.loads(path.read_text())
        g, d, rel = r["geneval"], r["drawn"]["position"], r["relation"]
        cells = [
            path.stem,
            f"{g['overall']:.3f}",
            f"{g['two_object']:.2f} / {g['position']:.2f} / {g['color_attr']:.2f}",
            *(f"{d[k]:.2f}" for k in DRAWN),
            f"{rel['stated_holds']:.2f} / {rel['other_relations_hold']:.2f} ({rel['images']})",
            f"{r['color_binding']['judged_right']:.2f} ({r['color_binding']['images']})",
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "data/base/model")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--label", default="committed")
    parser.add_argument("--images-per-prompt", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--table", action="store_true", help="print the stored rows and exit")
    args = parser.parse_args()
    table() if args.table else run(args)


if __name__ == "__main__":
    main()
