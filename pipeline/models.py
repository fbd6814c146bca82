"""Text-to-image backends behind one interface: the embedded ShapesWorld policy.

A backend bundles what the sampler, the rollout cache and the GRPO update need from a
text-to-image flow model, so that the same code drives the embedded CPU model and SD3.5-M:

- ``transformer``: the denoiser, a diffusers ``SD3Transformer2DModel`` (LoRA goes here; its
  attention projections carry the same names as in SD3.5, see ``LORA_TARGET_MODULES``), or for
  ShapesWorld optionally a ``UNet2DConditionModel`` (``ShapesConfig.denoiser``);
- ``latent_shape``: the (C, H, W) shape of the state x the sampler moves;
- ``encode_prompts``: prompts -> ``PromptEmbeds`` (token states + pooled vector), cached;
- ``velocity``: v_theta(x, sigma, c) with classifier-free guidance in one batched forward;
- ``decode``: x -> images (B, 3, H, W) in [0, 1].

Flow-matching convention (rectified flow, Liu et al. 2022; SD3, Esser et al. 2024, eq. 1-3):
x_sigma = (1 - sigma) * x0 + sigma * eps, the model predicts v = eps - x0, sigma in [0, 1] with
1 = noise; the transformer receives timestep = 1000 * sigma, as SD3's scheduler passes it.

The embedded backend (``ShapesBackend``) pairs a word-level tokenizer (``tokenizers`` WordLevel
wrapped in ``PreTrainedTokenizerFast``) and a tiny ``CLIPTextModelWithProjection`` (its last hidden
states are the token embeddings, its projected EOS state the pooled vector) with a tiny
``SD3Transformer2DModel`` acting in the latent space of a tiny ``AutoencoderKL`` (or directly on
pixels, x = 2 * img - 1, when ``ShapesConfig.latent_channels`` is 0). The UNet alternative
(SD 1.x/SDXL layout: convolutional levels, cross-attention to the token states at the coarsest,
the pooled vector added to the timestep embedding) draws thin shapes the tiny MMDiT cannot
(reports/base/choice.md). Nothing is downloaded: all parts are built from configs and trained
by ``pipeline.pretrain``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel, UNet2DConditionModel
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.normalizers import Lowercase
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast

# Flow-GRPO's LoRA targets for SD3's MMDiT blocks: image- and text-stream attention projections.
LORA_TARGET_MODULES = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]
# The UNet's self- and cross-attention projections (attn1, attn2 of each transformer block).
UNET_LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]
UNET_GROUPS = 16  # group-norm groups of the UNet, so its widths are multiples of 16
SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}
BACKEND_FILE = "backend.json"


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts.

    hidden: (B, L, D) fp32 token states (the transformer's ``encoder_hidden_states``).
    pooled: (B, P) fp32 pooled vector (the transformer's ``pooled_projections``).
    """

    hidden: torch.Tensor
    pooled: torch.Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index: int | slice | torch.Tensor | list[int]) -> PromptEmbeds:
        """Rows ``index`` (an int keeps the batch dimension)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return PromptEmbeds(self.hidden[index], self.pooled[index])

    def repeat_interleave(self, repeats: int) -> PromptEmbeds:
        """Each row ``repeats`` times in a row: (B, ...) -> (B * repeats, ...) (a GRPO group)."""
        return PromptEmbeds(
            self.hidden.repeat_interleave(repeats, dim=0),
            self.pooled.repeat_interleave(repeats, dim=0),
        )

    def expand(self, batch_size: int) -> PromptEmbeds:
        """A single row (B = 1) broadcast to ``batch_size`` rows (e.g. the unconditional row)."""
        if len(self) != 1:
            raise ValueError(f"expand needs a single row, got {len(self)}")
        return self.repeat_interleave(batch_size)

    def to(self, *args, **kwargs) -> PromptEmbeds:
        return PromptEmbeds(self.hidden.to(*args, **kwargs), self.pooled.to(*args, **kwargs))

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch dimension."""
        return PromptEmbeds(
            torch.cat([p.hidden for p in parts]), torch.cat([p.pooled for p in parts])
        )


def encode_cached(
    cache: dict[str, PromptEmbeds], prompts: list[str], encode: Callable[[list[str]], PromptEmbeds]
) -> PromptEmbeds:
    """`encode` each prompt missing from `cache` on its own, then gather the B rows of `prompts`.

    On its own, because a batched encode's bits depend on the batch: a resumed run meets its
    prompts in other company than the uninterrupted run did, and must see the same embeddings.
    """
    for prompt in sorted(set(prompts) - cache.keys()):
        cache[prompt] = encode([prompt])[0]
    return PromptEmbeds.cat([cache[p] for p in prompts])


