"""Stable Diffusion 3.5 Medium as a policy backend, from a local diffusers-format directory.

Same interface as ``pipeline.models.ShapesBackend`` (``transformer``, ``latent_shape``,
``lora_target_modules``, ``encode_prompts``, ``velocity``, ``decode``), so rollouts, scoring and
the GRPO update drive SD3.5-M unchanged. Nothing is downloaded: every component loads with
``local_files_only=True`` from ``model.path``, a local snapshot of
stabilityai/stable-diffusion-3.5-medium.

Text conditioning (Esser et al. 2024, "Scaling Rectified Flow Transformers", Sec. 4 and Fig. 2;
as diffusers' ``StableDiffusion3Pipeline.encode_prompt`` computes it), L = max_sequence_length:
    h_L, h_G = penultimate hidden states of CLIP-L, CLIP-G        (B, 77, 768), (B, 77, 1280)
    h_T      = last hidden state of T5-XXL                         (B, L, 4096)
    hidden   = cat_seq(pad_channels(cat_ch(h_L, h_G), 4096), h_T)  (B, 77 + L, 4096)
    pooled   = cat_ch(p_L, p_G), the projected EOS states          (B, 768 + 1280)
The unconditional branch of classifier-free guidance is the "" prompt, encoded the same way.

Precision: weights (and the forward passes) in ``model.dtype``; the timestep is passed in fp32 as
the pipeline passes it; prompt embeddings, velocities and decoded images are returned in fp32, so
the sampler's step and log-prob math stays fp32 (``pipeline.sampling``).

Devices: the modules live on ``device``; ``velocity`` and ``decode`` accept tensors on any device
and return results on the input's device, so the round library keeps states on the host while the
network runs on the accelerator. Cached prompt embeddings stay on ``device``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.config import Config, ConfigError
from pipeline.models import LORA_TARGET_MODULES, GuidedVelocity, PromptEmbeds, encode_cached

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: SD3.5-M's component folders and what each holds (for the error naming what is missing).
COMPONENTS = {
    "transformer": "MMDiT denoiser (SD3Transformer2DModel)",
    "vae": "autoencoder (AutoencoderKL)",
    "text_encoder": "CLIP-L text encoder",
    "text_encoder_2": "CLIP-G text encoder",
    "text_encoder_3": "T5-XXL text encoder",
    "tokenizer": "CLIP-L tokenizer",
    "tokenizer_2": "CLIP-G tokenizer",
    "tokenizer_3": "T5 tokenizer",
    "scheduler": "flow-matching scheduler config",
}
_MODELS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model")  # any one of them suffices
DECODE_BATCH = 8  # latents per VAE decode call (the decoder's activations dominate memory)


def missing_components(directory: Path) -> list[str]:
    """What a diffusers SD3 directory lacks, one readable item each ([] when complete)."""
    missing = []
    for name, what in COMPONENTS.items():
        folder = directory / name
        if not folder.is_dir():
            missing.append(f"{name}/ ({what})")
        elif name in _MODELS:
            if not (folder / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
                missing.append(f"{name}/ weights (*.safetensors)")
        elif name == "scheduler":
            if not (folder / "scheduler_config.json").is_file():
                missing.append("scheduler/scheduler_config.json")
        elif not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            missing.append(f"{name}/ vocabulary (one of {', '.join(_TOKENIZER_FILES)})")
    return missing


def check_directory(directory: Path) -> None:
    """Raise ConfigError unless ``directory`` holds every SD3.5-M component."""
    if not directory.is_dir():
        raise ConfigError(
            f"model.path: no directory at {directory} (sd3 needs a local diffusers snapshot of "
            "stabilityai/stable-diffusion-3.5-medium; nothing is downloaded)"
        )
    missing = missing_components(directory)
    if missing:
        raise ConfigError(
            f"model.path: {directory} is not a complete SD3.5-M diffusers directory; missing "
            + ", ".join(missing)
        )


class SD3Backend(GuidedVelocity):
    """SD3.5-M behind the backend interface (see the module docstring).

    Attributes: transformer (SD3Transformer2DModel), vae (AutoencoderKL), text_encoders
    (CLIP-L, CLIP-G with projection, T5 encoder), tokenizers (matching), resolution (pixels per
    side), max_sequence_length (T5 tokens), device, scheduler_shift (from scheduler_config.json).
    """

    lora_target_modules: list[str] = LORA_TARGET_MODULES

    def __init__(
        self,
        *,
        transformer,
        vae,
        text_encoders: tuple,
        tokenizers: tuple,
        resolution: int,
        max_sequence_length: int,
        scheduler_shift: float,
        device: torch.device | str = "cpu",
    ):
        self.transformer = transformer
        self.vae = vae
        self.text_encoders = text_encoders
        self.tokenizers = tokenizers
        self.max_sequence_length = max_sequence_length
        self.scheduler_shift = scheduler_shift
        self.device = torch.device(device)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        multiple = self.vae_scale_factor * transformer.config.patch_size
        if resolution % multiple:
            raise ConfigError(
                f"model.resolution: {resolution} must be a multiple of {multiple} "
                "(VAE downsampling x transformer patch size)"
            )
        self.resolution = resolution
        self._embed_cache: dict[str, PromptEmbeds] = {}

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: str = "float32",
        device: torch.device | str = "cpu",
        resolution: int = 512,
        max_sequence_length: int = 256,
    ) -> SD3Backend:
        """Load SD3.5-M from a local diffusers directory; weights in ``dtype`` on ``device``.

        Raises ConfigError naming every missing component. Modules are frozen and in eval mode.
        """
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import (
            CLIPTextModelWithProjection,
            CLIPTokenizer,
            T5EncoderModel,
            T5TokenizerFast,
        )

        directory = Path(directory)
        check_directory(directory)
        torch_dtype = DTYPES[dtype]
        local = {"local_files_only": True}

        def diffusers_part(model_cls, name):
            return model_cls.from_pretrained(directory / name, torch_dtype=torch_dtype, **local)

        def transformers_part(model_cls, name):
            return model_cls.from_pretrained(directory / name, dtype=torch_dtype, **local)

        text_encoders = (
            transformers_part(CLIPTextModelWithProjection, "text_encoder"),
            transformers_part(CLIPTextModelWithProjection, "text_encoder_2"),
            transformers_part(T5EncoderModel, "text_encoder_3"),
        )
        tokenizers = (
            CLIPTokenizer.from_pretrained(directory / "tokenizer", **local),
            CLIPTokenizer.from_pretrained(directory / "tokenizer_2", **local),
            T5TokenizerFast.from_pretrained(directory / "tokenizer_3", **local),
        )
        scheduler = json.loads((directory / "scheduler" / "scheduler_config.json").read_text())
        backend = cls(
            transformer=diffusers_part(SD3Transformer2DModel, "transformer"),
            vae=diffusers_part(AutoencoderKL, "vae"),
            text_encoders=text_encoders,
            tokenizers=tokenizers,
            resolution=resolution,
            max_sequence_length=max_sequence_length,
            scheduler_shift=float(scheduler.get("shift", 1.0)),
            device=device,
        )
        for module in backend.modules.values():
            module.requires_grad_(False)
            module.to(backend.device)
        return backend.eval()

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        side = self.resolution // self.vae_scale_factor
        return (self.transformer.config.in_channels, side, side)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        return {"transformer": self.transformer, "vae": self.vae} | dict(
            zip(names, self.text_encoders, strict=True)
        )

    def eval(self) -> SD3Backend:
        for module in self.modules.values():
            module.eval()
        return self

    # ---- text -------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """prompts -> PromptEmbeds hidden (B, 77 + L_T5, D_T5) / pooled (B, P), fp32, no grad.

        Each distinct string is encoded once, on its own (`encode_cached`), and cached on
        ``device`` ("" is the unconditional prompt); the text encoders are frozen, so the cache
        never goes stale.
        """
        return encode_cached(self._embed_cache, prompts, self._encode)

    def clear_cache(self) -> None:
        self._embed_cache.clear()

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> PromptEmbeds:
        """SD3's joint text conditioning of ``prompts`` (module docstring), fp32 on ``device``."""
        clip_length = self.tokenizers[0].model_max_length  # the pipeline uses CLIP-L's for both
        clip_hidden, clip_pooled = [], []
        for tokenizer, encoder in zip(self.tokenizers[:2], self.text_encoders[:2], strict=True):
            ids = tokenizer(
                prompts,
                padding="max_length",
                max_length=clip_length,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            out = encoder(ids.to(self.device), output_hidden_states=True)
            clip_hidden.append(out.hidden_states[-2].float())  # (B, 77, D_clip)
            clip_pooled.append(out.text_embeds.float())  # (B, P_clip)
        t5_ids = self.tokenizers[2](
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        t5 = self.text_encoders[2](t5_ids.to(self.device))[0].float()  # (B, L_T5, D_T5)
        clip = torch.cat(clip_hidden, dim=-1)  # (B, 77, D_L + D_G)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # (B, 77, D_T5), zero channels
        hidden = torch.cat([clip, t5], dim=1)  # (B, 77 + L_T5, D_T5)
        return PromptEmbeds(hidden, torch.cat(clip_pooled, dim=-1))  # pooled (B, P_L + P_G)

    # ---- denoiser ---------------------------------------------------------------------------
    def _forward(self, x: Tensor, sigma: Tensor, embeds: PromptEmbeds) -> Tensor:
        """One transformer call: x (B, C, H, W), sigma (B,) -> v (B, C, H, W) fp32 on x's device.

        The timestep 1000 * sigma stays fp32, as the pipeline passes the scheduler's timesteps.
        """
        dtype = self.transformer.dtype
        out = self.transformer(
            hidden_states=x.to(self.device, dtype),
            encoder_hidden_states=embeds.hidden.to(self.device, dtype),
            pooled_projections=embeds.pooled.to(self.device, dtype),
            timestep=sigma.to(self.device, torch.float32) * 1000.0,
            return_dict=False,
        )[0]
        return out.float().to(x.device)

    # ---- latents -> pixels ------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x: Tensor) -> Tensor:
        """x (B, C, h, w) -> images (B, 3, H, W) fp32 in [0, 1], on x's device.

        The flow runs on normalised latents x = (z - shift) * scale (SD3's VAE convention), so
        z = x / scale + shift is decoded, in chunks of ``DECODE_BATCH``.
        """
        vae_config = self.vae.config
        images = []
        for chunk in x.split(DECODE_BATCH):
            z = chunk.to(self.device, torch.float32) / vae_config.scaling_factor
            z = z + vae_config.shift_factor
            pixels = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0].float()
            images.append(((pixels + 1.0) / 2.0).clamp(0.0, 1.0).to(x.device))
        return torch.cat(images)


def load_sd3(cfg: Config) -> SD3Backend:
    """The SD3 backend named by `model.*`; warns when `sampling.shift` differs from the
    checkpoint's scheduler shift (the rollouts then follow another schedule than the pipeline's).
    """
    model = cfg.model
    backend = SD3Backend.from_pretrained(
        cfg.path(model.path),
        dtype=model.dtype,
        device=model.device,
        resolution=model.resolution,
        max_sequence_length=model.max_sequence_length,
    )
    if backend.scheduler_shift != cfg.sampling.shift:
        log.warning(
            "sampling.shift = %s differs from the checkpoint scheduler's shift %s",
            cfg.sampling.shift,
            backend.scheduler_shift,
        )
    return backend


def save_lora_weights(transformer: torch.nn.Module, directory: str | Path) -> Path:
    """Write the transformer's LoRA adapter in diffusers' format (with its LoraConfig metadata,
    so that ``StableDiffusion3Pipeline.load_lora_weights`` restores the same alpha / rank).

    Returns the directory (it holds ``pytorch_lora_weights.safetensors``).
    """
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    StableDiffusion3Pipeline.save_lora_weights(
        directory,
        transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
    )
    return Path(directory)
