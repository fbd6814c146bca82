"""ShapesCLIP: tokenizer, loss math, batches, tiny training and save/load."""

import json

import numpy as np
import pytest
import torch

from pipeline import shapesclip as sc
from pipeline import world
from pipeline.geneval import TAGS, evaluate

TINY = {
    "text_kwargs": {"hidden": 16, "layers": 1, "heads": 2, "embed_dim": 8},
    "image_kwargs": {"width": 4, "hidden": 8, "color_factors": 3, "shape_factors": 2},
}


@pytest.fixture(scope="module")
def tokenizer():
    return sc.build_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip") / "shapesclip"
    metrics = sc.train_shapesclip(
        out, steps=3, batch_size=8, negatives=1, warmup=1, progress=False, **TINY
    )
    return out, metrics


def test_tokenizer_wraps_words_and_fits_every_prompt(tokenizer):
    ids = tokenizer("a photo of an orange Triangle")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert len(ids) == 8 and tokenizer.unk_token_id not in ids
    assert tokenizer("a photo of a hexagon")["input_ids"][-2] == tokenizer.unk_token_id
    prompts = [
        m["prompt"] for tag in TAGS for m in world.prompt_pool(tag, shapes=world.SHAPE_NAMES)
    ]
    assert not any(tokenizer.unk_token_id in ids for ids in tokenizer(prompts)["input_ids"])
    longest = max(prompts, key=lambda p: len(p.split()))
    assert len(tokenizer(longest)["input_ids"]) <= sc.MAX_TOKENS


def test_contrastive_loss_reduces_to_clip_loss_with_far_negatives():
    gen = torch.Generator().manual_seed(0)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=gen), dim=-1)  # noqa: E731
    text, images = unit(5, 8), unit(5, 8)
    very_far = -text[:, None, :]  # negatives with cosine -1 add ~nothing to the softmax at scale 50
    scale = torch.tensor(50.0)
    loss, accuracy = sc.contrastive_loss(text, images, very_far, torch.eye(5), scale)
    logits = scale * text @ images.T
    labels = torch.arange(5)
    clip = 0.5 * (
        torch.nn.functional.cross_entropy(logits, labels)
        + torch.nn.functional.cross_entropy(logits.T, labels)
    )
    assert loss.item() == pytest.approx(clip.item(), abs=1e-6)
    assert accuracy.item() == 1.0


def test_contrastive_loss_multi_positive_and_hard_negative_accuracy():
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # both renders look like caption 0
    negatives = torch.tensor([[[0.0, 1.0]], [[0.0, 1.0]]])  # (B=2, K=1, D=2)
    matches = torch.tensor([[1.0, 1.0], [0.0, 1.0]])  # render 1 satisfies both captions
    loss, accuracy = sc.contrastive_loss(text, images, negatives, matches, torch.tensor(1.0))
    # caption 0: logits (1, 1, 0), target (1/2, 1/2, 0); caption 1: logits (0, 0, 1), target
    # (0, 1, 0); render 0: logits (1, 0), target (1, 0); render 1: logits (1, 0), target (1/2, 1/2)
    t2i = ((np.log(2 * np.e + 1) - 1) + np.log(2 + np.e)) / 2
    i2t = (np.log(np.e + 1) - 1 + np.log(np.e + 1) - 0.5) / 2
    # own render vs own negative: caption 0 logits (1, 0), caption 1 logits (0, 1), target 0
    hard = (np.log(np.e + 1) - 1 + np.log(np.e + 1)) / 2
    assert loss.item() == pytest.approx(0.5 * (t2i + i2t) + hard, abs=1e-6)
    assert accuracy.item() == 0.5  # caption 0 beats its negative, caption 1 does not


def test_make_batch_shapes_and_matches():
    batch = sc.make_batch(np.random.default_rng(0), 12, 2)
    assert len(batch.prompts) == len(batch.metas) == 12
    assert batch.positives.shape == (12, 3, 32, 32)
    assert batch.negatives.shape == (12, 2, 3, 32, 32)
    assert batch.matches.shape == (12, 12) and torch.all(batch.matches.diagonal() == 1)
    assert set(batch.matches.unique().tolist()) <= {0.0, 1.0}
    assert batch.attributes["pairs"].shape == (36, 60)  # 6 shapes x 10 colors
    assert batch.attributes["counts"].shape == (36, 6)
    assert batch.attributes["relations"].shape == (36, 144)  # 6 x 6 shapes x 4 relations


