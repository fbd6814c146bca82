"""Pretraining of the embedded ShapesWorld base policy (``pipeline.models.ShapesBackend``).

Two phases, both on ShapesWorld renders drawn on the fly from random training metadata:

1. autoencoder (skipped in pixel space): a tiny ``AutoencoderKL`` learns to reconstruct renders
   with an L1 + MSE loss in which object pixels weigh ``ae_object_weight`` times the background
   (flat colour areas are small at 32x32; unweighted losses learn the background first and wash
   object colours out), plus a small KL term (SD's VAE recipe, Rombach et al. 2022, sec. 3);
   then its scale/shift are set so that the flow's x0 has zero mean and unit std.
2. flow: rectified flow (Liu et al. 2022; SD3, Esser et al. 2024, eq. 1-3 and sec. 3.1):
   x_t = (1 - t) x0 + t eps, target v = eps - x0, loss ||v_theta(x_t, t, c) - v||^2 (mean over
   elements), t ~ logit-normal(t_mean, t_std) (SD3 eq. 19; shifting sigma by s adds ln s to its
   logit, so t_mean = ln 3 trains on the sigmas a shift-3 sampler visits: with t_mean = 0 the
   first steps above sigma 0.9 are rarely trained and samples stall at the mean image, a faint
   canvas-sized ghost), captions dropped to "" with
   probability ``caption_dropout`` for classifier-free guidance (Ho & Salimans 2022). The text
   encoder trains jointly with the denoiser; AdamW with a linear warmup, then a cosine decay to
   a tenth of the peak (``lr_decay="cosine"``) or a constant lr (``"constant"``: a run of n steps
   is then a prefix of any longer run, so snapshots stand in for shorter runs); the saved weights
   are an exponential moving average of the training weights.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pipeline.config import BaseParams, Config
from pipeline.io import atomic_path
from pipeline.layout import load_prompts
from pipeline.models import ShapesBackend, ShapesConfig, vocabulary
from pipeline.schedules import lr_factor

RenderBatch = Callable[[list[dict], np.random.Generator, int], torch.Tensor]
HISTORY_FILE = "pretrain_history.json"


def logit_normal_t(batch_size: int, mean: float, std: float, generator: torch.Generator):
    """t = sigmoid(u), u ~ N(mean, std^2) (SD3 eq. 19): (B,) fp32 in (0, 1)."""
    u = torch.randn(batch_size, generator=generator) * std + mean
    return torch.sigmoid(u)


def flow_matching_loss(
    backend: ShapesBackend,
    x0: torch.Tensor,
    input_ids: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Rectified-flow loss mean((v_theta(x_t, t, c) - (eps - x0))^2), differentiable in the
    denoiser and the text encoder.

    x0, noise: (B, C, H, W) fp32; input_ids: (B, L) token ids; t: (B,) in (0, 1).
    """
    t_ = t.view(-1, 1, 1, 1)
    x_t = (1.0 - t_) * x0 + t_ * noise
    embeds = backend.embed_tokens(input_ids)
    v = backend._forward(x_t, t, embeds)
    return (v - (noise - x0)).pow(2).mean()


def autoencoder_loss(
    backend: ShapesBackend, images: torch.Tensor, *, object_weight: float, kl_weight: float
) -> torch.Tensor:
    """Weighted L1 + MSE reconstruction + kl_weight * KL for a batch of renders (B, 3, H, W).

    Object pixels (those differing from the image's corner colour, the background) weigh
    ``object_weight``, background pixels 1; the weights are normalised to mean 1 per image.
    """
    vae = backend.autoencoder
    pixels = 2.0 * images - 1.0
    posterior = vae.encode(pixels).latent_dist
    recon = vae.decode(posterior.sample()).sample
    background = pixels[:, :, :1, :1]  # (B, 3, 1, 1) corner colour
    is_object = ((pixels - background).abs().amax(dim=1, keepdim=True) > 0.05).float()
    weight = 1.0 + (object_weight - 1.0) * is_object  # (B, 1, H, W)
    weight = weight / weight.mean(dim=(2, 3), keepdim=True)
    err = recon - pixels
    recon_loss = (weight * (err.abs() + err.pow(2))).mean()
    return recon_loss + kl_weight * posterior.kl().mean()


