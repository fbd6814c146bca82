"""ShapesWorld prompts, validation, rendering and corruptions."""

import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from pipeline import world
from pipeline.geneval import TAGS, relative_position


def test_palette_is_well_separated():
    palette = np.array(list(world.COLORS.values()))
    pairwise = np.linalg.norm(palette[:, None] - palette[None], axis=-1)
    assert pairwise[~np.eye(len(palette), dtype=bool)].min() > 0.35
    assert np.linalg.norm(palette - np.array(world.BACKGROUND), axis=1).min() > 0.45
    assert tuple(world.COLORS) == (
        "red",
        "orange",
        "yellow",
        "green",
        "blue",
        "purple",
        "pink",
        "brown",
        "black",
        "white",
    )


# ----------------------------------------------------------------------------- prompts


def test_pool_sizes_and_templates():
    sizes = {tag: len(world.prompt_pool(tag)) for tag in TAGS}
    assert sizes == {
        "single_object": 6,
        "two_object": 15,
        "counting": 18,
        "colors": 60,
        "position": 60,
        "color_attr": 1350,
    }
    prompts = {m["prompt"] for tag in TAGS for m in world.prompt_pool(tag)}
    assert {
        "a photo of a circle",
        "a photo of a circle and a square",
        "a photo of three circles",
        "a photo of two crosses",
        "a photo of an orange triangle",
        "a photo of a circle left of a square",
        "a photo of a red circle and a blue square",
        "a photo of a star below a diamond",
    } <= prompts
    assert not any("crosss" in p for p in prompts)


def test_variants_word_and_order_one_scene():
    line = next(
        m for m in world.prompt_pool("position") if m["prompt"] == "a photo of a cross above a star"
    )
    texts = [v["prompt"] for v in world.variants(line)]
    assert len(texts) == len(set(texts)) == 2 * len(world.TEMPLATES)
    assert "an image of a star below a cross" in texts
    assert "a drawing of a cross above a star" in texts
    assert {world.canonical_key(v) for v in world.variants(line)} == {world.canonical_key(line)}
    assert [world.template_of(v) for v in world.variants(line)] == [0, 0, 1, 1, 2, 2, 3, 3]
    single = world.prompt_pool("counting")[0]
    assert [v["prompt"] for v in world.variants(single)] == [
        f"{lead} two circles" for lead in world.TEMPLATES
    ]
    # a swapped line keeps its wording
    picture = world.variants(line)[2]
    assert world.swap_order(picture)["prompt"] == "a picture of a star below a cross"
    assert world.template_of({"prompt": "no template here"}) == 0


def test_counting_and_position_metadata_follow_geneval():
    four = next(
        m for m in world.prompt_pool("counting") if m["prompt"] == "a photo of four squares"
    )
    assert four["include"] == [{"class": "square", "count": 4}]
    assert four["exclude"] == [{"class": "square", "count": 5}]
    line = next(
        m
        for m in world.prompt_pool("position")
        if m["prompt"] == "a photo of a circle above a triangle"
    )
    assert line["include"] == [
        {"class": "triangle", "count": 1},
        {"class": "circle", "count": 1, "position": ["above", 0]},
    ]


def test_swap_order_keeps_the_scene():
    line = next(
        m
        for m in world.prompt_pool("position")
        if m["prompt"] == "a photo of a circle left of a square"
    )
    swapped = world.swap_order(line)
    assert swapped["prompt"] == "a photo of a square right of a circle"
    assert swapped["include"] == [
        {"class": "circle", "count": 1},
        {"class": "square", "count": 1, "position": ["right of", 0]},
    ]
    assert world.canonical_key(swapped) == world.canonical_key(line)
    above = next(
        m
        for m in world.prompt_pool("position")
        if m["prompt"] == "a photo of a circle above a square"
    )
    assert world.canonical_key(above) != world.canonical_key(line)
    pair = world.prompt_pool("color_attr")[0]
    assert world.swap_order(pair)["prompt"] != pair["prompt"]
    assert world.canonical_key(world.swap_order(pair)) == world.canonical_key(pair)


