"""Detector on clean and degraded ShapesWorld renders."""

import numpy as np
import pytest
import torch

from pipeline import detector, world
from pipeline.detector import detect, detect_batch
from pipeline.geneval import evaluate


def _scene(objects, size=32):
    """Draw hand-placed objects: (class, color, cx, cy, size, angle)."""
    laid = []
    for name, color, cx, cy, s, angle in objects:
        verts = world.shape_vertices(name, cx, cy, s, angle)
        box = (*verts.min(axis=0).tolist(), *verts.max(axis=0).tolist())
        laid.append(
            {
                "class": name,
                "color": color,
                "cx": cx,
                "cy": cy,
                "size": s,
                "angle": angle,
                "box": box,
            }
        )
    return world.draw(laid, size)


def test_hand_placed_scene_classes_colors_boxes():
    image = _scene(
        [
            ("square", "red", 8.0, 8.0, 10.0, 0.0),
            ("circle", "blue", 24.0, 8.0, 9.0, 0.0),
            ("triangle", "yellow", 16.0, 23.0, 10.0, 0.4),
        ]
    )
    found = detect(image)
    assert {k: len(v) for k, v in found.items()} == {
        "circle": 1,
        "square": 1,
        "triangle": 1,
        "cross": 0,
        "star": 0,
        "diamond": 0,
    }
    square = found["square"][0]
    assert square.color == "red"
    # side 0.9 * 10 = 9 around x = 8: edges at 3.5 and 12.5, pixel-edge box within half a pixel
    assert np.allclose(square.box, (3.5, 3.5, 12.5, 12.5), atol=0.51)
    assert found["circle"][0].color == "blue" and found["triangle"][0].color == "yellow"
    for dets in (d for d in found.values() if d):
        assert 0.9 < dets[0].score <= 1.0
        assert dets[0].mask.shape == (32, 32) and dets[0].mask.dtype == bool


def test_array_and_tensor_inputs_agree():
    image = world.render(world.prompt_pool("counting")[4], np.random.default_rng(0))
    from_array = detect(image)
    from_tensor = detect(torch.from_numpy(image).permute(2, 0, 1))
    batch = detect_batch(torch.from_numpy(image).permute(2, 0, 1)[None].repeat(2, 1, 1, 1))
    for found in (from_tensor, *batch):
        assert {k: [d.box for d in v] for k, v in found.items()} == {
            k: [d.box for d in v] for k, v in from_array.items()
        }
    with pytest.raises(ValueError, match="expected"):
        detect(np.zeros((32, 32)))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        detect_batch(torch.zeros(3, 32, 32))


def test_background_specks_and_noise_give_nothing():
    blank = np.full((32, 32, 3), 0.5, dtype=np.float32)
    assert all(v == [] for v in detect(blank).values())
    specks = blank.copy()
    specks[3:5, 3:5] = world.COLORS["red"]  # 4 px < MIN_AREA
    specks[20, 10:13] = world.COLORS["white"]
    assert all(v == [] for v in detect(specks).values())
    noise = np.clip(blank + np.random.default_rng(0).normal(0, 0.06, blank.shape), 0, 1)
    assert all(v == [] for v in detect(noise).values())


def test_detections_sorted_by_score():
    rng = np.random.default_rng(1)
    metas = [m for m in world.prompt_pool("counting") if m["include"][0]["count"] == 4]
    images = world.degrade(world.render_batch(metas * 5, rng), torch.Generator().manual_seed(0))
    for found in detect_batch(images):
        for dets in found.values():
            scores = [d.score for d in dets]
            assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(("degraded", "min_accuracy"), [(False, 1.0), (True, 0.97)])
def test_ground_truth_renders_judged_correct(degraded, min_accuracy):
    rng = np.random.default_rng(7)
    metas = world.sample_metadata(rng, 300)
    images = world.render_batch(metas, rng)
    if degraded:  # blur sigma <= 1 px, noise std <= 0.06, color offsets <= 0.06
        images = world.degrade(images, torch.Generator().manual_seed(7))
    verdicts = [evaluate(m, d)[0] for m, d in zip(metas, detect_batch(images), strict=True)]
    assert np.mean(verdicts) >= min_accuracy


def test_corrupted_renders_judged_wrong():
    rng = np.random.default_rng(3)
    for meta in world.sample_metadata(rng, 60):
        for kind in world.CORRUPTIONS[meta["tag"]]:
            image = world.render(world.corrupt(meta, kind, rng), rng)
            correct, reason = evaluate(meta, detect(image))
            assert not correct, (meta["prompt"], kind)
            assert reason


def test_hand_placed_star_cross_diamond():
    image = _scene(
        [
            ("star", "green", 8.0, 8.0, 11.0, 0.2),
            ("cross", "purple", 24.0, 8.0, 10.0, 0.1),
            ("diamond", "orange", 16.0, 23.0, 11.0, -0.2),
        ]
    )
    found = detect(image)
    assert {k: len(v) for k, v in found.items() if v} == {"star": 1, "cross": 1, "diamond": 1}
    colors = {k: v[0].color for k, v in found.items() if v}
    assert colors == {"star": "green", "cross": "purple", "diamond": "orange"}


def test_detection_on_worker_processes_equals_one_process():
    metas, _ = world.make_prompts(24, 0, seed=3)
    rng = np.random.default_rng(3)
    images = world.degrade(world.render_batch(metas * 2, rng), torch.Generator().manual_seed(3))
    assert len(images) >= 32  # PARALLEL_MIN_IMAGES: large enough to go to the workers
    serial, parallel = detect_batch(images), detect_batch(images, workers=2)

    def plain(found):
        return [
            {name: [(d.box, d.score, d.color, d.mask.tobytes()) for d in dets]
             for name, dets in image.items()}
            for image in found
        ]  # fmt: skip

    assert plain(parallel) == plain(serial)
    assert sum(len(d) for image in serial for d in image.values()) > len(images)  # not empty


def test_workers_that_cannot_start_fall_back_to_this_process(monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    import pipeline.detector as detector

    class Broken:
        def map(self, *args):
            raise BrokenProcessPool("a worker died at start")

    monkeypatch.setattr(detector, "_pool", lambda workers: Broken())
    monkeypatch.setattr(detector, "_BROKEN", set())
    metas, _ = world.make_prompts(24, 0, seed=3)
    images = world.render_batch(metas * 2, np.random.default_rng(3))
    with pytest.warns(RuntimeWarning, match="__main__"):
        found = detect_batch(images, workers=3)

    def boxes(batch):
        return [{name: [(d.box, d.score) for d in dets] for name, dets in f.items()} for f in batch]

    assert boxes(found) == boxes(detect_batch(images))
    assert detector._BROKEN == {3}  # not tried again in this process


@pytest.mark.parametrize("sigma", detector.BLUR_SIGMAS)
@pytest.mark.parametrize("shape", [(3, 20, 7), (2, 1, 14), (1, 30, 30)])
def test_template_blur_as_matrices_equals_scipy_gaussian_filter(sigma, shape):
    """The detector blurs its templates by two matmuls with `_blur_matrix`: the same values as
    scipy's zero-padded Gaussian filter, kernel wider than the image included."""
    from scipy import ndimage

    stack = np.random.default_rng(0).random(shape)  # (R, h, w)
    blurred = (
        detector._blur_matrix(sigma, shape[1]) @ stack @ detector._blur_matrix(sigma, shape[2]).T
    )
    expected = ndimage.gaussian_filter(stack, (0, sigma, sigma), mode="constant")
    np.testing.assert_allclose(blurred, expected, rtol=0, atol=1e-12)