@dataclass
class ShapesConfig:
    """Architecture of the embedded ShapesWorld backend (all sizes in elements, not bytes).

    image_size: side of the square RGB images, pixels.
    latent_channels: channels of the autoencoder latent; 0 = no autoencoder (pixel space).
    ae_channels: widths of the autoencoder's resolution levels; the latent side is
        image_size / 2**(len(ae_channels) - 1).
    denoiser: "mmdit" (SD3Transformer2DModel) or "unet" (UNet2DConditionModel).
    patch_size: transformer patch side in latent (or pixel) units; tokens = (side / patch)**2.
    num_layers, num_heads, head_dim: MMDiT depth and attention shape (width = heads * head_dim).
    unet_channels: UNet widths per resolution level (multiples of 16, the group-norm groups).
    text_dim, text_layers, text_heads: tiny CLIP text encoder; ``text_dim`` is also the pooled size.
    max_length: tokens per prompt including [BOS]/[EOS], padded with [PAD].
    vocab: words of the tokenizer, special tokens excluded.
    """

    image_size: int = 32
    latent_channels: int = 4
    ae_channels: tuple[int, ...] = (32, 64)
    denoiser: str = "mmdit"
    patch_size: int = 2
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    unet_channels: tuple[int, ...] = (32, 64)
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 2
    max_length: int = 12
    vocab: list[str] = field(default_factory=list)

    @property
    def latent_side(self) -> int:
        if self.latent_channels == 0:
            return self.image_size
        return self.image_size // 2 ** (len(self.ae_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        channels = self.latent_channels if self.latent_channels else 3
        return (channels, self.latent_side, self.latent_side)


def vocabulary(prompts: list[str]) -> list[str]:
    """Sorted lower-case words of ``prompts``, split as the tokenizer splits them."""
    return sorted({w for p in prompts for w in re.findall(r"\w+|[^\w\s]", p.lower())})


