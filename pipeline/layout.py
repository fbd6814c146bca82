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


def training_split(cfg: Config) -> str:
    """The split a run's training lines come from: the test split under
    `rollout.train_on_test`, else the train split."""
    return "test" if cfg.rollout.train_on_test else "train"


def training_prompts_file(cfg: Config) -> Path:
    return prompts_file(cfg, training_split(cfg))


def trained_test_lines(cfg: Config, test: list[dict]) -> list[int]:
    """Indices into `test` of the lines trained on under `rollout.train_on_test` = n: the
    first n lines of each tag, in the split's order (none when off)."""
    n = cfg.rollout.train_on_test
    picked: dict[str, list[int]] = {}
    for index, line in enumerate(test):
        if len(found := picked.setdefault(line["tag"], [])) < n:
            found.append(index)
    if short := {tag: len(found) for tag, found in picked.items() if len(found) < n}:
        raise ConfigError(f"rollout.train_on_test={n}: the test split has only {short} lines")
    return sorted(i for found in picked.values() for i in found)


def training_prompts(cfg: Config) -> list[dict]:
    """The lines a run trains on: the train split, or under `rollout.train_on_test` = n the
    first n test lines of each tag (in the test split's order, so prompt ids index them)."""
    lines = load_prompts(cfg, training_split(cfg))
    if not cfg.rollout.train_on_test:
        return lines
    return [lines[i] for i in trained_test_lines(cfg, lines)]


def trajectory_metadata(cfg: Config, rollout: RoundRollout) -> list[dict]:
    """GenEval lines of a cached round's trajectories: the train-split lines its cached prompt ids
    name (a line's `id`, else its index). A line whose prompt is not the cached one means the
    train prompts changed since the round was sampled: one clear error, not a silent rematch."""
    lines = training_prompts(cfg)
    by_id = {str(line.get("id", index)): line for index, line in enumerate(lines)}
    found = []
    for prompt_id, prompt in zip(rollout.prompt_ids, rollout.prompts, strict=True):
        line = by_id.get(prompt_id)
        if line is None or line["prompt"] != prompt:
            raise CreditflowError(
                f"round {rollout.round} was sampled with train prompt {prompt_id} = {prompt!r}, "
                f"which {training_prompts_file(cfg)} no longer holds: restore those prompts, or "
                "roll the round out again"
            )
        found.append(line)
    return found
