"""Where every artifact lives, relative to the project root (mirrors dvc.yaml's outs)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import Config, ConfigError, CreditflowError

PROMPTS = Path("data/prompts")
BASE = Path("data/base")
PRETRAINED = BASE / "pretrained"  # the base model's first pretraining cycle (`refine` reads it)
TRAIN = Path("data/train")
EVAL = Path("data/eval")
REPORTS = Path("reports")


def run_name(method: str, seed: int) -> str:
    return f"{method}-s{seed}"


def train_run(cfg: Config, method: str | None = None, seed: int | None = None) -> Path:
    """A training run's directory: rollouts/, scores, advantages/, checkpoints/."""
    method = method or cfg.train.method
    seed = cfg.train.seed if seed is None else seed
    return cfg.path(TRAIN / run_name(method, seed))


def prompts_file(cfg: Config, split: str) -> Path:
    path = cfg.path(PROMPTS / f"{split}.jsonl")
    if not path.is_file():
        raise ConfigError(f"prompts: {path} is missing (run `creditflow prompts` first)")
    return path


def load_prompts(cfg: Config, split: str) -> list[dict]:
    from pipeline import world

    return world.read_prompts(prompts_file(cfg, split))


def trajectory_metadata(cfg: Config, prompts: list[str]) -> list[dict]:
    """GenEval lines of the rollout's prompts, looked up by prompt text in the train set."""
    by_text = {row["prompt"]: row for row in load_prompts(cfg, "train")}
    missing = sorted({p for p in prompts if p not in by_text})
    if missing:
        raise CreditflowError(f"score: prompt {missing[0]!r} is not in the train prompt set")
    return [by_text[p] for p in prompts]
