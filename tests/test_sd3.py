"""SD3 backend on tiny random components saved in SD3.5-M's diffusers layout."""

from __future__ import annotations

import shutil

import pytest
import torch

from pipeline import sampling
from pipeline.config import ConfigError, load_config
from pipeline.grpo import lora_parameters
from pipeline.sd3 import SD3Backend, save_lora_weights
from pipeline.sd3_tiny import (
    CLIP_MAX_LENGTH,
    RESOLUTION,
    SHIFT,
    T5_MAX_LENGTH,
    tiny_round_overrides,
    write_tiny_clip,
    write_tiny_sd3,
)

# The second prompt is longer than both tiny tokenizers' limits: truncation must match too.
PROMPTS = ["a red dog", "two blue cats sitting on a wooden bench"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3"))


def load(directory, **kwargs) -> SD3Backend:
    options = {"resolution": RESOLUTION, "max_sequence_length": T5_MAX_LENGTH} | kwargs
    return SD3Backend.from_pretrained(directory, **options)


@pytest.fixture(scope="module")
def backend(sd3_dir) -> SD3Backend:
    return load(sd3_dir)


@pytest.fixture(scope="module")
def pipe(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_prompt_embeddings_equal_the_pipelines_and_are_cached(backend, pipe):
    embeds = backend.encode_prompts(PROMPTS)
    hidden, _, pooled, _ = pipe.encode_prompt(
        PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=T5_MAX_LENGTH
    )
    assert embeds.hidden.shape == (2, CLIP_MAX_LENGTH + T5_MAX_LENGTH, 48)
    assert embeds.pooled.shape == (2, 16 + 24)
    assert embeds.hidden.dtype == embeds.pooled.dtype == torch.float32
    torch.testing.assert_close(embeds.hidden, hidden, rtol=0, atol=1e-6)
    torch.testing.assert_close(embeds.pooled, pooled, rtol=0, atol=1e-6)
    # CLIP-L (16) + CLIP-G (24) channels, zero-padded to T5's 48, on the CLIP tokens only.
    assert embeds.hidden[:, :CLIP_MAX_LENGTH, 40:].abs().max() == 0
    assert embeds.hidden[:, CLIP_MAX_LENGTH:, 40:].abs().max() > 0

    calls = []
    handle = backend.text_encoders[2].register_forward_hook(lambda *_: calls.append(1))
    try:
        again = backend.encode_prompts([PROMPTS[1], PROMPTS[0], PROMPTS[1]])
    finally:
        handle.remove()
    assert calls == []  # every prompt came from the cache
    torch.testing.assert_close(again.hidden[1], embeds.hidden[0], rtol=0, atol=0)


def test_ode_rollout_latents_equal_the_diffusers_pipeline(backend, pipe):
    steps, guidance = 4, 4.5
    x_T = torch.randn((2, *backend.latent_shape), generator=torch.Generator().manual_seed(0))
    embeds = backend.encode_prompts(PROMPTS)
    ours = sampling.sample(
        lambda x, sigma: backend.velocity(x, sigma, embeds, guidance=guidance),
        x_T,
        sampling.timesteps_sigmas(steps, shift=SHIFT),
        kind="ode",
        eta=0.0,
        window=sampling.sde_window(steps, kind="ode"),
    ).final
    reference = pipe(
        prompt=PROMPTS,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=x_T.clone(),
        height=RESOLUTION,
        width=RESOLUTION,
        max_sequence_length=T5_MAX_LENGTH,
        output_type="latent",
    ).images
    assert backend.latent_shape == (4, RESOLUTION // 2, RESOLUTION // 2)
    assert (ours - x_T).abs().max() > 0.5  # the network moved the latents
    assert (ours - reference).abs().max() <= 1e-4


def test_guided_velocity_is_one_batched_forward_of_both_branches(backend):
    x = torch.randn((2, *backend.latent_shape), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.9, 0.4])
    cond, uncond = backend.encode_prompts(PROMPTS), backend.encode_prompts([""])
    batches = []
    handle = backend.transformer.register_forward_hook(
        lambda module, args, kwargs, out: batches.append(kwargs["hidden_states"].shape[0]),
        with_kwargs=True,
    )
    try:
        guided = backend.velocity(x, sigma, cond, guidance=3.0)
    finally:
        handle.remove()
    v_cond = backend.velocity(x, sigma, cond, guidance=1.0)
    v_uncond = backend.velocity(x, sigma, uncond.expand(2), guidance=1.0)
    assert batches == [4]
    assert guided.dtype == torch.float32 and guided.shape == x.shape
    torch.testing.assert_close(guided, v_uncond + 3.0 * (v_cond - v_uncond), rtol=0, atol=1e-5)


def test_decode_maps_normalised_latents_through_the_vae(backend):
    x = torch.randn((3, *backend.latent_shape), generator=torch.Generator().manual_seed(2))
    images = backend.decode(x)
    vae = backend.vae
    z = x / vae.config.scaling_factor + vae.config.shift_factor
    with torch.no_grad():
        expected = ((vae.decode(z).sample + 1) / 2).clamp(0, 1)
    assert images.shape == (3, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.float32
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)


def test_bfloat16_weights_give_fp32_outputs_and_fp32_lora(sd3_dir, project):
    from pipeline.policy import Policy

    half = load(sd3_dir, dtype="bfloat16")
    full = load(sd3_dir)
    assert half.transformer.dtype == half.vae.dtype == torch.bfloat16
    assert all(enc.dtype == torch.bfloat16 for enc in half.text_encoders)
    x = torch.randn((2, *half.latent_shape), generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.7, 0.7])
    v_half = half.velocity(x, sigma, half.encode_prompts(PROMPTS), guidance=4.5)
    v_full = full.velocity(x, sigma, full.encode_prompts(PROMPTS), guidance=4.5)
    assert v_half.dtype == torch.float32 and half.decode(x).dtype == torch.float32
    assert (v_half - v_full).norm() / v_full.norm() < 0.05
    Policy.create(load_config(project / "params.yaml"), half)
    lora = lora_parameters(half.transformer)
    assert lora and all(p.dtype == torch.float32 for p in lora)


def test_missing_or_incomplete_directory_names_what_is_missing(sd3_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.path: no directory at"):
        load(tmp_path / "absent")
    broken = tmp_path / "broken"
    shutil.copytree(sd3_dir, broken)
    shutil.rmtree(broken / "text_encoder_3")
    for weights in (broken / "vae").glob("*.safetensors"):
        weights.unlink()
    (broken / "tokenizer_2" / "vocab.json").unlink()
    with pytest.raises(ConfigError) as error:
        load(broken)
    message = str(error.value)
    assert "text_encoder_3/ (T5-XXL text encoder)" in message
    assert "vae/ weights" in message
    assert "tokenizer_2/ vocabulary" in message
    assert "transformer" not in message and "text_encoder_2/" not in message


def test_load_backend_dispatches_sd3_and_checks_the_resolution(sd3_dir, project, caplog):
    from pipeline.policy import load_backend

    base = [f"model.path={sd3_dir}", "model.backend=sd3", "sampling.shift=3.0"]
    size = [f"model.max_sequence_length={T5_MAX_LENGTH}"]
    cfg = load_config(project / "params.yaml", [*base, *size, f"model.resolution={RESOLUTION}"])
    backend = load_backend(cfg)
    assert isinstance(backend, SD3Backend) and backend.scheduler_shift == SHIFT
    assert backend.latent_shape == (4, RESOLUTION // 2, RESOLUTION // 2)
    assert "shift" not in caplog.text
    load_backend(load_config(project / "params.yaml", [*base[:2], *size, "sampling.shift=1.0"]))
    assert "sampling.shift = 1.0 differs from the checkpoint scheduler's shift 3.0" in caplog.text
    with pytest.raises(ConfigError, match="model.resolution: 30 must be a multiple of 4"):
        load_backend(load_config(project / "params.yaml", [*base, "model.resolution=30"]))
    missing = load_config(project / "params.yaml", ["model.backend=sd3", "model.path=nowhere"])
    with pytest.raises(ConfigError, match="model.path: no directory"):
        load_backend(missing)


def test_one_grpo_round_trains_only_lora_and_saves_a_diffusers_lora(sd3_dir, project, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from pipeline.policy import Policy, load_backend
    from pipeline.rewards import RewardMix
    from pipeline.rounds import (
        CountingVelocity,
        Schedule,
        assign_credit,
        rollout_round,
        score_round,
        update_round,
    )

    cfg = load_config(
        project / "params.yaml",
        [
            *tiny_round_overrides(sd3_dir, write_tiny_clip(tmp_path / "clip")),
            "rollout.group_size=3",
            "update.minibatch_size=6",
        ],
    )
    backend = load_backend(cfg)
    policy = Policy.create(cfg, backend)
    base = {k: v.clone() for k, v in backend.transformer.state_dict().items() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in backend.transformer.named_parameters() if "lora_" in k}
    frozen = [m.state_dict() for m in (backend.vae, *backend.text_encoders)]
    frozen = [{k: v.clone() for k, v in sd.items()} for sd in frozen]

    prompts = [
        {"prompt": p, "tag": "single_object", "include": [{"class": "dog", "count": 1}]}
        for p in PROMPTS
    ]
    schedule = Schedule.from_config(cfg, "flow_grpo")
    counter = CountingVelocity(backend, schedule.guidance)
    common = {"seed": 0, "round_index": 0}
    rollout = rollout_round(
        backend, prompts, [0, 1], schedule, cfg, method="flow_grpo", run_id="t",
        model_version="base", counter=counter, **common,
    )  # fmt: skip
    metadata = [prompts[0]] * 3 + [prompts[1]] * 3
    scores = score_round(
        backend, rollout, metadata, RewardMix(cfg, cfg.score.rewards), cfg,
        estimators=(), schedule=schedule, counter=counter,
    )  # fmt: skip
    credit = assign_credit("flow_grpo", scores.table, rollout.group_ids, schedule, cfg)
    metrics = update_round(
        backend, policy.optimizer, rollout, credit.advantages, schedule, cfg, **common
    )

    assert rollout.images.shape == (6, 3, RESOLUTION, RESOLUTION)
    assert credit.advantages.abs().sum() > 0
    assert metrics["train/ratio_dev_first"] < 1e-4  # rollout and update log-probs agree
    after = backend.transformer.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    for before, module in zip(frozen, (backend.vae, *backend.text_encoders), strict=True):
        assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    lora_after = {k: v for k, v in backend.transformer.named_parameters() if "lora_" in k}
    assert any(not torch.equal(lora_after[k], v) for k, v in lora_before.items())

    # The trained adapter, saved in diffusers' format, reproduces the policy in the pipeline.
    saved = save_lora_weights(backend.transformer, tmp_path / "lora")
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    pipe.load_lora_weights(saved)
    x = rollout.states[:2, 1]
    sigma = rollout.sigmas[1].expand(2)
    embeds = backend.encode_prompts(PROMPTS)
    with torch.no_grad():
        trained = backend.velocity(x, sigma, embeds, guidance=1.0)
        loaded = pipe.transformer(
            hidden_states=x, encoder_hidden_states=embeds.hidden,
            pooled_projections=embeds.pooled, timestep=sigma * 1000, return_dict=False,
        )[0]  # fmt: skip
        backend.transformer.disable_adapters()
        untrained = backend.velocity(x, sigma, embeds, guidance=1.0)
        backend.transformer.enable_adapters()
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-5)
    assert (trained - untrained).abs().max() > 1e-5
