"""GenEval's rule-based judge (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for
Evaluating Text-to-Image Alignment", `evaluation/evaluate_images.py`), detector-agnostic.

A metadata line says what must be in the image (`include`, ANDed) and what must not
(`exclude`, ORed). Detections come per class, sorted by score, already thresholded by the
detector. The rules, in GenEval's words and order:

1. include clause `{class, count}`: the class needs at least `count` detections; only the top
   `count` by score ("found objects") are checked further.
2. `color`: at least `count` of the found objects have that color.
3. `position: [relation, i]`: every found object stands in `relation` to every found object of
   include clause `i`, which must itself have matched (rules 1-2, and its own position).
4. exclude clause `{class, count}`: failure if the class has `count` or more detections.

Relative position (GenEval's `relative_position`): with box centres c_a, c_b and box sizes
(w, h), offset o = c_a - c_b is shrunk per axis by 0.1 * (dim_a + dim_b),
o' = sign(o) * max(|o| - 0.1 (dim_a + dim_b), 0); if |o'| < 1e-3 on both axes there is no
relation, else (dx, dy) = o' / ||o|| and "left of" is dx < -0.5, "right of" dx > 0.5, "above"
dy < -0.5, "below" dy > 0.5 (image y grows downward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
POSITION_THRESHOLD = 0.1  # GenEval: centre offset shrunk by 0.1 x summed box sizes
DIRECTION_CUT = 0.5  # GenEval: a relation holds where the unit direction exceeds 0.5


@dataclass
class Detection:
    """One detected object.

    box: (x0, y0, x1, y1) in pixels, x to the right, y downward.
    score: detector confidence in [0, 1].
    color: color name, or None when the detector gives none.
    mask: optional (H, W) bool array of the object's pixels.
    """

    box: tuple[float, float, float, float]
    score: float
    color: str | None = None
    mask: np.ndarray | None = None


def relative_position(
    box_a: Sequence[float],
    box_b: Sequence[float],
    *,
    threshold: float = POSITION_THRESHOLD,
    cut: float = DIRECTION_CUT,
) -> set[str]:
    """Relations in which box A stands to box B, by GenEval's rule (module docstring).

    box_a, box_b: (x0, y0, x1, y1). `threshold` and `cut` are GenEval's 0.1 and 0.5; the
    renderer passes stricter values to leave a safety margin.
    """
    a = np.asarray(box_a[:4], dtype=np.float64).reshape(2, 2)  # rows: (x0, y0), (x1, y1)
    b = np.asarray(box_b[:4], dtype=np.float64).reshape(2, 2)
    offset = a.mean(axis=0) - b.mean(axis=0)  # (2,) centre offset (dx, dy)
    dims = np.abs(a[1] - a[0]) + np.abs(b[1] - b[0])  # (2,) summed box width, height
    revised = np.maximum(np.abs(offset) - threshold * dims, 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -cut:
        relations.add("left of")
    if dx > cut:
        relations.add("right of")
    if dy < -cut:
        relations.add("above")
    if dy > cut:
        relations.add("below")
    return relations


def evaluate(metadata: Mapping, detections: Mapping[str, Sequence[Detection]]) -> tuple[bool, str]:
    """Judge one image by GenEval's rules (module docstring).

    metadata: a GenEval metadata line (`include`, optional `exclude`).
    detections: class name -> detections sorted by score, highest first.
    Returns (correct, reason) where reason lists every failure, one per line ("" if correct),
    worded as GenEval words them.
    """
    correct = True
    reasons: list[str] = []
    matched_groups: list[Sequence[Detection] | None] = []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = list(detections.get(name, []))[:count]
        matched = True
        if len(found) < count:
            matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colors = [det.color for det in found]
                n_right = colors.count(req["color"])
                if n_right < count:
                    matched = False
                    others = ", ".join(
                        f"{colors.count(c)} {c}" for c in dict.fromkeys(colors) if c is not None
                    )
                    reasons.append(
                        f"expected {req['color']} {name}>={count}, found {n_right} "
                        f"{req['color']}; and {others}"
                    )
            if "position" in req and matched:
                relation, target = req["position"]
                if matched_groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    failure = _first_position_failure(found, matched_groups[target], relation)
                    if failure is not None:
                        matched = False
                        reasons.append(
                            f"expected {name} {relation} target, found "
                            f"{' and '.join(sorted(failure))} target"
                        )
        correct &= matched
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        n_found = len(detections.get(req["class"], []))
        if n_found >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {n_found}")
    return correct, "\n".join(reasons)


def verdicts(
    metadata: Sequence[Mapping], detections: Sequence[Mapping[str, Sequence[Detection]]]
) -> list[dict]:
    """`evaluate` over a batch: one {tag, prompt, correct, reason} per (line, detections) pair."""
    rows = []
    for meta, found in zip(metadata, detections, strict=True):
        correct, reason = evaluate(meta, found)
        rows.append(
            {"tag": meta["tag"], "prompt": meta["prompt"], "correct": correct, "reason": reason}
        )
    return rows


def _first_position_failure(
    objects: Sequence[Detection], targets: Sequence[Detection], relation: str
) -> set[str] | None:
    """The true relations of the first (object, target) pair lacking `relation`, else None."""
    for obj in objects:
        for target in targets:
            true_relations = relative_position(obj.box, target.box)
            if relation not in true_relations:
                return true_relations
    return None


def partial_score(metadata: Mapping, detections: Mapping[str, Sequence[Detection]]) -> float:
    """Dense reward in [0, 1]: the mean over the metadata's clause checks of each check's
    satisfied fraction. It is 1 exactly when `evaluate` says correct.

    Checks, per include clause with `count` = n and found = top-n detections of the class:
    - count: min(len(found), n) / n;
    - color (if any): (# found with the color) / n;
    - position (if any): fraction of (found object, target object) pairs in the relation,
      the targets being the found objects of the target clause (0 if there are none).
    Per exclude clause: 1 if the class has fewer than `count` detections, else 0.
    """
    checks: list[float] = []
    found_groups: list[list[Detection]] = []
    for req in metadata.get("include", []):
        count = req["count"]
        found = list(detections.get(req["class"], []))[:count]
        found_groups.append(found)
        checks.append(len(found) / count)
        if "color" in req:
            checks.append(sum(det.color == req["color"] for det in found) / count)
        if "position" in req:
            relation, target = req["position"]
            pairs = [(obj, tgt) for obj in found for tgt in found_groups[target]]
            n_pairs = count * max(metadata["include"][target]["count"], 1)
            n_right = sum(relation in relative_position(o.box, t.box) for o, t in pairs)
            checks.append(n_right / n_pairs)
    for req in metadata.get("exclude", []):
        checks.append(float(len(detections.get(req["class"], [])) < req["count"]))
    return float(np.mean(checks)) if checks else 1.0


def summarize(results: Sequence[Mapping]) -> dict:
    """GenEval summary: accuracy per tag and overall = unweighted mean over the tags present.

    results: rows with keys `tag` and `correct` (bool), one per judged image.
    Returns {"per_tag": {tag: accuracy}, "n_per_tag": {tag: n}, "overall": float}; tags in
    GenEval's order. Raises ValueError on an empty list or an unknown tag.
    """
    if not results:
        raise ValueError("summarize: no results")
    per_tag: dict[str, list[bool]] = {}
    for row in results:
        if row["tag"] not in TAGS:
            raise ValueError(f"summarize: unknown tag {row['tag']!r}; expected one of {TAGS}")
        per_tag.setdefault(row["tag"], []).append(bool(row["correct"]))
    accuracy = {tag: float(np.mean(per_tag[tag])) for tag in TAGS if tag in per_tag}
    return {
        "per_tag": accuracy,
        "n_per_tag": {tag: len(per_tag[tag]) for tag in accuracy},
        "overall": float(np.mean(list(accuracy.values()))),
    }
