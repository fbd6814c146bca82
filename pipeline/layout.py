"""Where every artifact lives, relative to the project root (mirrors dvc.yaml's outs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import Config, ConfigError, CreditflowError

if TYPE_CHECKING:
    from pipeline.trajectories import RoundRollout

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


def trajectory_metadata(cfg: Config, rollout: RoundRollout) -> list[dict]:
    """GenEval lines of a cached round's trajectories: the train-split lines its cached prompt ids
    name (a line's `id`, else its index). A line whose prompt is not the cached one means the
    train prompts changed since the round was sampled: one clear error, not a silent rematch."""
    lines = load_prompts(cfg, "train")
    by_id = {str(line.get("id", index)): line for index, line in enumerate(lines)}
    found = []
    for prompt_id, prompt in zip(rollout.prompt_ids, rollout.prompts, strict=True):
        line = by_id.get(prompt_id)
        if line is None or line["prompt"] != prompt:
            raise CreditflowError(
                f"round {rollout.round} was sampled with train prompt {prompt_id} = {prompt!r}, "
                f"which data/prompts/train.jsonl no longer holds: restore those prompts, or roll "
                "the round out again"
            )
        found.append(line)
    return found
