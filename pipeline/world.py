"""ShapesWorld: a CPU-sized text-to-image world with GenEval's six tags.

Prompts are GenEval metadata lines (Ghosh et al. 2023, `prompts/create_prompts.py` templates)
over six flat shapes and GenEval's ten color names, each scene in four wordings (TEMPLATES) and,
with two objects, both orders; `make_prompts` holds out whole scenes for the test split and
mixes the training tags by weight. `render` draws a scene that satisfies a
line: shapes of random size, tilt and position on a mid-grey background, never
overlapping, inside the canvas, and with position relations holding by GenEval's rule with a
safety margin. Anti-aliasing: coverage = clip(0.5 - signed distance, 0, 1) per pixel centre.

Coordinates: x to the right, y downward, pixel (row i, col j) covers [j, j+1) x [i, i+1), its
centre at (j + 0.5, i + 0.5).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeline.geneval import RELATIONS, TAGS, relative_position

__all__ = [
    "BACKGROUND",
    "COLORS",
    "CORRUPTIONS",
    "RELATIONS",
    "SHAPES",
    "SHAPE_NAMES",
    "TAGS",
    "canonical_key",
    "corrupt",
    "degrade",
    "TEMPLATES",
    "make_prompts",
    "plural",
    "prompt_for",
    "prompt_pool",
    "random_variant",
    "read_prompts",
    "render",
    "render_batch",
    "sample_metadata",
    "shape_coverage",
    "split_counts",
    "template_of",
    "validate_metadata",
    "variants",
    "whole_world",
    "world_prompts",
    "write_prompts",
]

# Palette: GenEval's ten color names, as far apart from each other (min pairwise RGB distance
# about 0.4) and from the background (>= 0.45) as ten colors allow.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "orange": (1.00, 0.55, 0.00),
    "yellow": (1.00, 0.95, 0.10),
    "green": (0.10, 0.70, 0.15),
    "blue": (0.10, 0.25, 0.95),
    "purple": (0.55, 0.10, 0.80),
    "pink": (1.00, 0.60, 0.80),
    "brown": (0.50, 0.27, 0.05),
    "black": (0.02, 0.02, 0.02),
    "white": (0.98, 0.98, 0.98),
}
BACKGROUND = (0.5, 0.5, 0.5)  # neutral mid grey, none of the ten colors
SHAPES = ("circle", "square", "triangle", "cross", "star", "diamond")  # the default world
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MAX_OBJECTS = 5  # enough for counting's "one too many" corruption of a four-object scene
# Prompt templates: GenEval's "a photo of" first. Every scene is asked for in each wording, so a
# six-class world still has two dozen distinct single-object prompts to hold out.
TEMPLATES = ("a photo of", "a picture of", "an image of", "a drawing of")


def _regular_polygon(sides: int, radius: float, first_vertex: float) -> np.ndarray:
    """(sides, 2) vertices (x, y) on a circle of `radius`, the first at angle `first_vertex`."""
    phis = first_vertex + 2 * math.pi * np.arange(sides) / sides
    return radius * np.stack([np.cos(phis), np.sin(phis)], axis=1)


def _star_pieces(points: int, outer: float, inner: float) -> list[np.ndarray]:
    """A star pointing up as convex pieces: the inner polygon and one triangle per point."""
    up = -math.pi / 2  # y grows downward
    tips = _regular_polygon(points, outer, up)
    notches = _regular_polygon(points, inner, up + math.pi / points)
    return [notches] + [np.stack([tips[k], notches[k], notches[k - 1]]) for k in range(points)]


_CROSS_ARM = 0.32  # cross arm half-width / half-length
_CROSS_RADIUS = 0.62
# Each shape at nominal size 1: None for the circle (radius 0.5), else a union of convex
# polygons (local (x, y) vertices, y down, centred on the origin). Sizes make the areas alike
# (0.64-0.83 s^2, see `shape_area`); the silhouettes stay apart under any rotation, blur and
# the detector's soft-IoU matching (soft IoU between two classes' best alignment <= 0.86, the
# circle-square pair; the others <= 0.80; tested), which is why there is no hexagon or pentagon
# (too close to the circle at 8 px).
_PIECES: dict[str, list[np.ndarray] | None] = {
    "circle": None,
    "square": [_regular_polygon(4, 0.9 / math.sqrt(2), math.pi / 4)],
    "triangle": [_regular_polygon(3, 0.7, -math.pi / 2)],
    "cross": [  # a plus sign: two bars 2R x 2wR
        np.array([[x, y] for x, y in ((1, 1), (1, -1), (-1, -1), (-1, 1))])
        * _CROSS_RADIUS
        * np.array(scale)
        for scale in ((1.0, _CROSS_ARM), (_CROSS_ARM, 1.0))
    ],
    "star": _star_pieces(5, 0.72, 0.36),
    "diamond": [np.array([[0.0, -0.72], [0.45, 0.0], [0.0, 0.72], [-0.45, 0.0]])],
}
_CIRCLE_RADIUS = 0.5
# Rotational symmetry period (radians) of each shape; 0 for the circle, which looks the same at
# every rotation. The detector matches templates over a whole period.
SYMMETRY = {
    "circle": 0.0,
    "square": math.pi / 2,
    "triangle": 2 * math.pi / 3,
    "cross": math.pi / 2,
    "star": 2 * math.pi / 5,
    "diamond": math.pi,
}
# Renders tilt each shape by a uniform angle within +-ROTATION_JITTER of its upright pose (capped
# at half its symmetry period). Upright-ish shapes are what a 2-3M-parameter denoiser can learn to
# draw sharply in 30 CPU-minutes; measured in reports/base/choice.md.
ROTATION_JITTER = math.radians(15)
SHAPE_NAMES = tuple(_PIECES)  # every shape the world can draw


def _half_planes(polygon: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Outward unit normals (V, 2) and offsets (V,) of a convex polygon's edges: a point p is
    inside iff normals @ p <= offsets for every edge."""
    edges = np.roll(polygon, -1, axis=0) - polygon
    normals = np.stack([edges[:, 1], -edges[:, 0]], axis=1)
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    offsets = (normals * polygon).sum(axis=1)
    inward = normals @ polygon.mean(axis=0) > offsets  # the centroid must be inside
    normals[inward], offsets[inward] = -normals[inward], -offsets[inward]
    return normals, offsets


