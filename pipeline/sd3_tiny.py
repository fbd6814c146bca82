"""Tiny, randomly initialised stand-ins for SD3.5-M and the real-image reward models, for the
tests and the CUDA smoke check (`scripts/cuda_smoke.py`).

Each writer saves its components with ``save_pretrained`` in the layout of the real checkpoint
(stabilityai/stable-diffusion-3.5-medium; a CLIP model dir; an OWLv2 dir), so tests load them
through the same code paths as the real weights. Nothing is downloaded: the tokenizers are
built from a vocabulary these helpers write. Sizes are chosen for speed, and so that every
shape-sensitive step of SD3's text conditioning is exercised: the two CLIP widths differ
(16 + 24), their concatenation (40) is zero-padded to the T5 width (48), and the pooled vector
is the concatenation of two different projections (16 + 24).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CLIP_MAX_LENGTH = 16  # tokens per CLIP prompt (SD3.5: 77)
T5_MAX_LENGTH = 12  # tokens per T5 prompt (SD3.5 pipeline default: 256)
RESOLUTION = 32  # pixels per side; the VAE halves it once, patches of 2 -> 64 image tokens
SCALING_FACTOR, SHIFT_FACTOR = 1.5305, 0.0609  # SD3.5's VAE latent normalisation
SHIFT = 3.0  # FlowMatchEulerDiscreteScheduler shift, as in SD3.5-M's scheduler config


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE (every byte maps to one visible char)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def write_clip_tokenizer(directory: Path) -> Path:
    """A CLIP BPE tokenizer as SD3.5 ships it: vocab.json + merges.txt + tokenizer_config.json.

    Vocabulary: every byte symbol, alone and word-final ("</w>"), two merges (r e -> re,
    re d</w> -> red</w>), then <|startoftext|> and <|endoftext|> (also the pad token).
    """
    directory.mkdir(parents=True, exist_ok=True)
    symbols = _byte_symbols()
    tokens = [*symbols, *(s + "</w>" for s in symbols), "re", "red</w>"]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\nr e\nre d</w>\n")
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": CLIP_MAX_LENGTH}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def build_t5_tokenizer():
    """A unigram T5 tokenizer over lower-case letters (pieces "▁x" and "x"), no extra ids."""
    from transformers import T5TokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{c}", -2.5) for c in letters] + [(c, -3.0) for c in letters]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _clip_text_encoder(tokenizer, width: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=2 * width,
            projection_dim=width,
            num_hidden_layers=2,  # SD3 reads the penultimate layer
            num_attention_heads=2,
            max_position_embeddings=CLIP_MAX_LENGTH,
            hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def build_sd3_pipeline(root: Path):
    """A StableDiffusion3Pipeline of tiny random components (its tokenizers written under root)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTokenizer, T5Config, T5EncoderModel

    clip_tokenizer = CLIPTokenizer.from_pretrained(write_clip_tokenizer(root / "clip_tokenizer"))
    t5_tokenizer = build_t5_tokenizer()
    text_encoder = _clip_text_encoder(clip_tokenizer, 16, seed=1)
    text_encoder_2 = _clip_text_encoder(clip_tokenizer, 24, seed=2)
    torch.manual_seed(3)
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=48,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
        )
    )
    torch.manual_seed(4)
    transformer = SD3Transformer2DModel(
        sample_size=RESOLUTION // 2,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=48,
        caption_projection_dim=16,
        pooled_projection_dim=40,
        pos_embed_max_size=RESOLUTION // 4,
        dual_attention_layers=(0,),  # SD3.5-M's MMDiT-X blocks carry a second attention
        qk_norm="rms_norm",
    )
    torch.manual_seed(5)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=RESOLUTION,
        scaling_factor=SCALING_FACTOR,
        shift_factor=SHIFT_FACTOR,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )


def write_tiny_sd3(root: Path) -> Path:
    """Save a tiny SD3 pipeline under root/sd3 in the SD3.5-M diffusers layout; return it."""
    directory = root / "sd3"
    build_sd3_pipeline(root).save_pretrained(directory)
    for name in ("tokenizer", "tokenizer_2"):  # SD3.5-M ships CLIP's vocab.json + merges.txt
        shutil.rmtree(directory / name)
        write_clip_tokenizer(directory / name)
    return directory


def _tiny_vision_config(image_size: int) -> dict:
    """The vision tower shared by the tiny CLIP and the tiny OWLv2: one layer, 8-pixel patches."""
    return {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 8,
    }


def write_tiny_clip(directory: Path, *, image_size: int = 32, seed: int = 6) -> Path:
    """A random CLIPModel plus its CLIPProcessor (resize/crop to image_size) in directory."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    tokenizer = CLIPTokenizer.from_pretrained(write_clip_tokenizer(directory / "_tokenizer"))
    torch.manual_seed(seed)
    model = CLIPModel(
        CLIPConfig(
            text_config=_clip_text_encoder(tokenizer, 16, seed=seed).config.to_dict(),
            vision_config=_tiny_vision_config(image_size),
            projection_dim=16,
        )
    )
    side = {"height": image_size, "width": image_size}
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=side)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


def write_tiny_owlv2(directory: Path, *, image_size: int = 32, seed: int = 7) -> Path:
    """A random Owlv2ForObjectDetection plus its processor (pad to square, resize) in directory."""
    from transformers import (
        CLIPTokenizer,
        Owlv2Config,
        Owlv2ForObjectDetection,
        Owlv2ImageProcessor,
        Owlv2Processor,
    )

    tokenizer = CLIPTokenizer.from_pretrained(write_clip_tokenizer(directory / "_tokenizer"))
    torch.manual_seed(seed)
    model = Owlv2ForObjectDetection(
        Owlv2Config(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": CLIP_MAX_LENGTH,
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config=_tiny_vision_config(image_size),
            projection_dim=16,
        )
    )
    image_processor = Owlv2ImageProcessor(size={"height": image_size, "width": image_size})
    Owlv2Processor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


def tiny_round_overrides(sd3_dir: Path, clip_dir: Path) -> list[str]:
    """`-S` overrides for GRPO rounds on the tiny SD3 rewarded by the tiny CLIP's score (the
    tests' and the CUDA smoke check's common setting; each adds its own sizes)."""
    return [
        "model.backend=sd3",
        f"model.path={sd3_dir}",
        f"model.resolution={RESOLUTION}",
        f"model.max_sequence_length={T5_MAX_LENGTH}",
        "sampling.num_steps=4",
        "score.rewards={clipscore: 1.0}",
        f"score.clip_path={clip_dir}",
    ]
