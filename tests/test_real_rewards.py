"""Real-image rewards on tiny random CLIP / OWLv2 models, with mocked detections for the rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.geneval import evaluate
from pipeline.real_rewards import (
    BACKGROUND,
    COLOR_TEMPLATES,
    COLORS,
    GENEVAL_CLASSES,
    MAX_OBJECTS,
    ColorClassifier,
    GenEvalDetector,
    box_iou,
    load_clip,
    load_owlv2,
    object_crop,
    query_classes,
    select_detections,
    to_uint8,
)
from pipeline.sd3_tiny import write_tiny_clip, write_tiny_owlv2

PROMPTS = ["a red dog", "a photo of two cats", "a blue bench", "a dog left of a cat", "x"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory):
    return write_tiny_owlv2(tmp_path_factory.mktemp("owlv2"))


@pytest.fixture(scope="module")
def images():
    return torch.rand((5, 3, 40, 40), generator=torch.Generator().manual_seed(0))


def test_images_quantise_to_8_bit_rgb():
    images = torch.tensor([0.0, 0.5, 1.0, 1.2, -0.1, 0.1]).view(1, 3, 1, 2)
    pixels = to_uint8(images)
    assert pixels.dtype == np.uint8 and pixels.shape == (1, 1, 2, 3)
    assert pixels[0, 0].tolist() == [[0, 255, 0], [128, 255, 26]]  # HWC, round(127.5) = 128


def test_clip_score_is_the_scaled_cosine_batched_in_chunks(clip_dir, images):
    small = load_clip(clip_dir, device="cpu", batch_size=2)
    scores = small(images, PROMPTS)
    model, processor = small.model, small.processor
    from PIL import Image

    inputs = processor(
        text=PROMPTS,
        images=[Image.fromarray(p) for p in to_uint8(images)],
        padding=True,
        truncation=True,  # the byte-level tiny vocabulary makes "a photo of two cats" too long
        max_length=model.config.text_config.max_position_embeddings,
        return_tensors="pt",
    )
    with torch.no_grad():
        reference = model(**inputs).logits_per_image.diagonal()  # exp(t) cos(image_i, text_i)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference, rtol=0, atol=1e-5)
    assert scores.abs().max() <= model.logit_scale.exp() + 1e-5
    whole = load_clip(clip_dir, device="cpu", batch_size=16)(images, PROMPTS)
    torch.testing.assert_close(scores, whole, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="5 images but 4 prompts"):
        small(images, PROMPTS[:4])


def test_color_classes_average_the_three_geneval_templates(clip_dir):
    clip = load_clip(clip_dir, device="cpu", batch_size=4)
    colors = ColorClassifier(clip)
    weights = colors.class_weights("dog")
    assert weights.shape[0] == 10
    torch.testing.assert_close(weights.norm(dim=-1), torch.ones(10))
    blue = clip.text_embeds([t.format(color="blue", name="dog") for t in COLOR_TEMPLATES])
    expected = blue.mean(dim=0) / blue.mean(dim=0).norm()
    torch.testing.assert_close(weights[COLORS.index("blue")], expected)

    crops = [np.full((h, 5, 3), v, dtype=np.uint8) for h, v in ((3, 0), (7, 200), (1, 90))]
    names = ["dog", "cat", "dog"]
    predicted = colors(crops, names)
    features = clip.image_embeds(crops)
    for feature, name, color in zip(features, names, predicted, strict=True):
        assert color == COLORS[int((colors.class_weights(name) @ feature).argmax())]


def test_box_iou_counts_inclusive_pixels_like_geneval():
    assert box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)
    assert box_iou((0, 0, 9, 9), (20, 20, 29, 29)) == 0.0
    assert box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0


def test_selection_thresholds_sorts_and_caps_per_class():
    classes = ["dog", "cat"]
    scores = np.array([0.5, 0.95, 0.3, 0.91, 0.2, 0.31])
    labels = np.array([0, 0, 0, 0, 1, 1])
    boxes = np.arange(24, dtype=float).reshape(6, 4) * 10
    found = select_detections(scores, labels, boxes, classes, threshold=0.3)
    assert [d.score for d in found["dog"]] == [0.95, 0.91, 0.5]  # 0.3 is not > 0.3
    assert [d.score for d in found["cat"]] == [0.31]
    assert found["dog"][0].box == tuple(boxes[1])
    counting = select_detections(scores, labels, boxes, classes, threshold=0.9)
    assert [d.score for d in counting["dog"]] == [0.95, 0.91] and "cat" not in counting

    many = np.linspace(0.4, 0.99, 20)
    capped = select_detections(many, np.zeros(20, int), np.zeros((20, 4)), ["dog"], threshold=0.3)
    assert len(capped["dog"]) == MAX_OBJECTS == 16
    assert capped["dog"][0].score == pytest.approx(0.99)


def test_overlap_suppression_is_off_at_one_and_greedy_below():
    scores = np.array([0.9, 0.8, 0.7])
    boxes = np.array([[0, 0, 9, 9], [1, 0, 10, 9], [30, 30, 39, 39]], dtype=float)
    args = (scores, np.zeros(3, int), boxes, ["dog"])
    assert len(select_detections(*args, threshold=0.3)["dog"]) == 3
    kept = select_detections(*args, threshold=0.3, nms_iou=0.5)["dog"]
    assert [d.score for d in kept] == [0.9, 0.7]


def test_object_crops_composite_on_999_through_the_mask():
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[..., 0] = 255  # a red image
    mask = np.zeros((8, 8), dtype=bool)
    mask[2:5, 3:5] = True
    crop = object_crop(image, (2.6, 1.6, 6.4, 5.4), mask)  # rounds to x 3..6, y 2..5
    assert crop.shape == (3, 3, 3)
    assert (crop[:, :2] == (255, 0, 0)).all()  # masked pixels keep their colour
    assert (crop[:, 2] == BACKGROUND).all()  # x = 5 lies outside the mask: #999999
    plain = object_crop(image, (2.6, 1.6, 6.4, 5.4), None)
    assert (plain == (255, 0, 0)).all() and plain.shape == (3, 3, 3)
    assert object_crop(image, (7.9, 7.9, 8.0, 8.0), None).shape == (1, 1, 3)  # never empty
    assert object_crop(image, (-5, -5, 100, 100), None).shape == (8, 8, 3)  # clamped


class FakeDetector:
    """Returns fixed raw detections (dog boxes, cat boxes) for every image."""

    def __init__(self, dog_scores, cat_scores=()):
        self.dog_scores, self.cat_scores = list(dog_scores), list(cat_scores)

    def __call__(self, pixels, classes):
        scores = np.array(self.dog_scores + self.cat_scores)
        labels = np.array(
            [classes.index("dog")] * len(self.dog_scores)
            + [classes.index("cat")] * len(self.cat_scores)
        )
        boxes = np.array([[4 + 10 * i, 4, 12 + 10 * i, 12] for i in range(len(scores))], float)
        return [(scores, labels, boxes)] * len(pixels)


class MeanColor:
    """Colour classifier stand-in: red if a crop's mean is reddest, else blue; logs its input."""

    def __init__(self):
        self.seen = []

    def __call__(self, crops, names):
        self.seen.append((crops, names))
        return ["red" if c.reshape(-1, 3).mean(0).argmax() == 0 else "blue" for c in crops]