class EMA:
    """Exponential moving average of parameters, decay min(decay, (1 + n) / (10 + n)) at update n
    (the warmup keeps early averages from being dominated by the random init)."""

    def __init__(self, modules: list[torch.nn.Module], decay: float):
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - decay)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.shadow)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model inside the block, the training weights after it."""
        training = [p.detach().clone() for p in self.params]
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, training)


def _default_render() -> RenderBatch:
    from pipeline.world import render_batch

    return render_batch


def _world_prompts() -> list[str]:
    """Every prompt of the default world, so that the vocabulary covers held-out prompts."""
    from pipeline.world import world_prompts

    return world_prompts()


def _batches(
    prompts: list[dict],
    batch_size: int,
    rng: np.random.Generator,
    tag_weights: Mapping[str, float] | None = None,
) -> Callable[[], list[dict]]:
    """Metadata batches drawn tag-balanced from ``prompts``, either object order (the world's
    ``sample_metadata``): the train split is mostly color_attr lines, a uniform draw over lines
    would starve single_object and counting.

    With ``tag_weights`` (tag -> weight, a tag left out weighs 0) each sample's tag is drawn in
    proportion to its weight instead, the tags in alphabetical order (the order of session 30's
    measured curriculum, so that these settings rebuild its base), then a line of that tag
    uniformly in a random wording. ValueError if a weighted tag has no line in ``prompts``.
    """
    from pipeline.world import random_variant, sample_metadata

    if not tag_weights:
        return lambda: sample_metadata(rng, batch_size, pool=prompts)
    by_tag: dict[str, list[dict]] = {}
    for meta in prompts:
        by_tag.setdefault(meta["tag"], []).append(meta)
    if missing := sorted(t for t, w in tag_weights.items() if w > 0 and t not in by_tag):
        raise ValueError(f"tag weights name tags with no pretraining scene: {', '.join(missing)}")
    tags = sorted(by_tag)
    shares = np.array([tag_weights.get(tag, 0.0) for tag in tags], dtype=float)
    shares /= shares.sum()

    def draw() -> list[dict]:
        out = []
        for _ in range(batch_size):
            lines = by_tag[tags[rng.choice(len(tags), p=shares)]]
            out.append(random_variant(lines[rng.integers(len(lines))], rng))
        return out

    return draw


def train_autoencoder(
    backend: ShapesBackend,
    draw_metas: Callable[[], list[dict]],
    render: Callable[[list[dict]], torch.Tensor],
    *,
    steps: int,
    lr: float,
    object_weight: float,
    kl_weight: float,
    progress: bool,
) -> list[float]:
    """Phase 1: train the autoencoder, then fit its scale/shift to unit-variance latents.

    Returns the loss per step.
    """
    vae = backend.autoencoder
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    bar = tqdm(range(steps), desc="autoencoder", disable=not progress, mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, max(steps // 20, 1), steps)
        loss = autoencoder_loss(
            backend, render(draw_metas()), object_weight=object_weight, kl_weight=kl_weight
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    vae.eval()
    vae.requires_grad_(False)
    with torch.no_grad():
        z = torch.cat(
            [vae.encode(2 * render(draw_metas()) - 1).latent_dist.mode() for _ in range(4)]
        )
    # SD3's convention: x0 = (z - shift) * scale.
    vae.register_to_config(shift_factor=z.mean().item(), scaling_factor=1.0 / z.std().item())
    return losses


def pretrain_base(
    out_dir: str | Path,
    *,
    prompts: list[dict],
    params: BaseParams,
    image_size: int = 32,
    snapshot_every: int = 0,
    snapshot_dir: str | Path | None = None,
    progress: bool = True,
    render_batch: RenderBatch | None = None,
    resume_from: str | Path | None = None,
) -> dict:
    """Train the embedded base policy on ``prompts`` (training metadata) and save it to out_dir.

    ``params`` are the `base` section's settings (``pipeline.config.BaseParams``; its `pool` is
    not read here). Images are rendered on the fly by
    ``render_batch(metas, rng, image_size)`` (default ``pipeline.world.render_batch``) from
    metadata drawn tag-balanced from ``prompts``.
    Flow phase: ``steps`` AdamW steps of ``batch_size``, lr warmed up linearly over ``warmup``
    steps then ``lr_decay`` ("cosine" or "constant"), EMA of the weights with ``ema_decay``;
    logit-normal t (t_mean, t_std).
    Refine cycle (``refine_steps`` > 0): a second flow cycle that restarts from the first one's
    EMA weights with a fresh optimizer and EMA, a ``refine_warmup`` warmup to ``refine_lr`` and a
    cosine decay over ``refine_steps`` (a warm restart, Loshchilov & Hutter 2017), drawing its
    batches (tag-balanced, or by ``refine_tag_weights``: a late curriculum) and noise from
    generators seeded by (seed, 1), so that it depends on the first cycle only through the
    saved weights. ``resume_from`` is a directory written by an earlier call
    whose arguments equal this one's except ``refine_*`` (else ValueError): its first cycle is
    loaded instead of retrained, giving the same result as a run from scratch.
    Autoencoder phase: ae_* (skipped with ``latent_channels=0``: pixel space). Model dims as in
    ``ShapesConfig``. With ``snapshot_every`` > 0 the EMA model is also saved every that many
    flow steps to ``snapshot_dir/step-NNNNNN``; with a constant lr after warmup the snapshot at
    step n equals the result of a run with ``steps=n``. Deterministic for a seed on CPU.

    Writes ``save_pretrained`` files (EMA weights) and ``pretrain_history.json`` into out_dir;
    returns that history: {"flow_loss": [...], "ae_loss": [...], "seconds": {...},
    "cpu_seconds": {...}, "config": {...}, "params": {...}, "num_parameters": {...}}.
    """
    # recorded in the history, in the order of its files; not out_dir, which is a stage's
    # temporary directory, so that the same weights give the same files on every rerun
    arguments = {}
    for key, value in params.model_dump(exclude=_NOT_PRETRAIN_PARAMS | _REFINE_ARGS).items():
        arguments[key] = value
        if key == "seed":
            arguments["image_size"] = image_size
    arguments.update(
        snapshot_every=snapshot_every,
        snapshot_dir=snapshot_dir and str(snapshot_dir),
        progress=progress,
        **_refine_arguments(params),
        prompts_sha256=prompts_digest(prompts),
    )
    seed, batch_size, refine_steps = params.seed, params.batch_size, params.refine_steps
    render_batch = render_batch or _default_render()
    if resume_from is not None:
        backend, history = _resume(Path(resume_from), arguments)
    else:
        backend, history = _first_cycle(prompts, render_batch, arguments)
    if refine_steps:
        rng = np.random.default_rng([seed, 1])
        clock = _Clock(history)
        flow_losses = history["flow_loss"]
        _train_flow(
            backend,
            _batches(prompts, batch_size, rng, params.refine_tag_weights),
            lambda metas: render_batch(metas, rng, image_size).float(),
            torch.Generator().manual_seed(seed + 2),
            flow_losses,
            steps=refine_steps,
            lr=params.refine_lr,
            warmup=params.refine_warmup,
            decay_steps=refine_steps,
            snapshot_every=0,
            snapshot=lambda step: None,
            **{k: arguments[k] for k in _FLOW_ARGS},
        )
        clock.lap("refine")
    history["params"] = arguments
    _save(backend, Path(out_dir), history)
    return history


def prompts_digest(prompts: list[dict]) -> str:
    """sha256 of the pretraining scenes, order included (it fixes the batches drawn)."""
    text = json.dumps(prompts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# `base` settings that pretrain_base does not read: the pool is chosen by its caller
_NOT_PRETRAIN_PARAMS = {"pool"}
# the arguments that only the refine cycle reads, and those that do not change the weights
_REFINE_ARGS = {"refine_steps", "refine_lr", "refine_warmup", "refine_tag_weights"}
_NON_MODEL_ARGS = {"out_dir", "snapshot_every", "snapshot_dir", "progress"}
# the flow-phase arguments both cycles share
_FLOW_ARGS = (
    "weight_decay",
    "grad_clip",
    "ema_decay",
    "caption_dropout",
    "t_mean",
    "t_std",
    "progress",
)


# settings added after histories were first written, with the value that had effect before
_BEFORE_THEIR_KEY = {"denoiser": "mmdit"}


def _refine_arguments(params: BaseParams) -> dict:
    """The refine settings as a history records them: tag weights only where a refine cycle
    draws by them, so that a first cycle, or a tag-balanced base made before the setting
    existed, has the files this code writes."""
    refine = params.model_dump(include=_REFINE_ARGS)
    if not (refine["refine_steps"] and refine["refine_tag_weights"]):
        del refine["refine_tag_weights"]
    return refine


def _resume(directory: Path, arguments: dict) -> tuple[ShapesBackend, dict]:
    """Load the first cycle of an earlier run from ``directory`` after checking that it was made
    with these arguments (ValueError naming the differences otherwise)."""
    history = json.loads((directory / HISTORY_FILE).read_text())
    ignored = _REFINE_ARGS | _NON_MODEL_ARGS
    # a setting the history lacks was added after it was written: it had the effect of the
    # default it was added with (the MMDiT), which a later default may differ from
    made = BaseParams().model_dump(exclude=ignored | _NOT_PRETRAIN_PARAMS) | _BEFORE_THEIR_KEY
    made |= {k: v for k, v in history["params"].items() if k not in ignored}
    wanted = json.loads(json.dumps({k: v for k, v in arguments.items() if k not in ignored}))
    differing = sorted(k for k in made.keys() | wanted.keys() if made.get(k) != wanted.get(k))
    if differing or history["params"].get("refine_steps", 0):
        raise ValueError(
            f"cannot resume from {directory}: it was pretrained with other arguments "
            f"({', '.join(differing) or 'a refine cycle already'})"
        )
    history.pop("config", None)
    return ShapesBackend.from_pretrained(directory), history


def _first_cycle(
    prompts: list[dict], render_batch: RenderBatch, arguments: dict
) -> tuple[ShapesBackend, dict]:
    """Autoencoder and first flow cycle from scratch (``pretrain_base``'s arguments)."""
    a = arguments
    seed, image_size, steps = a["seed"], a["image_size"], a["steps"]
    snapshot_every, snapshot_dir = a["snapshot_every"], a["snapshot_dir"]
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    noise_gen = torch.Generator().manual_seed(seed + 1)
    config = ShapesConfig(
        image_size=image_size,
        ae_channels=tuple(a["ae_channels"]),
        unet_channels=tuple(a["unet_channels"]),
        vocab=vocabulary([m["prompt"] for m in prompts] + _world_prompts()),
        **{
            k: a[k]
            for k in (
                "latent_channels",
                "denoiser",
                "patch_size",
                "num_layers",
                "num_heads",
                "head_dim",
                "text_dim",
                "text_layers",
                "text_heads",
                "max_length",
            )
        },
    )
    backend = ShapesBackend.from_config(config, seed=seed)
    history = {
        "flow_loss": [],
        "ae_loss": [],
        "seconds": {},
        "cpu_seconds": {},
        "params": arguments,
        "num_parameters": {
            name: sum(p.numel() for p in module.parameters())
            for name, module in backend.modules.items()
        },
    }

    def render(metas: list[dict]) -> torch.Tensor:
        return render_batch(metas, rng, image_size).float()

    clock = _Clock(history)
    if backend.autoencoder is not None:
        history["ae_loss"] = train_autoencoder(
            backend,
            _batches(prompts, a["ae_batch_size"], rng),
            render,
            steps=a["ae_steps"],
            lr=a["ae_lr"],
            object_weight=a["ae_object_weight"],
            kl_weight=a["ae_kl_weight"],
            progress=a["progress"],
        )
    clock.lap("autoencoder")

    def snapshot(step: int) -> None:
        history["flow_loss"] = flow_losses[:step]
        clock.lap("flow")
        _save(backend, Path(snapshot_dir) / f"step-{step:06d}", history)

    if snapshot_every and snapshot_dir is None:
        raise ValueError("snapshot_every > 0 needs a snapshot_dir")
    flow_losses: list[float] = []
    _train_flow(
        backend,
        _batches(prompts, a["batch_size"], rng),
        render,
        noise_gen,
        flow_losses,
        steps=steps,
        lr=a["lr"],
        warmup=a["warmup"],
        decay_steps=steps if a["lr_decay"] == "cosine" else None,
        snapshot_every=snapshot_every,
        snapshot=snapshot,
        **{k: a[k] for k in _FLOW_ARGS},
    )
    history["flow_loss"] = flow_losses
    clock.lap("flow")
    return backend, history


class _Clock:
    """Wall and process CPU seconds per phase, accumulated into history["seconds"/"cpu_seconds"]
    (CPU seconds tell the cost on a machine shared with other jobs, where wall time does not)."""

    def __init__(self, history: dict):
        self.history = history
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for key, elapsed in (("seconds", wall - self.wall), ("cpu_seconds", cpu - self.cpu)):
            self.history[key][phase] = self.history[key].get(phase, 0.0) + elapsed
        self.wall, self.cpu = wall, cpu


def _save(backend: ShapesBackend, directory: Path, history: dict) -> None:
    """save_pretrained + the history (with the saved config) as pretrain_history.json."""
    backend.save_pretrained(directory)
    history["config"] = json.loads((directory / "backend.json").read_text())
    (directory / HISTORY_FILE).write_text(json.dumps(history) + "\n")


def flow_step(
    backend: ShapesBackend,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    metas: list[dict],
    images: torch.Tensor,
    noise_gen: torch.Generator,
    *,
    caption_dropout: float,
    t_mean: float,
    t_std: float,
    grad_clip: float,
) -> float:
    """One rectified-flow optimizer step of `params` on `metas` and their renders `images`
    (B, 3, H, W): captions dropped with probability `caption_dropout`, logit-normal t; returns
    the loss."""
    with torch.no_grad():
        x0 = backend.encode(images)  # (B, C, h, w)
    drop = torch.rand(len(metas), generator=noise_gen) < caption_dropout
    captions = ["" if d else m["prompt"] for m, d in zip(metas, drop.tolist(), strict=True)]
    t = logit_normal_t(len(metas), t_mean, t_std, noise_gen)
    noise = torch.randn(x0.shape, generator=noise_gen)
    loss = flow_matching_loss(backend, x0, backend.tokenize(captions), t, noise)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return loss.item()


def _train_flow(
    backend: ShapesBackend,
    draw_metas: Callable[[], list[dict]],
    render: Callable[[list[dict]], torch.Tensor],
    noise_gen: torch.Generator,
    losses: list[float],
    *,
    steps: int,
    lr: float,
    warmup: int,
    decay_steps: int | None,
    weight_decay: float,
    grad_clip: float,
    ema_decay: float,
    caption_dropout: float,
    t_mean: float,
    t_std: float,
    snapshot_every: int,
    snapshot: Callable[[int], None],
    progress: bool,
) -> None:
    """Phase 2: rectified-flow training of transformer + text encoder, appending each step's loss
    to ``losses``; ``snapshot(step)`` is called with the EMA weights in place every
    ``snapshot_every`` steps; the EMA weights stay in the modules at the end (eval mode)."""
    trained = [backend.transformer, backend.text_encoder]
    for module in trained:
        module.train()
    params = [p for m in trained for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
    ema = EMA(trained, ema_decay)
    bar = tqdm(range(steps), desc="flow", disable=not progress, mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, warmup, decay_steps)
        metas = draw_metas()
        loss = flow_step(
            backend, optimizer, params, metas, render(metas), noise_gen,
            caption_dropout=caption_dropout, t_mean=t_mean, t_std=t_std, grad_clip=grad_clip,
        )  # fmt: skip
        ema.update()
        losses.append(loss)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if snapshot_every and (step + 1) % snapshot_every == 0 and step + 1 < steps:
            with ema.applied():
                backend.eval()
                snapshot(step + 1)
                backend.clear_cache()
            for module in trained:
                module.train()
    ema.copy_to_model()
    backend.eval()
    backend.clear_cache()


def pretrain_pool(cfg: Config) -> list[dict]:
    """The scenes the base model pretrains on (`base.pool`, module docstring)."""
    from pipeline.world import world_lines

    return world_lines(cfg.world) if cfg.base.pool == "world" else load_prompts(cfg, "train")


def tail_mean(losses: list[float]) -> float:
    """Mean of the last tenth of a loss curve (NaN for an empty one)."""
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail) if tail else float("nan")


def loss_curve(losses: list[float], path, restart: int | None = None) -> None:
    """The base model's pretraining loss per step and smoothed (`restart`: where refine began)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.5, alpha=0.4, label="per step")
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, lw=1.5, label=f"mean of {window}")
    if restart is not None:
        ax.axvline(restart, color="k", lw=0.8, ls="--", label="refine restart")
    ax.set(xlabel="step", ylabel="flow-matching loss", yscale="log", title="Base model pretraining")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