def test_split_counts_follow_weights_exactly():
    # 17 parts of 600: 247.06 / 176.47 / 105.88 / 35.29 / 35.29 -> largest remainders
    counts = world.split_counts(600, world.FLOW_GRPO_MIX)
    assert counts == {
        "single_object": 0,
        "two_object": 35,
        "counting": 177,
        "colors": 35,
        "position": 247,
        "color_attr": 106,
    }
    assert world.split_counts(7, {"colors": 1, "position": 1}) == {
        **dict.fromkeys(TAGS, 0),
        "colors": 4,
        "position": 3,
    }
    with pytest.raises(ValueError, match="positive sum"):
        world.split_counts(10, dict.fromkeys(TAGS, 0.0))


def test_default_split_is_big_enough_to_measure():
    train, test = world.make_prompts(600, 144, seed=0)
    assert Counter(m["tag"] for m in test) == dict.fromkeys(TAGS, 24)
    want = world.split_counts(600, world.FLOW_GRPO_MIX)
    assert Counter(m["tag"] for m in train) == {t: n for t, n in want.items() if n}
    assert len({m["prompt"] for m in test}) == 144
    # no test scene is trained on, in any wording or object order
    assert not {world.canonical_key(m) for m in train} & {world.canonical_key(m) for m in test}
    test_scenes = Counter(m["tag"] for m in {world.canonical_key(m): m for m in test}.values())
    assert test_scenes["single_object"] == 6  # every shape held out, in four wordings
    assert min(test_scenes.values()) >= 5
    for i, meta in enumerate(train + test):
        world.validate_metadata(meta, i)


def test_make_prompts_disjoint_deterministic_and_mixed():
    mix = dict.fromkeys(TAGS, 1.0)
    train, test = world.make_prompts(60, 30, seed=3, mix=mix)
    assert Counter(m["tag"] for m in test) == dict.fromkeys(TAGS, 5)
    assert Counter(m["tag"] for m in train) == dict.fromkeys(TAGS, 10)
    # single_object (6 scenes) is trained on too, so at most a third of its scenes are held out
    assert len({world.canonical_key(m) for m in test if m["tag"] == "single_object"}) == 2
    assert not {world.canonical_key(m) for m in train} & {world.canonical_key(m) for m in test}
    assert world.make_prompts(60, 30, seed=3, mix=mix) == (train, test)
    assert world.make_prompts(60, 30, seed=4, mix=mix) != (train, test)
    assert world.make_prompts(0, 12, seed=0)[0] == []
    assert len(world.make_prompts(0, 12, seed=0)[1]) == 12


def test_sample_metadata_draws_from_pool():
    train, _ = world.make_prompts(60, 30, seed=0)
    rng = np.random.default_rng(0)
    keys = {world.canonical_key(m) for m in train}
    drawn = world.sample_metadata(rng, 300, pool=train)
    assert {world.canonical_key(m) for m in drawn} <= keys
    assert set(Counter(m["tag"] for m in drawn)) == {t for t in TAGS if t != "single_object"}
    assert len({world.template_of(m) for m in drawn}) == len(world.TEMPLATES)


# ----------------------------------------------------------------------------- validation

GOOD = {
    "tag": "position",
    "prompt": "p",
    "include": [
        {"class": "square", "count": 1},
        {"class": "circle", "count": 1, "position": ["left of", 0]},
    ],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tag": "shapes"}, "line 7: unknown tag 'shapes'"),
        ({"include": [{"class": "circle", "count": 0}]}, r"line 7: include\[0\]: count must be"),
        (
            {"include": [{"class": "circle", "count": 1, "position": ["left of", 0]}]},
            r"line 7: include\[0\]: position target index 0 out of range",
        ),
        (
            {
                "include": [
                    GOOD["include"][0],
                    {"class": "circle", "count": 1, "position": ["left of", 3]},
                ]
            },
            r"include\[1\]: position target index 3 out of range",
        ),
        (
            {
                "include": [
                    GOOD["include"][0],
                    {"class": "circle", "count": 1, "position": ["near", 0]},
                ]
            },
            "unknown relation 'near'",
        ),
        ({"include": [{"class": "hexagon", "count": 1}]}, "unknown class 'hexagon'"),
        ({"include": [{"class": "circle", "count": 1, "color": "teal"}]}, "unknown color 'teal'"),
        ({"include": []}, "non-empty list"),
        ({"exclude": [{"class": "circle", "count": 0}]}, r"exclude\[0\]: count"),
        ({"include": [{"class": "circle", "count": 6}]}, "more than 5 objects"),
    ],
)
def test_bad_metadata_names_the_line(change, message):
    world.validate_metadata(GOOD, 7)
    with pytest.raises(ValueError, match=message):
        world.validate_metadata({**GOOD, **change}, 7)