def test_counting_prompts_use_the_stricter_threshold():
    detect = GenEvalDetector(FakeDetector([0.95, 0.5]), MeanColor())
    counting = {"tag": "counting", "include": [{"class": "dog", "count": 2}]}
    single = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    two = {"tag": "two_object", "include": [{"class": "dog", "count": 2}]}
    found = detect(torch.zeros(3, 3, 40, 40), [counting, single, two])
    assert [len(f["dog"]) for f in found] == [1, 2, 2]
    assert [evaluate(m, f)[0] for m, f in zip([counting, single, two], found, strict=True)] == [
        0,
        1,
        1,
    ]


def test_colors_are_classified_for_the_top_objects_of_colour_clauses_only():
    image = torch.zeros(2, 3, 40, 40)
    image[:, 2, :, :] = 1.0  # blue everywhere
    image[0, :, 4:12, 4:12] = torch.tensor([1.0, 0, 0])[:, None, None]  # first dog box: red
    colors = MeanColor()
    detect = GenEvalDetector(FakeDetector([0.9, 0.8], [0.7]), colors)
    red_dog = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}
    plain = {"tag": "two_object", "include": [{"class": n, "count": 1} for n in ("dog", "cat")]}
    found = detect(image, [red_dog, plain])
    ((crops, names),) = colors.seen  # one batched call
    assert names == ["dog"] and crops[0].shape == (8, 8, 3)
    assert found[0]["dog"][0].color == "red" and found[0]["dog"][1].color is None
    assert all(d.color is None for dets in found[1].values() for d in dets)
    assert evaluate(red_dog, found[0])[0] and evaluate(plain, found[1])[0]