_HALF_PLANES = {
    name: [_half_planes(p) for p in pieces] for name, pieces in _PIECES.items() if pieces
}


def shape_coverage(
    shape: str, dx: np.ndarray, dy: np.ndarray, size: float, angle: np.ndarray | float
) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of a shape centred at the origin.

    dx, dy: pixel-centre offsets from the shape centre, broadcastable (e.g. (h, w)).
    angle: rotation in radians, scalar or broadcastable (e.g. (R, 1, 1) for R rotations).
    Returns clip(0.5 - d, 0, 1) with d the signed distance: for a union of convex pieces, the
    min over pieces of the max over edges of the half-plane distance (exact inside a piece, a
    lower bound near corners outside), shaped like the broadcast of the inputs.
    """
    angle = np.asarray(angle, dtype=np.float64)
    if _PIECES[shape] is None:
        dist = np.sqrt(dx**2 + dy**2) - _CIRCLE_RADIUS * size + 0 * angle
        return np.clip(0.5 - dist, 0.0, 1.0)
    # rotate the offsets into the shape's own frame
    u = dx * np.cos(angle) + dy * np.sin(angle)
    v = -dx * np.sin(angle) + dy * np.cos(angle)
    dist = None
    for normals, offsets in _HALF_PLANES[shape]:
        piece = None
        for (nx, ny), offset in zip(normals, offsets, strict=True):
            edge = nx * u + ny * v - offset * size
            piece = edge if piece is None else np.maximum(piece, edge)
        dist = piece if dist is None else np.minimum(dist, piece)
    return np.clip(0.5 - dist, 0.0, 1.0)


@functools.cache
def _unit_area(shape: str) -> float:
    """Area at nominal size 1, from the anti-aliased coverage of a 400 px rendering (within
    0.5 % of the exact area: the star's notches are the largest error)."""
    size = 400.0
    grid = np.arange(-size, size) + 0.5
    return float(shape_coverage(shape, grid[None, :], grid[:, None], size, 0.0).sum()) / size**2


def shape_area(shape: str, size: float) -> float:
    """Area (px^2) of `shape` at nominal size `size`."""
    return _unit_area(shape) * size**2


def _outline(shape: str) -> np.ndarray:
    """(V, 2) vertices of every piece at nominal size 1 (a circle: its bounding box corners)."""
    pieces = _PIECES[shape]
    if pieces is None:
        r = _CIRCLE_RADIUS
        return np.array([[-r, -r], [r, r]])
    return np.concatenate(pieces)


def shape_reach(shape: str, size: float) -> float:
    """Circumradius (px): the farthest point of the shape from its centre."""
    if _PIECES[shape] is None:
        return _CIRCLE_RADIUS * size
    return float(np.linalg.norm(_outline(shape), axis=1).max()) * size


def shape_vertices(shape: str, cx: float, cy: float, size: float, angle: float) -> np.ndarray:
    """(V, 2) outline points (x, y) whose bounding box is the shape's exact bounding box."""
    local = _outline(shape) * size
    if _PIECES[shape] is None:
        return local + np.array([cx, cy])
    rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    return local @ rot.T + np.array([cx, cy])


# ----------------------------------------------------------------------------- prompts


def _article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def template_of(meta: Mapping) -> int:
    """Index in TEMPLATES of the wording a line's prompt starts with (0 when none matches)."""
    prompt = meta.get("prompt", "")
    return next((i for i, t in enumerate(TEMPLATES) if prompt.startswith(t + " ")), 0)


def plural(noun: str) -> str:
    """English plural of a shape name: "crosses", "circles"."""
    return noun + ("es" if noun.endswith(("s", "x", "sh", "ch")) else "s")


def prompt_for(meta: Mapping, template: int = 0) -> str:
    """GenEval's prompt for a metadata line, in wording `template` (TEMPLATES; 0 = GenEval's)."""
    tag, inc = meta["tag"], meta["include"]
    lead = TEMPLATES[template]
    if tag == "single_object":
        return f"{lead} {_article(inc[0]['class'])}"
    if tag == "two_object":
        return f"{lead} {_article(inc[0]['class'])} and {_article(inc[1]['class'])}"
    if tag == "counting":
        return f"{lead} {NUMBER_WORDS[inc[0]['count']]} {plural(inc[0]['class'])}"
    if tag == "colors":
        return f"{lead} {_article(inc[0]['color'])} {inc[0]['class']}"
    if tag == "position":  # include[1] stands in relation to include[0]
        relation = inc[1]["position"][0]
        return f"{lead} {_article(inc[1]['class'])} {relation} {_article(inc[0]['class'])}"
    first, second = (f"{_article(c['color'])} {c['class']}" for c in inc)
    return f"{lead} {first} and {second}"


def _line(
    tag: str, include: list[dict], exclude: list[dict] | None = None, template: int = 0
) -> dict:
    meta = {"tag": tag, "include": include, "exclude": exclude or []}
    return {
        "tag": tag,
        "prompt": prompt_for(meta, template),
        "include": include,
        "exclude": meta["exclude"],
    }


def prompt_pool(
    tag: str,
    *,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = tuple(COLORS),
    max_count: int = 4,
) -> list[dict]:
    """Every distinct scene of a tag, one line per canonical key (see `canonical_key`), worded
    with GenEval's template; `variants` gives its other wordings and object orders.

    Sizes with 6 shapes, 10 colors, max_count 4: single_object 6, two_object 15, counting 18
    (GenEval counts 2..max_count), colors 60, position 60, color_attr 1350.
    """
    pairs = [(a, b) for i, a in enumerate(shapes) for b in shapes[i + 1 :]]
    if tag == "single_object":
        return [_line(tag, [{"class": s, "count": 1}]) for s in shapes]
    if tag == "two_object":
        return [_line(tag, [{"class": a, "count": 1}, {"class": b, "count": 1}]) for a, b in pairs]
    if tag == "counting":
        return [
            _line(tag, [{"class": s, "count": n}], [{"class": s, "count": n + 1}])
            for s in shapes
            for n in range(2, max_count + 1)
        ]
    if tag == "colors":
        return [_line(tag, [{"class": s, "count": 1, "color": c}]) for s in shapes for c in colors]
    if tag == "position":
        return [
            _line(tag, [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [r, 0]}])
            for a, b in pairs
            for r in RELATIONS
        ]
    if tag == "color_attr":
        return [
            _line(
                tag,
                [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
            )
            for a, b in pairs
            for ca in colors
            for cb in colors
            if ca != cb
        ]
    raise ValueError(f"unknown tag {tag!r}; expected one of {TAGS}")


def swap_order(meta: Mapping, template: int | None = None) -> dict:
    """The same scene described with its two objects in the other order ("a circle left of a
    square" <-> "a square right of a circle"), in the line's wording unless `template` is
    given; lines with one clause keep their order."""
    template = template_of(meta) if template is None else template
    inc = [dict(c) for c in meta["include"]]
    exclude = [dict(c) for c in meta.get("exclude", [])]
    if len(inc) != 2:
        return _line(meta["tag"], inc, exclude, template)
    if meta["tag"] == "position":
        relation = inc[1].pop("position")[0]
        inc[0]["position"] = [OPPOSITE[relation], 0]
    return _line(meta["tag"], [inc[1], inc[0]], exclude, template)


def variants(meta: Mapping) -> list[dict]:
    """Every prompt of a line's scene: each wording in TEMPLATES, each object order."""
    out = []
    for template in range(len(TEMPLATES)):
        same = _line(meta["tag"], _copy(meta["include"]), _copy(meta["exclude"]), template)
        out.append(same)
        if len(meta["include"]) == 2:
            out.append(swap_order(same))
    return out


def random_variant(meta: Mapping, rng: np.random.Generator) -> dict:
    """One of `variants(meta)`: a uniform wording and object order."""
    template = int(rng.integers(len(TEMPLATES)))
    if len(meta["include"]) == 2 and rng.random() < 0.5:
        return swap_order(meta, template)
    return _line(meta["tag"], _copy(meta["include"]), _copy(meta.get("exclude", [])), template)


def canonical_key(meta: Mapping) -> tuple:
    """A key equal for two lines iff they describe the same scene, whatever the object order
    and wording.

    Position lines are keyed as (relation in {left of, above}, object, target) after flipping
    "right of"/"below" around; the other tags as the sorted clauses.
    """
    inc = meta["include"]
    if meta["tag"] == "position":
        relation, obj, target = inc[1]["position"][0], inc[1]["class"], inc[0]["class"]
        if relation in ("right of", "below"):
            relation, obj, target = OPPOSITE[relation], target, obj
        return ("position", relation, obj, target)
    clauses = sorted((c["class"], c["count"], c.get("color", "")) for c in inc)
    return (meta["tag"], *clauses)


# Flow-GRPO's GenEval training mix (position:counting:color_attr:colors:two_object = 7:5:3:1:1,
# no single_object): the tags where RL gains most get the most prompts.
FLOW_GRPO_MIX = {
    "single_object": 0.0,
    "two_object": 1.0,
    "counting": 5.0,
    "colors": 1.0,
    "position": 7.0,
    "color_attr": 3.0,
}
TEST_SCENE_SHARE = 1 / 3  # at most this share of a tag's scenes is held out while training uses it


def split_counts(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split over TAGS in proportion to `weights` (largest remainder; ties to the
    earlier tag), so the counts add up to `total` exactly."""
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"tag weights must be >= 0 with a positive sum, got {dict(weights)}")
    total_weight = sum(weights.get(tag, 0.0) for tag in TAGS)
    exact = [total * weights.get(tag, 0.0) / total_weight for tag in TAGS]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(TAGS)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return dict(zip(TAGS, counts, strict=True))


def make_prompts(
    n_train: int,
    n_test: int,
    *,
    seed: int,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = tuple(COLORS),
    max_count: int = 4,
    mix: Mapping[str, float] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Train and test prompt sets in GenEval metadata format.

    Test: n_test // 6 prompts per tag (the remainder to the first tags). Train: n_train lines
    split over the tags in proportion to `mix` (default FLOW_GRPO_MIX; `split_counts`).
    Disjoint by scene (`canonical_key`): no scene of the test set is trained on in any wording
    or object order, which is stricter than GenEval's "no test prompt in training". A tag
    holds out up to its test count of scenes, at most TEST_SCENE_SHARE of them while training
    also uses the tag, and asks for each held-out scene in several wordings (round robin,
    random wording and order) where there are fewer scenes than prompts wanted; with 6 shapes
    every tag reaches 24 test prompts. Training lines are the other scenes' prompts in every
    wording and order, shuffled, repeated in the same order where a tag's share is larger
    than its pool (counting), so the training mix follows `mix` exactly. Deterministic in
    `seed`.
    """
    if n_train < 0 or n_test < 0:
        raise ValueError(f"n_train and n_test must be >= 0, got {n_train}, {n_test}")
    rng = np.random.default_rng(seed)
    want_train = split_counts(n_train, FLOW_GRPO_MIX if mix is None else mix)
    train, test = [], []
    for t, tag in enumerate(TAGS):
        want_test = n_test // len(TAGS) + (t < n_test % len(TAGS))
        scenes = prompt_pool(tag, shapes=shapes, colors=colors, max_count=max_count)
        scenes = [scenes[i] for i in rng.permutation(len(scenes))]
        n_held = min(want_test, len(scenes))
        if want_train[tag] > 0:
            n_held = min(n_held, max(int(len(scenes) * TEST_SCENE_SHARE), 1))
        test.extend(_round_robin(scenes[:n_held], want_test, rng))
        pool = [v for scene in scenes[n_held:] for v in variants(scene)]
        pool = [pool[i] for i in rng.permutation(len(pool))]
        if want_train[tag] and not pool:
            raise ValueError(f"tag {tag!r}: no scene left to train on after the test split")
        train.extend(pool[i % len(pool)] for i in range(want_train[tag]))
    return train, test


def _round_robin(scenes: list[dict], n: int, rng: np.random.Generator) -> list[dict]:
    """Up to n distinct prompts of `scenes`: one variant of each scene per pass, in random
    order within a scene, until n are taken or every variant is."""
    shuffled = [[vs[i] for i in rng.permutation(len(vs))] for vs in map(variants, scenes)]
    out = []
    for depth in range(max((len(vs) for vs in shuffled), default=0)):
        for vs in shuffled:
            if len(out) < n and depth < len(vs):
                out.append(vs[depth])
    return out


def sample_metadata(
    rng: np.random.Generator,
    n: int,
    *,
    pool: Sequence[Mapping] | None = None,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = tuple(COLORS),
    max_count: int = 4,
) -> list[dict]:
    """n random metadata lines: a tag uniformly, then a line of that tag uniformly, in a random
    wording and object order (`random_variant`). `pool` restricts the draw to given lines'
    scenes (e.g. a train set); default: the whole world."""
    if pool is None:
        pool = whole_world(tuple(shapes), tuple(colors), max_count)
    by_tag: dict[str, list[Mapping]] = {}
    for meta in pool:
        by_tag.setdefault(meta["tag"], []).append(meta)
    tags = sorted(by_tag, key=TAGS.index)
    out = []
    for _ in range(n):
        lines = by_tag[tags[rng.integers(len(tags))]]
        out.append(random_variant(lines[rng.integers(len(lines))], rng))
    return out


@functools.cache
def whole_world(
    shapes: tuple[str, ...] = SHAPES, colors: tuple[str, ...] = tuple(COLORS), max_count: int = 4
) -> list[dict]:
    """Every scene of every tag in GenEval's wording (cached: training draws from it every
    step; never mutated)."""
    return [
        m
        for tag in TAGS
        for m in prompt_pool(tag, shapes=shapes, colors=colors, max_count=max_count)
    ]


def world_lines(world) -> list[dict]:
    """Every scene of the world configured by ``world`` (the `world` params section), as
    metadata lines."""
    return whole_world(tuple(world.shapes), tuple(world.colors), world.max_count)


def world_prompts(
    shapes: tuple[str, ...] = SHAPES, colors: tuple[str, ...] = tuple(COLORS), max_count: int = 4
) -> list[str]:
    """Every prompt text of the world: each scene in each wording and object order."""
    return [v["prompt"] for m in whole_world(shapes, colors, max_count) for v in variants(m)]


def _copy(meta):
    return json.loads(json.dumps(meta))


# ----------------------------------------------------------------------------- validation


def validate_metadata(
    meta: Mapping,
    line: int | None = None,
    *,
    shapes: Sequence[str] = SHAPES,
    colors: Sequence[str] = tuple(COLORS),
) -> None:
    """Raise ValueError naming the line if `meta` is not a valid ShapesWorld GenEval line.

    Checks: known tag; non-empty prompt; non-empty include of clauses with a known class, an
    integer count >= 1, an optional known color and an optional position [relation, index]
    with a known relation and an index of an earlier clause; at most MAX_OBJECTS objects in
    all; exclude clauses with a known class and count >= 1.
    """
    where = f"line {line}: " if line is not None else ""

    def fail(message: str) -> None:
        raise ValueError(f"{where}{message}")

    if not isinstance(meta, Mapping):
        fail(f"expected a JSON object, got {type(meta).__name__}")
    if meta.get("tag") not in TAGS:
        fail(f"unknown tag {meta.get('tag')!r}; expected one of {', '.join(TAGS)}")
    if not isinstance(meta.get("prompt"), str) or not meta["prompt"].strip():
        fail("missing or empty 'prompt'")
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        fail("'include' must be a non-empty list")
    for i, clause in enumerate(include):
        _check_clause(clause, f"include[{i}]", shapes, fail)
        if "color" in clause and clause["color"] not in colors:
            fail(f"include[{i}]: unknown color {clause['color']!r}; expected one of {colors}")
        if "position" in clause:
            pos = clause["position"]
            if not (isinstance(pos, list | tuple) and len(pos) == 2):
                fail(f"include[{i}]: position must be [relation, target_index], got {pos!r}")
            if pos[0] not in RELATIONS:
                fail(f"include[{i}]: unknown relation {pos[0]!r}; expected one of {RELATIONS}")
            if not isinstance(pos[1], int) or isinstance(pos[1], bool) or not 0 <= pos[1] < i:
                fail(
                    f"include[{i}]: position target index {pos[1]!r} out of range; it must "
                    f"name an earlier include clause (0..{i - 1})"
                )
    if sum(c["count"] for c in include) > MAX_OBJECTS:
        fail(f"more than {MAX_OBJECTS} objects in all")
    exclude = meta.get("exclude", [])
    if not isinstance(exclude, list):
        fail("'exclude' must be a list")
    for i, clause in enumerate(exclude):
        _check_clause(clause, f"exclude[{i}]", shapes, fail)


def _check_clause(clause, label: str, shapes: Sequence[str], fail) -> None:
    if not isinstance(clause, Mapping):
        fail(f"{label}: expected an object, got {clause!r}")
    if clause.get("class") not in shapes:
        fail(f"{label}: unknown class {clause.get('class')!r}; expected one of {tuple(shapes)}")
    count = clause.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        fail(f"{label}: count must be an integer >= 1, got {count!r}")


def read_prompts(path: str | Path, **valid) -> list[dict]:
    """Read a GenEval metadata jsonl file, validating each line (errors name the 1-based line).

    `valid` is passed on to `validate_metadata` (shapes=..., colors=...)."""
    rows = []
    with open(path) as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                meta = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {number}: invalid JSON ({err.msg})") from err
            try:
                validate_metadata(meta, number, **valid)
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from err
            rows.append(meta)
    return rows


def write_prompts(path: str | Path, rows: Iterable[Mapping]) -> None:
    """Write metadata lines as jsonl (via a temporary name, so a killed run leaves none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------- rendering

_GAP = 3.0  # px of background kept between objects' circumcircles
_EDGE = 1.0  # px kept between an object and the canvas edge
_RELATION_MARGIN = {"threshold": 0.15, "cut": 0.65}  # stricter than GenEval's 0.1 / 0.5
_MAX_TRIES = 2000
_CANDIDATES = 64  # centre proposals per object per try


def _size_range(n_objects: int, image_size: int) -> tuple[float, float]:
    """Nominal object size range (px): smaller when the scene is crowded."""
    lo, hi = (0.24, 0.36) if n_objects <= 2 else (0.2, 0.27) if n_objects <= 4 else (0.18, 0.23)
    return lo * image_size, hi * image_size


def scene_objects(meta: Mapping, rng: np.random.Generator) -> list[dict]:
    """The objects a line asks for: one dict per object with class, RGB color and clause index.
    Objects without a color get one drawn from the palette."""
    names = list(COLORS)
    objects = []
    for i, clause in enumerate(meta["include"]):
        for _ in range(clause["count"]):
            color = clause.get("color") or names[rng.integers(len(names))]
            objects.append({"class": clause["class"], "color": color, "clause": i})
    return objects


def layout(meta: Mapping, rng: np.random.Generator, size: int = 32) -> list[dict]:
    """Random non-overlapping placement of the line's objects, position relations satisfied.

    Returns objects (see `scene_objects`) with `cx`, `cy`, `size`, `angle` and exact `box`.
    Rejection sampling; raises RuntimeError if no layout is found (only for impossible lines).
    """
    objects = scene_objects(meta, rng)
    if len(objects) > MAX_OBJECTS:
        raise ValueError(f"{len(objects)} objects: the world draws at most {MAX_OBJECTS}")
    lo, hi = _size_range(len(objects), size)
    relations = [
        (i, clause["position"][0], clause["position"][1])
        for i, clause in enumerate(meta["include"])
        if "position" in clause
    ]
    for _ in range(_MAX_TRIES):
        placed = _place(objects, rng, size, lo, hi)
        if placed is not None and _relations_hold(placed, relations):
            return placed
    raise RuntimeError(f"no layout found for {meta.get('prompt', meta)!r}")


def _place(objects, rng, size, lo, hi) -> list[dict] | None:
    placed: list[dict] = []
    for obj in objects:
        s = rng.uniform(lo, hi)
        reach = shape_reach(obj["class"], s)
        candidates = rng.uniform(reach + _EDGE, size - reach - _EDGE, size=(_CANDIDATES, 2))
        free = np.ones(_CANDIDATES, dtype=bool)
        for p in placed:  # keep a gap between circumcircles
            dist = np.hypot(candidates[:, 0] - p["cx"], candidates[:, 1] - p["cy"])
            free &= dist >= reach + p["reach"] + _GAP
        if not free.any():
            return None
        cx, cy = candidates[free.argmax()].tolist()
        tilt = min(ROTATION_JITTER, SYMMETRY[obj["class"]] / 2)
        angle = rng.uniform(-tilt, tilt)
        verts = shape_vertices(obj["class"], cx, cy, s, angle)
        box = (*verts.min(axis=0).tolist(), *verts.max(axis=0).tolist())
        placed.append(
            {**obj, "cx": cx, "cy": cy, "size": s, "angle": angle, "reach": reach, "box": box}
        )
    return placed


def _relations_hold(placed: list[dict], relations: list[tuple[int, str, int]]) -> bool:
    for clause, relation, target in relations:
        for obj in (p for p in placed if p["clause"] == clause):
            for tgt in (p for p in placed if p["clause"] == target):
                if relation not in relative_position(obj["box"], tgt["box"], **_RELATION_MARGIN):
                    return False
    return True


def draw(objects: Sequence[Mapping], size: int = 32) -> np.ndarray:
    """Paint laid-out objects (see `layout`) on the background: (size, size, 3) float32."""
    image = np.empty((size, size, 3), dtype=np.float32)
    image[:] = BACKGROUND
    for obj in objects:
        x0, y0, x1, y1 = obj["box"]
        c0, c1 = max(int(x0) - 1, 0), min(int(math.ceil(x1)) + 1, size)
        r0, r1 = max(int(y0) - 1, 0), min(int(math.ceil(y1)) + 1, size)
        dx = np.arange(c0, c1) + 0.5 - obj["cx"]  # (w,)
        dy = np.arange(r0, r1)[:, None] + 0.5 - obj["cy"]  # (h, 1)
        alpha = shape_coverage(obj["class"], dx[None, :], dy, obj["size"], obj["angle"])
        alpha = alpha[..., None].astype(np.float32)  # (h, w, 1)
        color = np.asarray(COLORS[obj["color"]], dtype=np.float32)
        patch = image[r0:r1, c0:c1]
        image[r0:r1, c0:c1] = (1 - alpha) * patch + alpha * color
    return image


def render(meta: Mapping, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """A random scene satisfying a metadata line: (size, size, 3) float32 in [0, 1]."""
    return draw(layout(meta, rng, size), size)


def render_batch(
    metas: Sequence[Mapping], rng: np.random.Generator, size: int = 32
) -> torch.Tensor:
    """Render each line once: (B, 3, size, size) float32 in [0, 1]."""
    images = np.stack([render(m, rng, size) for m in metas])  # (B, H, W, 3)
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()  # (B, 3, H, W)


# ----------------------------------------------------------------------------- corruptions

# Which wrong scenes make sense per tag (GenEval has no exclude outside counting, so an extra
# object only falsifies counting lines).
CORRUPTIONS: dict[str, tuple[str, ...]] = {
    "single_object": ("missing_object", "wrong_class"),
    "two_object": ("missing_object", "wrong_class"),
    "counting": ("missing_object", "extra_object", "wrong_class"),
    "colors": ("missing_object", "wrong_class", "wrong_color"),
    "position": ("missing_object", "wrong_class", "swapped_relation"),
    "color_attr": ("missing_object", "wrong_class", "wrong_color", "swapped_colors"),
}


def corrupt(
    meta: Mapping, kind: str, rng: np.random.Generator, *, shapes: Sequence[str] = SHAPES
) -> dict:
    """A scene description (metadata-like, for `render`) that deliberately violates `meta`.

    kind: "missing_object" (one object fewer; a single-object line gets an empty scene),
    "extra_object" (one more object of the counted class), "wrong_class" (one object becomes
    a class of `shapes` the line does not name, if any is left), "wrong_color" (one colored object
    gets another color), "swapped_colors" (the two colors trade places), "swapped_relation"
    (the opposite relation). Raises ValueError where the kind does not apply (see CORRUPTIONS).
    """
    if kind not in CORRUPTIONS.get(meta["tag"], ()):
        raise ValueError(f"corruption {kind!r} does not apply to tag {meta['tag']!r}")
    inc = [dict(c) for c in meta["include"]]
    if kind == "missing_object":
        if len(inc) == 1:
            inc[0]["count"] -= 1
            inc = [c for c in inc if c["count"] > 0]
        else:  # drop one clause; a position relation to a dropped target goes with it
            inc.pop(int(rng.integers(len(inc))))
            for c in inc:
                c.pop("position", None)
    elif kind == "extra_object":
        inc[0]["count"] += 1
    elif kind == "wrong_class":
        i = int(rng.integers(len(inc)))
        unused = [s for s in shapes if s not in {c["class"] for c in inc}]
        others = unused or [s for s in shapes if s != inc[i]["class"]]
        new_class = others[rng.integers(len(others))]
        if inc[i]["count"] > 1:  # counting: one of the n objects changes class
            inc[i]["count"] -= 1
            inc.append({"class": new_class, "count": 1})
        else:
            inc[i]["class"] = new_class
    elif kind == "wrong_color":
        i = int(rng.integers(len(inc)))
        others = [c for c in COLORS if c not in {clause["color"] for clause in inc}]
        inc[i]["color"] = others[rng.integers(len(others))]
    elif kind == "swapped_colors":
        inc[0]["color"], inc[1]["color"] = inc[1]["color"], inc[0]["color"]
    elif kind == "swapped_relation":
        relation, target = inc[1]["position"]
        inc[1]["position"] = [OPPOSITE[relation], target]
    return {
        "tag": meta["tag"],
        "prompt": f"[{kind}] {meta['prompt']}",
        "include": inc,
        "exclude": [],
    }


# ----------------------------------------------------------------------------- degradation


def _blur_matrix(sigma: Tensor, n: int, radius: int = 3) -> Tensor:
    """Per-image 1-D Gaussian blur along an axis of length n as a matrix, edges replicated:
    (B,) sigmas -> (B, 1, n, n) with out[i] = sum_j M[i, j] in[j]."""
    taps = torch.arange(-radius, radius + 1)  # (K,)
    kernel = torch.exp(-0.5 * (taps[None] / sigma.clamp_min(1e-3)[:, None]) ** 2)  # (B, K)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)
    source = (torch.arange(n)[:, None] + taps[None]).clamp(0, n - 1)  # (n, K) replicate edges
    one_hot = torch.nn.functional.one_hot(source, n).float()  # (n, K, n)
    return torch.einsum("bk,ikj->bij", kernel, one_hot)[:, None]  # (B, 1, n, n)


def degrade(
    images: torch.Tensor,
    generator: torch.Generator,
    *,
    max_blur: float = 1.0,
    max_noise: float = 0.06,
    max_jitter: float = 0.06,
) -> torch.Tensor:
    """Make renders look generated: per image a Gaussian blur of random sigma in [0, max_blur]
    px, per-channel color offsets uniform in +-max_jitter, and pixel noise of random std in
    [0, max_noise]. images: (B, 3, H, W) in [0, 1] -> same shape, clipped to [0, 1]."""
    b, c, h, w = images.shape
    sigma = torch.rand(b, generator=generator) * max_blur  # (B,)
    x = _blur_matrix(sigma, h) @ images @ _blur_matrix(sigma, w).transpose(-1, -2)  # (B, C, H, W)
    jitter = (torch.rand(b, c, 1, 1, generator=generator) * 2 - 1) * max_jitter
    noise_std = torch.rand(b, 1, 1, 1, generator=generator) * max_noise
    noise = torch.randn(b, c, h, w, generator=generator) * noise_std
    return (x + jitter + noise).clamp(0.0, 1.0)
