"""Session 34 scratch measurement (reports/search.md, session 34 §2): what a policy drew where
the protocol found no star. A missing star is half of every default policy's held-out misses
(`reports/README.md`, "Where the misses go"); the detector reads renders blurred by up to
sigma 0.9 px as stars (1.00), so the question is what the generated image holds instead.

    python reports/search/stars/what_stars_become.py OUT.json [--policy data/train/RUN]

Runs the evaluation protocol (`geneval_protocol`: the images and verdicts of `creditflow
evaluate`, equal to `data/eval/<policy>/results.jsonl`) and, for each image whose first failure
is a missing star, sorts the objects the detector found: the stars it counted and one object per
asked non-star class (the best-scoring) are set aside, and what is left is
- `read as <class>`: a shape the detector names, but not a star (with its IoU and the star
  template's IoU on the same object),
- `<class> twice`: another copy of an asked class,
- `shapeless`: an object that matches no shape (IoU < the detector's 0.5),
- `nothing`: no object left (the star was not drawn, or merged into another object).
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.detector import detect  # noqa: E402
from pipeline.evaluation import geneval_protocol  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.policy import load_backend, restore  # noqa: E402
from pipeline.report import failure_cause  # noqa: E402


def objects(image: torch.Tensor) -> list[dict]:
    """Every object the detector segments (no score floor): class, IoU, the star's IoU."""
    found = detect(image, min_score=0.0)
    as_star = {d.box: d.score for d in detect(image, shapes=("star",), min_score=0.0)["star"]}
    return [
        {"class": name, "iou": d.score, "star_iou": as_star.get(d.box, 0.0)}
        for name, dets in found.items()
        for d in dets
    ]


def what_is_left(meta: dict, found: list[dict]) -> dict:
    """The objects left once each asked non-star class has its best-scoring object, sorted into
    the module docstring's kinds (the first left object decides)."""
    asked = [c["class"] for c in meta["include"] if c["class"] != "star"]
    # the stars the detector did count (too few of them, on counting lines) are not the story
    left = sorted((o for o in found if o["class"] != "star"), key=lambda o: -o["iou"])
    for name in asked:
        match = next((o for o in left if o["class"] == name and o["iou"] >= 0.5), None)
        if match is not None:
            left.remove(match)
    if not left:
        return {"kind": "nothing"}
    first = left[0]
    if first["iou"] < 0.5:
        kind = "shapeless"
    elif first["class"] in asked:
        kind = f"{first['class']} twice"
    else:
        kind = f"read as {first['class']}"
    return {"kind": kind, "iou": first["iou"], "star_iou": first["star_iou"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--policy", type=Path, help="a training run's folder (default: the base)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "params.yaml")
    backend = restore(cfg, args.policy).backend if args.policy else load_backend(cfg)
    test = layout.load_prompts(cfg, "test")
    with torch.no_grad():
        images, verdicts, _ = geneval_protocol(backend, test, cfg)
    metas = [meta for meta in test for _ in range(cfg.evaluate.images_per_prompt)]
    kinds: Counter = Counter()
    per_tag: dict[str, Counter] = {}
    margins = []
    for meta, image, verdict in zip(metas, images, verdicts, strict=True):
        if verdict["correct"] or failure_cause(verdict["reason"]) != "missing star":
            continue
        left = what_is_left(meta, objects(image))
        kinds[left["kind"]] += 1
        per_tag.setdefault(meta["tag"], Counter())[left["kind"]] += 1
        if left["kind"].startswith("read as"):
            margins.append(left["iou"] - left["star_iou"])
    out = {
        "policy": str(args.policy or "base"),
        "images": sum(any(c["class"] == "star" for c in m["include"]) for m in metas),
        "missing_star": sum(kinds.values()),
        "kinds": dict(kinds.most_common()),
        "per_tag": {tag: dict(c.most_common()) for tag, c in per_tag.items()},
        "read_as_iou_minus_star_iou": {
            "median": float(np.median(margins)) if margins else None,
            "under_0.05": int(np.sum(np.asarray(margins) < 0.05)),
            "n": len(margins),
        },
    }
    write_json(args.out, out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
