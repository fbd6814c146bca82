"""The embedded ShapesWorld backend and its pretraining: interface contracts and invariants."""

import json

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel, UNet2DConditionModel

from pipeline.config import BaseParams
from pipeline.models import (
    BACKEND_FILE,
    LORA_TARGET_MODULES,
    PromptEmbeds,
    ShapesBackend,
    ShapesConfig,
    build_tokenizer,
    build_unet,
    vocabulary,
)
from pipeline.pretrain import (
    EMA,
    HISTORY_FILE,
    _batches,
    flow_matching_loss,
    logit_normal_t,
    pretrain_base,
)
from pipeline.schedules import lr_factor
from pipeline.world import canonical_key, make_prompts, sample_metadata

PROMPTS = [
    "a photo of a red circle",
    "a photo of three squares",
    "a photo of a triangle left of a circle",
]
TINY = dict(
    image_size=16,
    ae_channels=(8, 8),
    num_layers=2,  # the last MMDiT block has no to_add_out; two blocks carry every target
    num_heads=2,
    head_dim=8,
    text_dim=16,
    text_layers=1,
    text_heads=2,
    max_length=12,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster on a loaded machine (no spinning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_backend(latent_channels: int = 4, seed: int = 0, denoiser: str = "mmdit") -> ShapesBackend:
    config = ShapesConfig(
        latent_channels=latent_channels,
        patch_size=2 if latent_channels else 4,
        vocab=vocabulary(PROMPTS),
        denoiser=denoiser,
        unet_channels=(16, 32),
        **TINY,
    )
    return ShapesBackend.from_config(config, seed=seed).eval()


def perturb_(module: torch.nn.Module, seed: int = 1) -> None:
    """Random weights everywhere: SD3's AdaLN-zero init makes a fresh transformer output 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def pretrain(
    out_dir, *, prompts, image_size, progress=False, resume_from=None, snapshot_every=0,
    snapshot_dir=None, **settings,
):  # fmt: skip
    """`pretrain_base` with its `base` settings given as keywords (no refine cycle unless asked)."""
    return pretrain_base(
        out_dir, prompts=prompts, params=BaseParams(**{"refine_steps": 0, **settings}),
        image_size=image_size, progress=progress, resume_from=resume_from,
        snapshot_every=snapshot_every, snapshot_dir=snapshot_dir,
    )  # fmt: skip


def test_tokenizer_ids_padding_and_unknown_words():
    tok = build_tokenizer(["a", "circle", "red"], max_length=6)
    ids = tok(["A red CIRCLE", "a blue circle"], padding="max_length", max_length=6).input_ids
    # [PAD]=0, [UNK]=1, [BOS]=2, [EOS]=3, then the vocabulary in order: a=4, circle=5, red=6.
    assert ids == [[2, 4, 6, 5, 3, 0], [2, 4, 1, 5, 3, 0]]


@pytest.mark.parametrize("denoiser", ["mmdit", "unet"])
def test_latent_shape_and_lora_targets_exist_in_the_denoiser(denoiser):
    backend = tiny_backend(denoiser=denoiser)
    assert backend.latent_shape == (4, 8, 8)
    assert tiny_backend(latent_channels=0, denoiser=denoiser).latent_shape == (3, 16, 16)
    names = {n for n, _ in backend.transformer.named_modules()}
    for target in backend.lora_target_modules:
        assert any(n.endswith(target) for n in names), target
    assert (backend.lora_target_modules == LORA_TARGET_MODULES) == (denoiser == "mmdit")


def test_pooled_is_projected_eos_state():
    backend = tiny_backend()
    ids = backend.tokenize(PROMPTS)
    embeds = backend.encode_prompts(PROMPTS)
    eos = (ids == backend.tokenizer.eos_token_id).int().argmax(dim=1)  # (B,)
    hidden_at_eos = embeds.hidden[torch.arange(len(PROMPTS)), eos]  # (B, D)
    with torch.no_grad():
        expected = backend.text_encoder.text_projection(hidden_at_eos)
    torch.testing.assert_close(embeds.pooled, expected)


def test_encode_prompts_caches_and_keeps_order():
    backend = tiny_backend()
    calls = []
    backend.text_encoder.register_forward_hook(lambda *args: calls.append(1))
    first = backend.encode_prompts(PROMPTS)
    again = backend.encode_prompts([PROMPTS[2], PROMPTS[0], PROMPTS[2]])
    assert len(calls) == 3  # one encode per distinct prompt, none for the cached ones
    torch.testing.assert_close(again.hidden, first.hidden[[2, 0, 2]], rtol=0, atol=0)
    assert first.hidden.dtype == first.pooled.dtype == torch.float32
    assert first.hidden.shape == (3, 12, 16) and first.pooled.shape == (3, 16)
    backend.encode_prompts([""])
    assert len(calls) == 4


def test_prompt_embeds_rows():
    embeds = PromptEmbeds(torch.arange(6.0).view(3, 2, 1), torch.arange(3.0).view(3, 1))
    assert len(embeds[1]) == 1 and embeds[1].pooled.item() == 1.0
    assert embeds.repeat_interleave(2).pooled.flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert embeds[torch.tensor([2, 0])].pooled.flatten().tolist() == [2, 0]
    assert len(embeds[:1].expand(4)) == 4
    with pytest.raises(ValueError, match="single row"):
        embeds.expand(4)


def test_velocity_shape_dtype_and_scalar_sigma():
    backend = tiny_backend()
    x = torch.randn(3, *backend.latent_shape)
    v = backend.velocity(x, torch.full((3,), 0.5), backend.encode_prompts(PROMPTS), guidance=4.5)
    assert v.shape == x.shape and v.dtype == torch.float32
    v_scalar = backend.velocity(x, 0.5, backend.encode_prompts(PROMPTS), guidance=4.5)
    torch.testing.assert_close(v, v_scalar)


def test_guidance_combines_cond_and_uncond_branches():
    backend = tiny_backend()
    perturb_(backend.transformer)
    x, sigma = torch.randn(3, *backend.latent_shape), torch.tensor([0.9, 0.5, 0.1])
    cond, uncond = backend.encode_prompts(PROMPTS), backend.encode_prompts([""] * 3)
    with torch.no_grad():
        v_cond = backend.velocity(x, sigma, cond, guidance=1.0)
        v_uncond = backend.velocity(x, sigma, uncond, guidance=1.0)
        v_guided = backend.velocity(x, sigma, cond, guidance=4.5)
        v_one = backend.velocity(x, sigma, cond, guidance=1.0, uncond=uncond)
    assert not torch.allclose(v_cond, v_uncond)
    torch.testing.assert_close(v_one, v_cond, rtol=0, atol=0)
    torch.testing.assert_close(v_guided, v_uncond + 4.5 * (v_cond - v_uncond), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("denoiser", ["mmdit", "unet"])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, denoiser):
    backend = tiny_backend(denoiser=denoiser)
    perturb_(backend.transformer)
    backend.save_pretrained(tmp_path)
    loaded = ShapesBackend.from_pretrained(tmp_path)
    x, sigma = torch.randn(2, *backend.latent_shape), torch.tensor([0.7, 0.2])

    def outputs(b: ShapesBackend) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            v = b.velocity(x, sigma, b.encode_prompts(PROMPTS[:2]), guidance=3.0)
            return v, b.decode(x)

    for got, want in zip(outputs(loaded), outputs(backend), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert loaded.config == backend.config
    assert type(loaded.transformer) is type(backend.transformer)


def test_unet_widths_that_its_group_norms_cannot_split_are_one_clear_error():
    with pytest.raises(ValueError, match="multiples of 16"):
        build_unet(ShapesConfig(vocab=["a"], denoiser="unet", unet_channels=(16, 24)))


def test_a_model_saved_before_the_denoiser_choice_loads_as_the_mmdit(tmp_path):
    tiny_backend().save_pretrained(tmp_path)
    fields = json.loads((tmp_path / BACKEND_FILE).read_text())
    del fields["denoiser"], fields["unet_channels"]
    (tmp_path / BACKEND_FILE).write_text(json.dumps(fields))
    loaded = ShapesBackend.from_pretrained(tmp_path)
    assert loaded.config.denoiser == "mmdit" and isinstance(
        loaded.transformer, SD3Transformer2DModel
    )


def test_decode_range_and_pixel_space_inverse():
    pixel = tiny_backend(latent_channels=0)
    images = torch.rand(2, 3, 16, 16)
    torch.testing.assert_close(pixel.decode(pixel.encode(images)), images)
    latent = tiny_backend()
    with torch.no_grad():
        decoded = latent.decode(3 * torch.randn(2, *latent.latent_shape))
    assert decoded.shape == (2, 3, 16, 16) and 0 <= decoded.min() and decoded.max() <= 1


def test_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    backend = tiny_backend(latent_channels=0)
    backend.transformer.train()
    params = [*backend.transformer.parameters(), *backend.text_encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.rand(3, *backend.latent_shape, generator=gen) * 2 - 1
    noise = torch.randn(x0.shape, generator=gen)
    t = logit_normal_t(3, 0.0, 1.0, gen)
    ids = backend.tokenize(PROMPTS)
    losses = []
    for _ in range(30):
        loss = flow_matching_loss(backend, x0, ids, t, noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.75 * losses[0]


def test_lr_schedule_and_logit_normal_t():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(5000, 10) == 1.0  # constant after warmup without a total
    assert lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100) == pytest.approx(0.55)  # cosine half way: (1 + 0.1) / 2
    assert lr_factor(100, 10, 100) == pytest.approx(0.1)  # cosine floor
    t = logit_normal_t(20000, 0.5, 1.0, torch.Generator().manual_seed(0))
    assert 0 < t.min() and t.max() < 1
    assert t.median().item() == pytest.approx(torch.sigmoid(torch.tensor(0.5)).item(), abs=0.01)


def test_ema_tracks_parameters_with_warmup():
    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(0.0)
    ema = EMA([layer], decay=0.9)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ema.update()  # decay min(0.9, 2/11)
    ema.copy_to_model()
    assert layer.weight.item() == pytest.approx(1 - 2 / 11)


def assert_same_weights(dir_a, dir_b):
    a, b = ShapesBackend.from_pretrained(dir_a), ShapesBackend.from_pretrained(dir_b)
    for module_a, module_b in zip(a.modules.values(), b.modules.values(), strict=True):
        for pa, pb in zip(module_a.parameters(), module_b.parameters(), strict=True):
            assert torch.equal(pa, pb)
    return a


def test_pretrain_is_deterministic_and_snapshots_equal_shorter_runs(tmp_path):
    train, _ = make_prompts(24, 6, seed=0)
    kwargs = dict(
        prompts=train,
        batch_size=4,
        warmup=2,
        ae_steps=3,
        ae_batch_size=4,
        seed=3,
        progress=False,
        lr_decay="constant",  # so that a shorter run is a prefix of a longer one
        # The world needs 32 px to place four objects; three AE levels keep the latent at 8x8.
        **{**TINY, "image_size": 32, "ae_channels": (8, 8, 8)},
    )
    first = pretrain(
        tmp_path / "a", steps=4, snapshot_every=2, snapshot_dir=tmp_path / "snap", **kwargs
    )
    second = pretrain(tmp_path / "b", steps=4, **kwargs)
    short = pretrain(tmp_path / "c", steps=2, **kwargs)
    assert first["flow_loss"] == second["flow_loss"] and len(first["flow_loss"]) == 4
    assert first["ae_loss"] == second["ae_loss"] and all(np.isfinite(first["flow_loss"]))
    assert short["flow_loss"] == first["flow_loss"][:2]
    model = assert_same_weights(tmp_path / "a", tmp_path / "b")
    assert_same_weights(tmp_path / "c", tmp_path / "snap" / "step-000002")
    # The vocabulary covers the whole world, held-out prompts included.
    assert "triangle" in model.config.vocab and "four" in model.config.vocab


def test_pretrain_trains_and_saves_the_unet_denoiser(tmp_path):
    train, _ = make_prompts(24, 6, seed=0)
    history = pretrain(
        tmp_path, prompts=train, steps=2, batch_size=4, warmup=1, ae_steps=1, ae_batch_size=4,
        denoiser="unet", unet_channels=(16, 32),
        **{**TINY, "image_size": 32, "ae_channels": (8, 8, 8)},
    )  # fmt: skip
    model = ShapesBackend.from_pretrained(tmp_path)
    assert isinstance(model.transformer, UNet2DConditionModel) and model.config.denoiser == "unet"
    assert history["params"]["unet_channels"] == [16, 32] and all(np.isfinite(history["flow_loss"]))


def test_refine_resumed_from_a_first_cycle_equals_a_run_from_scratch(tmp_path):
    train, _ = make_prompts(24, 6, seed=0)
    kwargs = dict(
        prompts=train, steps=3, batch_size=4, warmup=1, ae_steps=2, ae_batch_size=4, seed=5,
        progress=False, denoiser="mmdit", **{**TINY, "image_size": 32, "ae_channels": (8, 8, 8)},
    )  # fmt: skip
    refine = dict(
        refine_steps=3, refine_lr=5e-4, refine_warmup=1,
        refine_tag_weights={"counting": 1.0, "position": 2.0},
    )  # fmt: skip
    scratch = pretrain(tmp_path / "scratch", **kwargs, **refine)
    assert scratch["params"]["refine_tag_weights"] == {"counting": 1.0, "position": 2.0}
    pretrain(tmp_path / "first", **kwargs)
    history = json.loads((tmp_path / "first" / HISTORY_FILE).read_text())
    # unset tag weights are not recorded: bases made before the setting keep their files
    assert "refine_tag_weights" not in history["params"]
    # a first cycle saved before the denoiser choice existed is the MMDiT's, whatever the default
    del history["params"]["denoiser"], history["params"]["unet_channels"]
    (tmp_path / "first" / HISTORY_FILE).write_text(json.dumps(history))
    resumed = pretrain(tmp_path / "resumed", resume_from=tmp_path / "first", **kwargs, **refine)
    assert resumed["flow_loss"] == scratch["flow_loss"] and len(scratch["flow_loss"]) == 6
    assert set(resumed["seconds"]) == {"autoencoder", "flow", "refine"}
    # the history names no output directory: the same weights give the same files wherever a
    # stage wrote them first (its temporary directory), so a rerun leaves DVC's hash alone
    assert "out_dir" not in resumed["params"] and resumed["params"] == scratch["params"]
    assert_same_weights(tmp_path / "scratch", tmp_path / "resumed")
    # the refine cycle moved the weights away from the first cycle's
    first = ShapesBackend.from_pretrained(tmp_path / "first").transformer.parameters()
    assert any(
        not torch.equal(a, b)
        for a, b in zip(first, resumed and ShapesBackend.from_pretrained(
            tmp_path / "resumed").transformer.parameters(), strict=True)
    )  # fmt: skip
    # a first cycle made with other arguments (or other scenes) is refused, naming the difference
    with pytest.raises(ValueError, match="seed"):
        pretrain(tmp_path / "x", resume_from=tmp_path / "first", **{**kwargs, "seed": 6})
    with pytest.raises(ValueError, match="denoiser"):
        pretrain(tmp_path / "u", resume_from=tmp_path / "first", **{**kwargs, "denoiser": "unet"})
    with pytest.raises(ValueError, match="prompts_sha256"):
        pretrain(
            tmp_path / "y", resume_from=tmp_path / "first", **{**kwargs, "prompts": train[:-1]}
        )
    with pytest.raises(ValueError, match="refine cycle"):
        pretrain(tmp_path / "z", resume_from=tmp_path / "scratch", **kwargs, **refine)


def test_refine_tag_weights_draw_each_tag_in_proportion():
    train, _ = make_prompts(120, 6, seed=0)
    rng = np.random.default_rng(3)
    draw = _batches(train, 2000, rng, {"position": 3.0, "two_object": 1.0, "colors": 0.0})
    tags = [meta["tag"] for meta in draw()]
    assert set(tags) == {"position", "two_object"}
    assert abs(tags.count("position") / len(tags) - 0.75) < 0.03  # 4.4 binomial std
    # the drawn lines are the pool's scenes, in any wording and object order
    scenes = {canonical_key(meta) for meta in train}
    assert all(canonical_key(meta) in scenes for meta in draw())
    # no weights: the tag-balanced draw of the first cycle, batch for batch
    balanced = _batches(train, 8, np.random.default_rng(4), {})
    assert balanced() == sample_metadata(np.random.default_rng(4), 8, pool=train)
    with pytest.raises(ValueError, match="no pretraining scene: counting"):
        _batches([m for m in train if m["tag"] != "counting"], 8, rng, {"counting": 1.0})


def test_a_prompts_embedding_does_not_depend_on_what_it_was_encoded_with():
    """Resume exactness: a run resumed at round r has other prompts in the embedding cache than
    the uninterrupted run had, so each prompt's embedding must be the same bits in any batch."""
    alone, crowded = tiny_backend(), tiny_backend()
    perturb_(alone.text_encoder), perturb_(crowded.text_encoder)
    others = [f"{prompt} {word}" for prompt in PROMPTS for word in ("red", "three", "left", "of")]
    target = PROMPTS[1]
    first = alone.encode_prompts([target])
    second = crowded.encode_prompts([*others, target, *others[::-1]])[len(others)]
    assert torch.equal(first.hidden[0], second.hidden[0])
    assert torch.equal(first.pooled[0], second.pooled[0])
