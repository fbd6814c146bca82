"""Reward models behind one registry and one signature.

A reward is `(images (B, 3, H, W) fp32 in [0, 1], metadata: list of GenEval dicts) -> (B,) fp32`.
A factory `(cfg) -> reward` builds it once (heavy models load once per process); `score.rewards`
names are checked against the registry when params are loaded, so a typo fails before any work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pipeline.config import Config

RewardFn = Callable[[Tensor, Sequence[dict]], Tensor]
REWARDS: dict[str, Callable[[Config], RewardFn]] = {}

#: Where the `base` stage writes ShapesCLIP.
SHAPESCLIP_DIR = "data/base/shapesclip"


def register(name: str):
    def add(factory: Callable[[Config], RewardFn]) -> Callable[[Config], RewardFn]:
        REWARDS[name] = factory
        return factory

    return add


Detect = Callable[[Tensor, Sequence[dict]], list[dict]]  # (images, metadata) -> detections


def shapes_detector(cfg: Config) -> Detect:
    """ShapesWorld's classical detector, on `score.reward_workers` processes."""
    from pipeline.detector import detect_batch

    def detect(images: Tensor, metadata: Sequence[dict]) -> list[dict]:
        return detect_batch(images.detach().float().cpu(), workers=cfg.score.reward_workers)

    return detect


def partial_geneval_reward(detect: Detect) -> RewardFn:
    """Dense GenEval reward on `detect`'s detections: the share of satisfied clause checks."""
    from pipeline.geneval import partial_score

    def reward(images: Tensor, metadata: Sequence[dict]) -> Tensor:
        found = detect(images, metadata)
        return torch.tensor([partial_score(m, d) for m, d in zip(metadata, found, strict=True)])

    return reward


def strict_geneval_reward(detect: Detect) -> RewardFn:
    """GenEval's binary verdict on `detect`'s detections: 1 when every rule holds."""
    from pipeline.geneval import verdicts

    def reward(images: Tensor, metadata: Sequence[dict]) -> Tensor:
        judged = verdicts(metadata, detect(images, metadata))
        return torch.tensor([row["correct"] for row in judged], dtype=torch.float32)

    return reward


@register("geneval")
def geneval_partial(cfg: Config) -> RewardFn:
    """Dense GenEval reward on ShapesWorld's detector, in [0, 1]."""
    return partial_geneval_reward(shapes_detector(cfg))


@register("geneval_strict")
def geneval_strict(cfg: Config) -> RewardFn:
    """GenEval's binary verdict on ShapesWorld's detector."""
    return strict_geneval_reward(shapes_detector(cfg))


@register("brightness")
def brightness(cfg: Config) -> RewardFn:
    """Mean pixel intensity in [0, 1]: a control reward, dense and prompt-free (DDPO's
    compressibility plays the same part), that any working update should raise. Not quality."""

    def reward(images: Tensor, metadata: Sequence[dict]) -> Tensor:
        return images.float().mean(dim=(1, 2, 3))

    return reward


@register("shapes_clip")
def shapesclip(cfg: Config) -> RewardFn:
    """ShapesCLIP's scaled text-image cosine similarity (a PickScore/CLIPScore stand-in)."""
    model = _load_shapesclip(str(cfg.path(SHAPESCLIP_DIR)))

    def reward(images: Tensor, metadata: Sequence[dict]) -> Tensor:
        with torch.no_grad():
            return model.score(images.float(), [m["prompt"] for m in metadata]).float()

    return reward


@cache
def _load_shapesclip(path: str):
    from pathlib import Path

    from pipeline.config import ConfigError
    from pipeline.shapesclip import load_shapesclip

    if not Path(path).is_dir():
        raise ConfigError(f"score.rewards: shapes_clip needs {path} (run `creditflow base` first)")
    return load_shapesclip(path)


# ---- real-image rewards (pipeline.real_rewards): local weights named in `score.*_path` ----------
@register("clipscore")
def clipscore(cfg: Config) -> RewardFn:
    """PickScore/CLIPScore-style exp(t)·cos(image, prompt) of the CLIP at `score.clip_path`."""
    scorer = _load_real("clip", _reward_dir(cfg, "clip_path"), cfg)

    def reward(images: Tensor, metadata: Sequence[dict]) -> Tensor:
        return scorer(images, [m["prompt"] for m in metadata])

    return reward


@register("geneval_real")
def geneval_real(cfg: Config) -> RewardFn:
    """Dense GenEval reward (as `geneval`) on OWLv2 + CLIP-colour detections of real images."""
    return partial_geneval_reward(_geneval_detector(cfg))


@register("geneval_real_strict")
def geneval_real_strict(cfg: Config) -> RewardFn:
    """GenEval's binary verdict on OWLv2 + CLIP-colour detections of real images."""
    return strict_geneval_reward(_geneval_detector(cfg))


def _reward_dir(cfg: Config, key: str) -> str:
    """The directory `score.<key>` names, or a ConfigError (weights are never downloaded)."""
    from pipeline.config import ConfigError

    path = cfg.path(getattr(cfg.score, key))
    if not path.is_dir():
        raise ConfigError(f"score.{key}: no model directory at {path} (local weights only)")
    return str(path)


def _load_real(kind: str, path: str, cfg: Config):
    return _load_real_cached(kind, path, cfg.model.device, cfg.score.reward_batch_size)


@cache
def _load_real_cached(kind: str, path: str, device: str, batch_size: int):
    from pathlib import Path

    from pipeline import real_rewards

    load = {"clip": real_rewards.load_clip, "owlv2": real_rewards.load_owlv2}[kind]
    return load(Path(path), device=device, batch_size=batch_size)


def _geneval_detector(cfg: Config):
    from pipeline.real_rewards import ColorClassifier, GenEvalDetector

    detector = _load_real("owlv2", _reward_dir(cfg, "detector_path"), cfg)
    colors = ColorClassifier(_load_real("clip", _reward_dir(cfg, "color_clip_path"), cfg))
    return GenEvalDetector(detector, colors, nms_iou=cfg.score.detector_nms_iou)


class RewardMix:
    """A weighted sum of registered rewards; also returns each component for the score table."""

    def __init__(self, cfg: Config, weights: Mapping[str, float]):
        unknown = sorted(set(weights) - set(REWARDS))
        if unknown:
            raise KeyError(f"unknown reward {unknown[0]!r}; known: {', '.join(sorted(REWARDS))}")
        self.weights = dict(weights)
        self.models = {name: REWARDS[name](cfg) for name in self.weights}

    def __call__(self, images: Tensor, metadata: Sequence[dict]) -> dict[str, Tensor]:
        """images (B, 3, H, W) -> {reward name: (B,)} plus "mix", their weighted mean."""
        scores = {name: model(images, metadata).float() for name, model in self.models.items()}
        total = sum(self.weights[name] * value for name, value in scores.items())
        return scores | {"mix": total / sum(self.weights.values())}


def parse_mix(text: str) -> dict[str, float]:
    """`"geneval=0.5,shapes_clip"` -> {"geneval": 0.5, "shapes_clip": 1.0} (weight default 1)."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        mix[name.strip()] = float(weight) if weight else 1.0
    return mix