def build_tokenizer(vocab: list[str], max_length: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: lower-case, whitespace/punctuation split, [BOS] w... [EOS] [PAD]...

    Unknown words map to [UNK]. Ids: 0 [PAD], 1 [UNK], 2 [BOS], 3 [EOS], then ``vocab`` in order.
    """
    specials = [SPECIAL_TOKENS[k] for k in ("pad", "unk", "bos", "eos")]
    ids = {tok: i for i, tok in enumerate(specials + [w for w in vocab if w not in specials])}
    core = Tokenizer(WordLevel(ids, unk_token=SPECIAL_TOKENS["unk"]))
    core.normalizer = Lowercase()
    core.pre_tokenizer = Whitespace()
    bos, eos = SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
    core.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, ids[bos]), (eos, ids[eos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        model_max_length=max_length,
        pad_token=SPECIAL_TOKENS["pad"],
        unk_token=SPECIAL_TOKENS["unk"],
        bos_token=bos,
        eos_token=eos,
    )


def build_text_encoder(config: ShapesConfig, tokenizer: PreTrainedTokenizerFast):
    """Tiny CLIP text encoder; its pooled output is the projected state at the [EOS] token."""
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.text_dim,
        intermediate_size=4 * config.text_dim,
        projection_dim=config.text_dim,
        num_hidden_layers=config.text_layers,
        num_attention_heads=config.text_heads,
        max_position_embeddings=config.max_length,
        hidden_act="gelu",
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModelWithProjection(clip_config)


def build_transformer(config: ShapesConfig) -> SD3Transformer2DModel:
    """Tiny MMDiT with SD3.5's block structure (joint attention, AdaLN-zero, pooled vector)."""
    channels, side, _ = config.latent_shape
    width = config.num_heads * config.head_dim
    return SD3Transformer2DModel(
        sample_size=side,
        patch_size=config.patch_size,
        in_channels=channels,
        out_channels=channels,
        num_layers=config.num_layers,
        attention_head_dim=config.head_dim,
        num_attention_heads=config.num_heads,
        joint_attention_dim=config.text_dim,
        caption_projection_dim=width,
        pooled_projection_dim=config.text_dim,
        pos_embed_max_size=side // config.patch_size,
    )


def build_unet(config: ShapesConfig) -> UNet2DConditionModel:
    """Tiny SD-style UNet: one ResNet block per level, cross-attention to the token states at the
    coarsest level, the pooled text vector projected into the timestep embedding (as SDXL)."""
    if any(width % UNET_GROUPS for width in config.unet_channels):
        raise ValueError(
            f"unet_channels must be multiples of {UNET_GROUPS} (its group norms' groups), "
            f"got {list(config.unet_channels)}"
        )
    channels, side, _ = config.latent_shape
    plain = len(config.unet_channels) - 1
    return UNet2DConditionModel(
        sample_size=side,
        in_channels=channels,
        out_channels=channels,
        down_block_types=("DownBlock2D",) * plain + ("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",) + ("UpBlock2D",) * plain,
        block_out_channels=tuple(config.unet_channels),
        layers_per_block=1,
        cross_attention_dim=config.text_dim,
        attention_head_dim=8,  # diffusers' legacy name: the number of heads
        norm_num_groups=UNET_GROUPS,
        class_embed_type="projection",
        projection_class_embeddings_input_dim=config.text_dim,
    )


def build_denoiser(config: ShapesConfig) -> SD3Transformer2DModel | UNet2DConditionModel:
    return build_unet(config) if config.denoiser == "unet" else build_transformer(config)


def build_autoencoder(config: ShapesConfig) -> AutoencoderKL | None:
    """Tiny KL autoencoder (SD3's VAE architecture, scaled down); None in pixel space.

    The flow runs on (mode(z) - shift_factor) * scaling_factor, as SD3 does; ``pretrain`` sets
    both factors from the training latents so that the flow's x0 has zero mean and unit std.
    """
    if config.latent_channels == 0:
        return None
    levels = len(config.ae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(config.ae_channels),
        layers_per_block=1,
        latent_channels=config.latent_channels,
        norm_num_groups=8,
        sample_size=config.image_size,
        scaling_factor=1.0,
        shift_factor=0.0,
        mid_block_add_attention=False,
    )


class GuidedVelocity:
    """Classifier-free-guided velocity for any backend with `encode_prompts` and `_forward`.

    `_forward(x (B, C, H, W), sigma (B,), embeds) -> v (B, C, H, W) fp32` is one denoiser call;
    ShapesWorld's and SD3's backends share this guidance step.
    """

    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        *,
        guidance: float,
        uncond: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """Guided velocity v = v_u + w (v_c - v_u) (Ho & Salimans 2022, eq. 6, in v-space).

        x: (B, C, H, W) state at noise level sigma (B,) in [0, 1]; embeds: B rows; uncond: 1 or B
        rows, default the "" prompt. With ``guidance == 1`` only the conditional branch runs;
        otherwise both branches run in one forward of batch 2B. Returns v (B, C, H, W) fp32.
        """
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(batch)
        if guidance == 1.0:
            return self._forward(x, sigma, embeds)
        if uncond is None:
            uncond = self.encode_prompts([""])
        if len(uncond) == 1:
            uncond = uncond.expand(batch)
        both = self._forward(
            torch.cat([x, x]), torch.cat([sigma, sigma]), PromptEmbeds.cat([embeds, uncond])
        )  # (2B, C, H, W)
        v_cond, v_uncond = both.chunk(2)
        return v_uncond + guidance * (v_cond - v_uncond)


class ShapesBackend(GuidedVelocity):
    """The embedded ShapesWorld text-to-image flow model (see the module docstring).

    Attributes: tokenizer, text_encoder (CLIPTextModelWithProjection), transformer (the
    denoiser: SD3Transformer2DModel or UNet2DConditionModel), autoencoder (AutoencoderKL or
    None), config (ShapesConfig).
    """

    def __init__(
        self,
        config: ShapesConfig,
        tokenizer: PreTrainedTokenizerFast,
        text_encoder: CLIPTextModelWithProjection,
        transformer: SD3Transformer2DModel | UNet2DConditionModel,
        autoencoder: AutoencoderKL | None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.autoencoder = autoencoder
        self._embed_cache: dict[str, PromptEmbeds] = {}

    @classmethod
    def from_config(cls, config: ShapesConfig, seed: int = 0) -> ShapesBackend:
        """Fresh, randomly initialised backend (weights depend only on ``config`` and ``seed``)."""
        if not config.vocab:
            raise ValueError(
                "ShapesConfig.vocab is empty: build it with models.vocabulary(prompts)"
            )
        torch.manual_seed(seed)
        tokenizer = build_tokenizer(config.vocab, config.max_length)
        text_encoder = build_text_encoder(config, tokenizer)
        transformer = build_denoiser(config)
        autoencoder = build_autoencoder(config)
        return cls(config, tokenizer, text_encoder, transformer, autoencoder)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.config.latent_shape

    @property
    def lora_target_modules(self) -> list[str]:
        if self.config.denoiser == "unet":
            return UNET_LORA_TARGET_MODULES
        return LORA_TARGET_MODULES

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        parts = {"text_encoder": self.text_encoder, "transformer": self.transformer}
        if self.autoencoder is not None:
            parts["vae"] = self.autoencoder
        return parts

    def eval(self) -> ShapesBackend:
        for module in self.modules.values():
            module.eval()
        return self

    # ---- text -------------------------------------------------------------------------------
    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """prompts -> token ids (B, max_length) int64, padded/truncated to ``max_length``."""
        return self.tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=self.config.max_length,
            return_tensors="pt",
        ).input_ids

    def embed_tokens(self, input_ids: torch.Tensor) -> PromptEmbeds:
        """Differentiable text encoding (used by pretraining): ids (B, L) -> PromptEmbeds."""
        out = self.text_encoder(input_ids=input_ids)
        return PromptEmbeds(out.last_hidden_state.float(), out.text_embeds.float())

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """prompts -> PromptEmbeds (B, L, D) / (B, P), fp32, no grad; "" is the unconditional one.

        Each distinct string is encoded once, on its own (`encode_cached`), and cached (the text
        encoder is frozen after pretraining; ``clear_cache`` if its weights change).
        """
        with torch.no_grad():
            return encode_cached(
                self._embed_cache, prompts, lambda p: self.embed_tokens(self.tokenize(p))
            )

    def clear_cache(self) -> None:
        self._embed_cache.clear()

    # ---- denoiser ---------------------------------------------------------------------------
    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """One denoiser call: x (B, C, H, W), sigma (B,) -> v (B, C, H, W) fp32."""
        dtype = self.transformer.dtype
        x, timestep = x.to(dtype), sigma.to(dtype) * 1000.0
        hidden, pooled = embeds.hidden.to(dtype), embeds.pooled.to(dtype)
        if self.config.denoiser == "unet":  # the pooled vector enters as UNet class embedding
            out = self.transformer(x, timestep, hidden, class_labels=pooled, return_dict=False)
        else:
            out = self.transformer(
                hidden_states=x,
                encoder_hidden_states=hidden,
                pooled_projections=pooled,
                timestep=timestep,
                return_dict=False,
            )
        return out[0].float()

    # ---- pixels <-> states --------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) in [0, 1] -> x0 (B, C, h, w) fp32 (posterior mode, scaled)."""
        pixels = 2.0 * images.float() - 1.0
        if self.autoencoder is None:
            return pixels
        vae_config = self.autoencoder.config
        z = self.autoencoder.encode(pixels).latent_dist.mode()
        return (z - vae_config.shift_factor) * vae_config.scaling_factor

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, h, w) -> images (B, 3, H, W) fp32 in [0, 1]."""
        pixels = x.float()
        if self.autoencoder is not None:
            vae_config = self.autoencoder.config
            z = pixels / vae_config.scaling_factor + vae_config.shift_factor
            pixels = self.autoencoder.decode(z).sample.float()
        return ((pixels + 1.0) / 2.0).clamp(0.0, 1.0)

    # ---- persistence ------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer/, text_encoder/, transformer/ (, vae/) and backend.json (safetensors)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(directory / "tokenizer")
        for name, module in self.modules.items():
            module.save_pretrained(directory / name, safe_serialization=True)
        (directory / BACKEND_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ShapesBackend:
        """Load what ``save_pretrained`` wrote; modules in eval mode, fp32."""
        directory = Path(directory)
        fields = json.loads((directory / BACKEND_FILE).read_text())
        for key in ("ae_channels", "unet_channels"):  # (a model saved before UNets: MMDiT)
            fields[key] = tuple(fields.get(key, getattr(ShapesConfig, key)))
        config = ShapesConfig(**fields)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory / "tokenizer")
        text_encoder = CLIPTextModelWithProjection.from_pretrained(directory / "text_encoder")
        denoiser = UNet2DConditionModel if config.denoiser == "unet" else SD3Transformer2DModel
        transformer = denoiser.from_pretrained(directory / "transformer")
        autoencoder = None
        if config.latent_channels:
            autoencoder = AutoencoderKL.from_pretrained(directory / "vae")
        return cls(config, tokenizer, text_encoder, transformer, autoencoder).eval()