def test_read_prompts_round_trip_and_error_line(tmp_path):
    train, _ = world.make_prompts(12, 6, seed=0)
    path = tmp_path / "p.jsonl"
    world.write_prompts(path, train)
    assert world.read_prompts(path) == train
    lines = path.read_text().splitlines()
    lines[2] = re.sub(r'"count": \d', '"count": -1', lines[2], count=1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 3: include\[0\]: count must be an integer >= 1"):
        world.read_prompts(path)
    path.write_text('{"tag": "colors"\n')
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        world.read_prompts(path)


# ----------------------------------------------------------------------------- rendering


def test_render_shape_range_determinism():
    meta = world.prompt_pool("color_attr")[5]
    image = world.render(meta, np.random.default_rng(0))
    assert image.shape == (32, 32, 3) and image.dtype == np.float32
    assert image.min() >= 0.0 and image.max() <= 1.0
    assert np.array_equal(image, world.render(meta, np.random.default_rng(0)))
    assert not np.array_equal(image, world.render(meta, np.random.default_rng(1)))
    batch = world.render_batch([meta, meta], np.random.default_rng(0), size=48)
    assert batch.shape == (2, 3, 48, 48) and batch.dtype == torch.float32
    first = world.render(meta, np.random.default_rng(0), size=48)
    assert torch.equal(batch[0], torch.from_numpy(first).permute(2, 0, 1))


def test_colored_objects_use_their_palette_color():
    meta = next(
        m
        for m in world.prompt_pool("color_attr")
        if m["prompt"] == "a photo of a red circle and a blue square"
    )
    image = world.render(meta, np.random.default_rng(0))
    pixels = image.reshape(-1, 3)
    for rgb in (world.COLORS["red"], world.COLORS["blue"], world.BACKGROUND):
        assert (np.abs(pixels - np.array(rgb)).max(axis=1) < 1e-6).sum() >= 10
    assert (np.abs(pixels - np.array(world.COLORS["green"])).max(axis=1) < 0.1).sum() == 0


def test_layouts_are_valid():
    rng = np.random.default_rng(0)
    metas = world.sample_metadata(rng, 300)
    tilts = []
    for meta in metas:
        objects = world.layout(meta, rng)
        assert len(objects) == sum(c["count"] for c in meta["include"])
        for obj in objects:
            x0, y0, x1, y1 = obj["box"]
            assert 0 < x0 < x1 < 32 and 0 < y0 < y1 < 32
            bound = min(world.ROTATION_JITTER, world.SYMMETRY[obj["class"]] / 2)
            assert abs(obj["angle"]) <= bound
            if obj["class"] != "circle":
                tilts.append(obj["angle"])
        for a in range(len(objects)):
            for b in range(a):
                gap = math.hypot(
                    objects[a]["cx"] - objects[b]["cx"], objects[a]["cy"] - objects[b]["cy"]
                )
                assert gap > objects[a]["reach"] + objects[b]["reach"]
        for i, clause in enumerate(meta["include"]):
            if "position" in clause:
                relation, target = clause["position"]
                for obj in (o for o in objects if o["clause"] == i):
                    for tgt in (o for o in objects if o["clause"] == target):
                        assert relation in relative_position(obj["box"], tgt["box"])
    # Tilts spread over the whole jitter range, both ways.
    assert max(tilts) > 0.8 * world.ROTATION_JITTER and min(tilts) < -0.8 * world.ROTATION_JITTER


def test_shape_area_matches_hand_values_and_coverage():
    sin36 = math.sin(math.pi / 5)
    by_hand = {  # nominal size 1
        "circle": math.pi * 0.5**2,
        "square": 0.9**2,
        "triangle": 0.5 * 3 * 0.7**2 * math.sin(2 * math.pi / 3),
        "cross": 2 * (2 * 0.62) * (2 * 0.32 * 0.62) - (2 * 0.32 * 0.62) ** 2,
        "star": 5 * 0.72 * 0.36 * sin36,  # 10 triangles centre-tip-notch
        "diamond": 2 * 0.72 * 0.45,
    }
    assert set(by_hand) == set(world.SHAPE_NAMES)
    grid = np.arange(64) + 0.5 - 32.0
    for shape, area in by_hand.items():
        assert world.shape_area(shape, 1.0) == pytest.approx(area, rel=5e-3), shape
        coverage = world.shape_coverage(shape, grid[None, :], grid[:, None], 30.0, 0.3)
        assert coverage.sum() == pytest.approx(world.shape_area(shape, 30.0), rel=0.02)


def test_shape_classes_stay_apart_under_rotation():
    """No two classes look alike at the world's sizes: the soft IoU of a shape with its best
    rotation of any other class (same area and centroid, the detector's matching) is <= 0.86
    (circle and square are the closest pair, 0.85; the new classes stay under 0.80), while its
    own class matches at >= 0.9."""
    from pipeline.detector import _classify

    grid = np.arange(24) + 0.5 - 12.0
    for shape in world.SHAPE_NAMES:
        soft = world.shape_coverage(shape, grid[None, :], grid[:, None], 9.0, 0.1)
        own = _classify(soft, [shape])[1]
        others = max(_classify(soft, [s])[1] for s in world.SHAPE_NAMES if s != shape)
        assert own >= 0.9 and others <= 0.86, (shape, own, others)


# ----------------------------------------------------------------------------- corruptions


def test_corruptions_change_the_scene_as_named():
    rng = np.random.default_rng(0)
    counting = next(m for m in world.prompt_pool("counting") if m["include"][0]["count"] == 3)
    assert world.corrupt(counting, "missing_object", rng)["include"][0]["count"] == 2
    assert world.corrupt(counting, "extra_object", rng)["include"][0]["count"] == 4
    single = world.prompt_pool("single_object")[0]
    assert world.corrupt(single, "missing_object", rng)["include"] == []
    pair = next(
        m
        for m in world.prompt_pool("color_attr")
        if m["prompt"] == "a photo of a red circle and a blue square"
    )
    swapped = world.corrupt(pair, "swapped_colors", rng)["include"]
    assert [c["color"] for c in swapped] == ["blue", "red"]
    wrong = world.corrupt(pair, "wrong_color", rng)["include"]
    assert sum(c["color"] not in ("red", "blue") for c in wrong) == 1
    line = world.prompt_pool("position")[0]
    flipped = world.corrupt(line, "swapped_relation", rng)
    assert flipped["include"][1]["position"] == [
        world.OPPOSITE[line["include"][1]["position"][0]],
        0,
    ]
    dropped = world.corrupt(line, "missing_object", rng)["include"]
    assert len(dropped) == 1 and "position" not in dropped[0]
    two = world.corrupt(counting, "wrong_class", rng)["include"]
    assert two[0] == {"class": counting["include"][0]["class"], "count": 2}
    assert two[1]["count"] == 1 and two[1]["class"] != two[0]["class"]
    other = world.corrupt(pair, "wrong_class", rng)["include"]
    assert {c["class"] for c in other} in ({"triangle", "square"}, {"circle", "triangle"})
    with pytest.raises(ValueError, match="does not apply"):
        world.corrupt(single, "swapped_relation", rng)
    # every corruption still renders
    for tag, kinds in world.CORRUPTIONS.items():
        for kind in kinds:
            scene = world.corrupt(world.prompt_pool(tag)[-1], kind, rng)
            assert world.render(scene, rng).shape == (32, 32, 3)


def test_degrade_identity_at_zero_and_bounded():
    images = world.render_batch(world.prompt_pool("colors")[:4], np.random.default_rng(0))
    gen = torch.Generator().manual_seed(0)
    same = world.degrade(images, gen, max_blur=0.0, max_noise=0.0, max_jitter=0.0)
    assert torch.allclose(same, images, atol=1e-6)
    noisy = world.degrade(images, gen)
    assert noisy.shape == images.shape and 0.0 <= noisy.min() and noisy.max() <= 1.0
    assert not torch.allclose(noisy, images, atol=1e-3)


def test_degrade_blur_matches_scipy_gaussian():
    from scipy import ndimage

    images = world.render_batch(world.prompt_pool("counting")[:3], np.random.default_rng(0))
    blurred = world.degrade(
        images, torch.Generator().manual_seed(5), max_blur=1.5, max_noise=0.0, max_jitter=0.0
    )
    sigmas = torch.rand(3, generator=torch.Generator().manual_seed(5)) * 1.5  # same draw
    for image, out, sigma in zip(images.numpy(), blurred.numpy(), sigmas.tolist(), strict=True):
        reference = ndimage.gaussian_filter(
            image, (0, sigma, sigma), mode="nearest", truncate=3 / sigma
        )
        assert np.abs(reference - out).max() < 1e-5