def test_scene_attributes_by_hand():
    scene = [
        {"class": "circle", "color": "red", "box": (0, 0, 4, 4)},
        {"class": "circle", "color": "red", "box": (0, 20, 4, 24)},
        {"class": "square", "color": "blue", "box": (20, 0, 24, 4)},
    ]
    attrs = sc.scene_attributes([scene, []])
    pairs = attrs["pairs"].reshape(2, 6, 10)  # shape x color
    assert pairs[0].nonzero().tolist() == [[0, 0], [1, 4]]  # red circle, blue square
    assert attrs["counts"].tolist() == [[2, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    relations = attrs["relations"].reshape(2, 6, 6, 4)  # object class x target class x RELATIONS
    # both circles are left of the square; the lower one (offset (-20, 20)) is also below it
    assert relations[0, 0, 1].tolist() == [1, 0, 0, 1]
    # the square is right of both circles and above the lower one
    assert relations[0, 1, 0].tolist() == [0, 1, 1, 0]
    assert relations[0].sum() == 4 and attrs["relations"][1].sum() == 0
    assert attrs["pairs_mask"].min() == 1 and attrs["relations_mask"].min() == 1


def test_caption_attributes_state_only_what_the_caption_says():
    line = next(
        m
        for m in world.prompt_pool("position")
        if m["prompt"] == "a photo of a circle above a square"
    )
    colored = next(
        m
        for m in world.prompt_pool("color_attr")
        if m["prompt"] == "a photo of a red circle and a blue square"
    )
    attrs = sc.caption_attributes([line, colored])
    assert attrs["counts"].tolist() == [[1, 1, -100, -100, -100, -100]] * 2
    relations = attrs["relations"].reshape(2, 6, 6, 4)
    mask = attrs["relations_mask"].reshape(2, 6, 6, 4)
    assert relations[0, 0, 1].tolist() == [0, 0, 1, 0] and mask[0, 0, 1].tolist() == [0, 0, 1, 1]
    assert relations[0, 1, 0].tolist() == [0, 0, 0, 1] and mask[0, 1, 0].tolist() == [0, 0, 1, 1]
    assert mask[0].sum() == 4 and mask[1].sum() == 0
    pairs = attrs["pairs"].reshape(2, 6, 10)
    pairs_mask = attrs["pairs_mask"].reshape(2, 6, 10)
    assert pairs[1].nonzero().tolist() == [[0, 0], [1, 4]]
    assert pairs_mask[1].sum(dim=1).tolist() == [10, 10, 0, 0, 0, 0] and pairs_mask[0].sum() == 0


def test_attribute_loss_by_hand():
    scene = [{"class": "triangle", "color": "green", "box": (0, 0, 4, 4)}]
    targets = sc.scene_attributes([scene])
    counts = torch.full((1, 6, world.MAX_OBJECTS + 1), -20.0)
    counts[0, torch.arange(6), targets["counts"][0]] = 20.0
    right = torch.cat(
        [(targets["pairs"] * 2 - 1) * 20, counts.flatten(1), (targets["relations"] * 2 - 1) * 20],
        dim=1,
    )
    assert right.shape == (1, sc.attribute_size()) == (1, 60 + 36 + 144)
    assert sc.attribute_loss(right, targets).item() < 1e-6
    # all-zero logits: BCE log 2 on pairs and relations, CE log 6 on counts
    zero = sc.attribute_loss(torch.zeros_like(right), targets).item()
    assert zero == pytest.approx(2 * np.log(2) + np.log(6), abs=1e-5)
    # a caption that states nothing about relations: they do not count
    line = world.prompt_pool("colors")[0]
    stated = sc.caption_attributes([line])
    assert sc.attribute_loss(torch.zeros_like(right), stated).item() == pytest.approx(
        2 * np.log(2) + np.log(6) - np.log(2), abs=1e-5
    )


def test_scene_detections_find_the_named_color_among_many():
    objects = [
        {"class": "circle", "color": "blue", "box": (0, 0, 4, 4)},
        {"class": "circle", "color": "red", "box": (10, 0, 14, 4)},
    ]
    red = {"include": [{"class": "circle", "count": 1, "color": "red"}]}
    assert evaluate(red, sc._scene_detections(objects, red))[0]
    green = {"include": [{"class": "circle", "count": 1, "color": "green"}]}
    assert not evaluate(green, sc._scene_detections(objects, green))[0]


def test_tiny_training_writes_a_loadable_model(tiny_dir):
    out, metrics = tiny_dir
    assert np.isfinite(metrics["loss"]) and 0.0 <= metrics["hard_negative_accuracy"] <= 1.0
    assert json.loads((out / "train_metrics.json").read_text()) == metrics
    assert not out.with_name(out.name + ".tmp").exists()
    model = sc.load_shapesclip(out)
    assert not model.training
    assert model.text_model.config.hidden_size == 16
    assert model.image_encoder.config == {
        "width": 4,
        "hidden": 8,
        "embed_dim": 8,
        "color_factors": 3,
        "shape_factors": 2,
    }


def test_save_load_round_trip_scores_identical(tiny_dir, tmp_path):
    model = sc.load_shapesclip(tiny_dir[0])
    metas = world.sample_metadata(np.random.default_rng(0), 6)
    images = world.render_batch(metas, np.random.default_rng(1))
    prompts = [m["prompt"] for m in metas]
    with torch.no_grad():
        before = model.score(images, prompts)
        model.save(tmp_path / "copy")
        after = sc.load_shapesclip(tmp_path / "copy").score(images, prompts)
    assert torch.equal(before, after)


def test_score_shape_range_and_chunking(tiny_dir):
    model = sc.load_shapesclip(tiny_dir[0])
    metas = world.sample_metadata(np.random.default_rng(2), 7)
    images = world.render_batch(metas, np.random.default_rng(3))
    prompts = [m["prompt"] for m in metas]
    with torch.no_grad():
        scores = model.score(images, prompts)
        chunked = model.score(images, prompts, chunk=3)
    assert scores.shape == (7,) and scores.dtype == torch.float32
    assert torch.all(scores.abs() <= model.scale + 1e-4)
    assert torch.allclose(scores, chunked, atol=1e-5)
    with pytest.raises(ValueError, match="7 images but 6 prompts"):
        model.score(images, prompts[:6])


def test_training_is_deterministic(tiny_dir, tmp_path):
    again = sc.train_shapesclip(
        tmp_path / "again", steps=3, batch_size=8, negatives=1, warmup=1, progress=False, **TINY
    )
    assert again["loss"] == tiny_dir[1]["loss"]


def test_image_encoder_sees_position():
    """Coordinate channels: a shape moved across the canvas changes the embedding even though
    the pooled conv features alone would be translation invariant."""
    torch.manual_seed(0)
    encoder = sc.ImageEncoder(width=4, hidden=8, embed_dim=8, color_factors=3, shape_factors=2)
    image = torch.full((1, 3, 32, 32), 0.5)
    left, right = image.clone(), image.clone()
    left[..., 10:16, 4:10] = 1.0
    right[..., 10:16, 20:26] = 1.0
    with torch.no_grad():
        assert not torch.allclose(encoder(left), encoder(right), atol=1e-4)
        assert encoder(torch.cat([left, right])).shape == (2, 8)


def test_first_negative_is_of_the_tags_focus_kind():
    rng = np.random.default_rng(0)
    for tag in TAGS:
        assert set(sc.FOCUS_KINDS[tag]) <= set(world.CORRUPTIONS[tag])
        drawn = [sc._negative_kinds(tag, 3, rng) for _ in range(50)]
        assert all(kinds[0] in sc.FOCUS_KINDS[tag] for kinds in drawn)
        assert {k for kinds in drawn for k in kinds[1:]} == set(world.CORRUPTIONS[tag])


def test_text_negative_loss_by_hand():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    wrong = torch.tensor([[0.0, 1.0]])  # a wrong caption for render 0 only
    loss = sc.text_negative_loss(images, text, wrong, torch.tensor([0]), torch.tensor(1.0))
    assert loss.item() == pytest.approx(np.log(np.e + 1) - 1, abs=1e-6)  # logits (1, 0)
    none = sc.text_negative_loss(
        images, text, wrong[:0], torch.tensor([], dtype=torch.long), torch.tensor(1.0)
    )
    assert none.item() == 0.0


def test_batch_text_negatives_are_wrong_captions_of_the_same_template():
    batch = sc.make_batch(np.random.default_rng(1), 24, 1)
    assert batch.text_negatives
    for i, wrong in batch.text_negatives:
        meta = batch.metas[i]
        assert meta["tag"] in sc.TEXT_NEGATIVE_KINDS
        assert wrong != meta["prompt"] and len(wrong.split()) == len(meta["prompt"].split())
    tagged = {i for i, _ in batch.text_negatives}
    assert tagged == {i for i, m in enumerate(batch.metas) if m["tag"] in sc.TEXT_NEGATIVE_KINDS}


def test_base_and_shapesclip_stages_train_on_the_configured_world(project, monkeypatch):
    import stages.base
    from pipeline.config import load_config
    from stages.base import base
    from stages.shapesclip import METRICS_FILE, shapesclip

    seen = {}

    def fake_pretrain(out_dir, *, prompts, **kwargs):
        out_dir.mkdir(parents=True)
        seen["flow"] = prompts
        return {"flow_loss": [1.0, 0.5], "seconds": {"flow": 1.0}, "num_parameters": {"x": 1}}

    def fake_clip(out_dir, *, pool, steps, seed, **kwargs):
        seen["clip"] = pool
        seen["clip_args"] = steps, seed
        return {"hard_negative_accuracy": 0.5, "seconds": 2.0}

    monkeypatch.setattr(stages.base, "pretrain_base", fake_pretrain)
    monkeypatch.setattr(sc, "train_shapesclip", fake_clip)
    overrides = ["world.shapes=[circle, square]", "shapesclip.steps=7", "shapesclip.seed=3"]
    cfg = load_config(project / "params.yaml", overrides)
    base.fn(cfg)
    assert "clip" not in seen  # the base stage trains the policy alone
    metrics = shapesclip.fn(cfg)
    assert seen["clip"] == seen["flow"]
    shapes = {c["class"] for m in seen["clip"] for c in m["include"]}
    assert shapes == {"circle", "square"}
    assert seen["clip_args"] == (7, 3)
    written = json.loads((project / "reports" / "base" / METRICS_FILE).read_text())
    assert written == metrics == {"hard_negative_accuracy": 0.5, "seconds": 2.0}