def test_query_vocabulary_is_geneval_classes_then_unseen_ones():
    meta = [{"include": [{"class": "circle", "count": 1}, {"class": "dog", "count": 1}]},
            {"include": [], "exclude": [{"class": "circle", "count": 1}]}]  # fmt: skip
    classes = query_classes(meta)
    assert classes[:80] == list(GENEVAL_CLASSES) and classes[80:] == ["circle"]
    assert len(GENEVAL_CLASSES) == len(set(GENEVAL_CLASSES)) == 80


def test_owlv2_raw_detections_have_pixel_boxes_and_batch_invariance(owl_dir):
    pixels = to_uint8(torch.rand((3, 3, 24, 40), generator=torch.Generator().manual_seed(1)))
    classes = ["dog", "cat", "bench"]
    one = load_owlv2(owl_dir, device="cpu", batch_size=1)(pixels, classes)
    three = load_owlv2(owl_dir, device="cpu", batch_size=3)(pixels, classes)
    assert len(one) == 3
    for (s1, l1, b1), (s3, _, b3) in zip(one, three, strict=True):
        assert s1.shape == l1.shape == b1.shape[:1] and b1.shape[1] == 4
        assert ((s1 >= 0) & (s1 <= 1)).all() and set(l1.tolist()) <= {0, 1, 2}
        assert (b1[:, [0, 2]] <= 40).all() and (b1[:, [1, 3]] <= 24).all() and (b1 >= 0).all()
        assert (b1[:, 2] >= b1[:, 0]).all() and (b1[:, 3] >= b1[:, 1]).all()
        np.testing.assert_allclose(s1, s3, atol=1e-5)
        np.testing.assert_allclose(b1, b3, atol=1e-3)


def test_registered_real_rewards_load_local_dirs_and_score_batches(
    clip_dir, owl_dir, project, images
):
    from pipeline.rewards import RewardMix

    paths = [f"score.clip_path={clip_dir}", f"score.color_clip_path={clip_dir}"]
    paths += [f"score.detector_path={owl_dir}", "score.reward_batch_size=2"]
    mix = "score.rewards={clipscore: 1.0, geneval_real: 1.0, geneval_real_strict: 1.0}"
    cfg = load_config(project / "params.yaml", [*paths, mix])
    rewards = RewardMix(cfg, cfg.score.rewards)
    metadata = [
        {"tag": "colors", "prompt": p, "include": [{"class": "dog", "count": 1, "color": "red"}]}
        for p in PROMPTS
    ]
    scores = rewards(images, metadata)
    assert {k: v.shape for k, v in scores.items()} == {
        k: (5,) for k in ("clipscore", "geneval_real", "geneval_real_strict", "mix")
    }
    partial, strict = scores["geneval_real"], scores["geneval_real_strict"]
    assert ((partial >= 0) & (partial <= 1)).all() and set(strict.tolist()) <= {0.0, 1.0}
    assert (strict <= partial).all()  # a correct image has partial score 1

    for key in ("clip_path", "detector_path", "color_clip_path"):
        reward = "clipscore" if key == "clip_path" else "geneval_real"
        bad = load_config(
            project / "params.yaml",
            [*paths, f"score.{key}=nowhere", f"score.rewards={{{reward}: 1}}"],
        )
        with pytest.raises(ConfigError, match=f"score.{key}: no model directory"):
            RewardMix(bad, bad.score.rewards)
