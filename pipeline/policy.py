"""The trained policy: a backend with LoRA adapters, its optimizer, and per-round checkpoints.

A checkpoint is a directory `round-<r>/` holding `lora.safetensors`, `optimizer.pt` (AdamW
state), `rng.pt` (torch's global RNG) and `metrics.json`, written atomically, so the latest
complete one is where a killed run resumes. Per-round randomness is derived from (seed, round)
(`pipeline.rounds.generator`), so a resumed run replays the same draws as an uninterrupted one.
A run also records the inputs its rounds depend on (`inputs.json`); a run whose inputs changed
(another base model, prompt split or params) starts again from round 0 instead of resuming, since
DVC keeps the `persist: true` run directory across `dvc repro` / `dvc exp run -S`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.config import Config, ConfigError, CreditflowError
from pipeline.grpo import add_lora, load_lora_state, lora_parameters, lora_state_dict
from pipeline.io import atomic_path, file_lock, write_json
from pipeline.layout import REPORTS
from pipeline.schedules import lr_factor

_CHECKPOINT = re.compile(r"^round-(\d+)$")
INPUTS_FILE = "inputs.json"
TRACKING_FILE = "tracking.json"  # the MLflow run that a training run's rounds are logged to
# Config a run's rounds depend on; train.rounds and train.keep_rollouts are left out, so that
# raising the round count extends a finished run, and so are the settings that only change
# speed or what is kept for the report, so that tuning them resumes the run.
_RUN_SECTIONS = ("model", "sampling", "rollout", "score", "advantages", "update")
_RUN_KEYS = ("train.method", "train.seed")
_SPEED_KEYS = (
    "model.device",
    "score.batch_size",
    "score.reward_batch_size",
    "score.reward_workers",
    "score.estimate_images",
    "update.micro_batch_size",
)
# Keys added after runs were first recorded, with the value those runs implicitly used: a run's
# inputs name them only when they differ, so that a finished run still resumes on newer code.
_ADDED_KEYS = {
    "update.lr_decay": '"constant"',
    "advantages.final_reward_steps": "0",
    "rollout.train_on_test": "0",
}
REPLACED_DIR = ".replaced"  # data/train/.replaced/<run>-<time>: runs set aside by a restart
LOCKS_DIR = ".locks"  # data/train/.locks/<run>.lock: who is training a run now
_CONTENT_HASH_LIMIT = 64 * 2**20  # bytes; larger files (SD3.5 weights) go by size and mtime


def load_backend(cfg: Config):
    """The base policy named by `model.backend` / `model.path` (never downloads)."""
    path = cfg.path(cfg.model.path)
    if cfg.model.backend == "shapes":
        from pipeline.models import BACKEND_FILE, ShapesBackend

        if not (path / BACKEND_FILE).is_file():
            raise ConfigError(
                f"model.path: no ShapesWorld model at {path} (run `creditflow base` first)"
            )
        return ShapesBackend.from_pretrained(path)
    from pipeline.sd3 import load_sd3

    return load_sd3(cfg)


@dataclass
class Policy:
    """A backend whose transformer carries trainable LoRA adapters, and their optimizer."""

    backend: object
    optimizer: torch.optim.Optimizer

    @classmethod
    def create(cls, cfg: Config, backend=None) -> Policy:
        """Fresh adapters on the base model; their random init depends only on `train.seed`."""
        from pipeline.rounds import derived_seed

        backend = backend if backend is not None else load_backend(cfg)
        up = cfg.update
        with torch.random.fork_rng():
            torch.manual_seed(derived_seed(cfg.train.seed, "lora"))
            add_lora(
                backend.transformer,
                rank=up.lora_rank,
                alpha=up.lora_alpha,
                targets=list(backend.lora_target_modules),
            )
        for param in lora_parameters(backend.transformer):
            param.data = param.data.float()  # peft copies a bf16/fp16 base's dtype; train in fp32
        optimizer = torch.optim.AdamW(
            lora_parameters(backend.transformer), lr=up.lr, weight_decay=up.weight_decay
        )
        return cls(backend, optimizer)

    def save(self, directory: Path, round_index: int, metrics: dict[str, float]) -> Path:
        """Write checkpoint `directory/round-<r>` atomically; returns it."""
        target = Path(directory) / f"round-{round_index:04d}"
        with atomic_path(target) as tmp:
            tmp.mkdir(parents=True)
            save_file(lora_state_dict(self.backend.transformer), tmp / "lora.safetensors")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(torch.get_rng_state(), tmp / "rng.pt")
            (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        return target

    def schedule_lr(self, cfg: Config, run: Path, round_index: int) -> dict[str, float]:
        """Set round `round_index`'s step size (`round_lr`, from the NFEs the run's earlier
        checkpoints spent); {"train/lr": lr} when `update.lr_decay` decays it, else {}."""
        if cfg.update.lr_decay == "constant":
            return {}
        done = checkpoints(Path(run) / "checkpoints")
        spent = sum(load_round_metrics(path)["cost/round_nfe"]
                    for r, path in done.items() if r < round_index)  # fmt: skip
        lr = round_lr(cfg, round_index, spent)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return {"train/lr": lr}

    def load(self, checkpoint: Path, *, with_optimizer: bool = True) -> None:
        checkpoint = Path(checkpoint)
        if not (checkpoint / "lora.safetensors").is_file():
            raise ConfigError(f"checkpoint: no lora.safetensors in {checkpoint}")
        path = checkpoint / "lora.safetensors"
        try:
            load_lora_state(self.backend.transformer, load_file(path))
            if with_optimizer:
                path = checkpoint / "optimizer.pt"
                self.optimizer.load_state_dict(torch.load(path))
                path = checkpoint / "rng.pt"
                torch.set_rng_state(torch.load(path))
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:  # truncated, corrupt
            raise CheckpointError(
                f"{path}: unreadable checkpoint file ({str(exc).splitlines()[0]}); move the "
                f"round aside (e.g. {checkpoint.name}.broken) to resume from the one before"
            ) from exc


def checkpoints(directory: Path) -> dict[int, Path]:
    """Complete checkpoints under `directory`, by round."""
    found = {}
    if Path(directory).is_dir():
        for child in Path(directory).iterdir():
            match = _CHECKPOINT.match(child.name)
            if match and (child / "metrics.json").is_file():
                found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def restore(cfg: Config, run: Path, before_round: int | None = None, backend=None) -> Policy:
    """A policy at its newest checkpoint in `run/checkpoints` older than `before_round`."""
    policy = Policy.create(cfg, backend)
    done = {r: p for r, p in checkpoints(Path(run) / "checkpoints").items()
            if before_round is None or r < before_round}  # fmt: skip
    if done:
        policy.load(done[max(done)])
    return policy


def file_digest(path: Path) -> str:
    """One sha256 over a directory's (or one file's) files: each file's relative path and
    content hash, or for files over 64 MiB its size and mtime (hashing GBs of weights per run
    start is too slow)."""
    from pipeline.trajectories import sha256_file

    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    entries = {}
    for file in files:
        stat = file.stat()
        name = file.relative_to(path).as_posix() if path.is_dir() else file.name
        entries[name] = (
            f"{stat.st_size}:{stat.st_mtime_ns}"
            if stat.st_size > _CONTENT_HASH_LIMIT
            else sha256_file(file)
        )
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def run_inputs(cfg: Config) -> dict[str, str]:
    """What a training run's rounds depend on, flattened: the `train` stage's config sections,
    the method and seed, and digests of the base model and the train prompts."""
    from pipeline.layout import training_prompts_file

    flat = cfg.flat()
    inputs = {
        key: json.dumps(value, sort_keys=True)
        for key, value in flat.items()
        if (key.split(".")[0] in _RUN_SECTIONS or key in _RUN_KEYS) and key not in _SPEED_KEYS
    }
    for key, implicit in _ADDED_KEYS.items():
        if inputs.get(key) == implicit:
            del inputs[key]
    for name, path in [
        ("base_model", cfg.path(cfg.model.path)),
        ("prompts", training_prompts_file(cfg)),
    ]:
        inputs[f"digest.{name}"] = file_digest(path) if path.exists() else "missing"
    return inputs


def changed_inputs(inputs: dict[str, str], recorded: dict[str, str]) -> list[str]:
    """The keys whose values differ between two `run_inputs` records, sorted."""
    return sorted(k for k in inputs.keys() | recorded.keys() if inputs.get(k) != recorded.get(k))


def check_same_sampling(cfg: Config, run: Path) -> None:
    """ConfigError unless the config samples the way `run` was trained (its `inputs.json`):
    the same model, schedule and SDE (`model`, `sampling`, `rollout` params and base model
    digest). Runs without a record (bare rollout caches) pass."""
    record = Path(run) / INPUTS_FILE
    if not record.is_file():
        return
    recorded = json.loads(record.read_text())
    sections = ("model.", "sampling.", "rollout.", "digest.base_model")
    inputs = run_inputs(cfg)
    changed = [k for k in changed_inputs(inputs, recorded) if k.startswith(sections)]
    if changed:
        key = changed[0]
        raise ConfigError(
            f"{key}: {run} was trained with {recorded.get(key, 'none')}, the params give "
            f"{inputs.get(key, 'none')} ({len(changed)} such difference(s): use the run's params)"
        )


class CheckpointError(CreditflowError):
    """A checkpoint file that cannot be read back."""


class RunLockedError(CreditflowError):
    """Another process is training the same run."""

    exit_code = 3


@contextmanager
def run_lock(run: Path) -> Iterator[None]:
    """Hold an exclusive lock on training run `run` (`<runs>/.locks/<run>.lock`), or raise
    RunLockedError naming the holder. The lock is an flock: the kernel drops it when its holder
    exits or is killed, so a crashed run never leaves a stale lock; the file stays, with the
    last holder's pid, host and start time."""
    path = Path(run).parent / LOCKS_DIR / f"{Path(run).name}.lock"
    with ExitStack() as stack:
        try:
            handle = stack.enter_context(file_lock(path, wait=False))
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise RunLockedError(
                f"{run} is being trained by {holder}; wait for it to finish or stop it"
            ) from None
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        handle.flush()
        yield


def prepare_run(cfg: Config, run: Path) -> None:
    """Keep `run` for resuming when it was made from these inputs; otherwise move it aside to
    `<runs>/.replaced/<run>-<time>` (warning what changed and where it went when it held
    checkpoints) so that training starts at round 0. Records the inputs in `run/inputs.json`.
    Call it only once the backend has loaded: a command that then fails must not have moved a
    finished run."""
    run = Path(run)
    inputs = run_inputs(cfg)
    record = run / INPUTS_FILE
    recorded = json.loads(record.read_text()) if record.is_file() else None
    if recorded == inputs:
        return
    if checkpoints(run / "checkpoints"):
        if recorded is None:
            why = "no record of its inputs"
        else:
            changed = changed_inputs(inputs, recorded)
            more = len(changed) - 6
            why = "changed: " + ", ".join(changed[:6]) + (f" and {more} more" if more > 0 else "")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = run.parent / REPLACED_DIR / f"{run.name}-{stamp}"
        for n in range(2, 1000):  # two restarts within a second
            if not aside.exists():
                break
            aside = aside.with_name(f"{run.name}-{stamp}-{n}")
        aside.parent.mkdir(parents=True, exist_ok=True)
        run.rename(aside)
        warnings.warn(
            f"{run.name}: its checkpoints were trained from other inputs ({why}); "
            f"training again from round 0 (the old run is kept in {aside})",
            RuntimeWarning,
            stacklevel=2,
        )
    elif run.exists():  # no finished round: nothing to keep
        shutil.rmtree(run)
    write_json(record, inputs)


def continued_tracking_run(cfg: Config, run: Path) -> str | None:
    """The MLflow run to continue when `run` resumes (the run its rounds so far went to, named
    in `run/tracking.json`); None when it starts afresh: no finished round, or other inputs
    (`prepare_run` then moves it aside)."""
    from pipeline.tracking import continuable_run

    record = Path(run) / INPUTS_FILE
    if not checkpoints(Path(run) / "checkpoints") or not record.is_file():
        return None
    if json.loads(record.read_text()) != run_inputs(cfg):
        return None
    return continuable_run(Path(run) / TRACKING_FILE, cfg.root)


def write_run_reports(cfg: Config, run: Path) -> dict[str, float]:
    """A training run's DVC outputs from its checkpoints and probes:
    `reports/train/<run>/{rounds,probe,metrics}.json`; returns the summary metrics."""
    probes = read_probes(run)
    history = [
        {"round": r} | load_round_metrics(path)
        for r, path in checkpoints(run / "checkpoints").items()
    ]
    report = cfg.path(REPORTS / "train" / run.name)
    write_json(report / "rounds.json", uniform_rows(history))
    write_json(report / "probe.json", probe_curve(history, probes))
    summary = summarize(history)
    write_json(report / "metrics.json", summary)
    return summary


def uniform_rows(rows: list[dict]) -> list[dict]:
    """The keys that every row has (`dvc plots` cannot render a file whose rows differ): a
    round's accuracy on one tag is there only when every round drew that tag."""
    common = set.intersection(*(set(row) for row in rows)) if rows else set()
    return [{k: v for k, v in row.items() if k in common} for row in rows]


def probe_curve(history: list[dict], probes: dict[int, dict]) -> list[dict]:
    """Uniform rows for `dvc plots`: each probe with the rounds, NFEs and seconds spent to reach
    it (n = 0 is the base policy)."""
    nfe = np.cumsum([0.0] + [h["cost/round_nfe"] for h in history]).tolist()
    seconds = np.cumsum([0.0] + [h["time/round_s"] for h in history]).tolist()
    return [
        {"rounds": n, "nfe": nfe[n], "seconds": seconds[n]} | metrics
        for n, metrics in probes.items()
        if n < len(nfe)
    ]


def phase_totals(metrics: dict[str, float]) -> dict[str, float]:
    """A round's wall-clock and NFEs over its three phases."""
    phases = ("rollout", "score", "update")
    return {
        "time/round_s": sum(metrics.get(f"time/{p}_s", 0.0) for p in phases),
        "cost/round_nfe": sum(metrics.get(f"cost/{p}_nfe", 0.0) for p in phases),
    }


def round_fits_budget(budget: float, spent: float, last_round_nfe: float | None) -> bool:
    """Whether a run may train another round under `train.nfe_budget` (0 = no budget).

    A method's rounds cost the same NFEs each (fixed prompts, group size and schedule), so the
    next round is predicted to cost what the last one did; a run stops before the round that
    would take it over the budget, so that no method trains on more NFEs than the budget. The
    first round (nothing measured yet) always runs.
    """
    if not budget or last_round_nfe is None:
        return True
    return spent + last_round_nfe <= budget


def round_lr(cfg: Config, round_index: int, spent_nfe: float) -> float:
    """The step size of round `round_index` under `update.lr_decay`: `update.lr`, or a cosine
    decay from it to lr / 10 over the run's progress before the round, the NFEs already spent
    over `train.nfe_budget` (rounds done over `train.rounds` without a budget). Progress by
    NFEs gives methods compared at equal NFE equal step sizes at equal NFE."""
    if cfg.update.lr_decay == "constant":
        return cfg.update.lr
    budget = cfg.train.nfe_budget
    progress = spent_nfe / budget if budget else round_index / cfg.train.rounds
    return cfg.update.lr * lr_factor(progress, warmup=0, total=1.0)


def load_round_metrics(checkpoint: Path) -> dict[str, float]:
    """A checkpointed round's metrics, with its phase totals."""
    metrics = json.loads((checkpoint / "metrics.json").read_text())
    return metrics | phase_totals(metrics)


def summarize(history: list[dict[str, float]]) -> dict[str, float]:
    """DVC metrics of a run: first/last reward, accuracy, total cost."""
    if not history:
        return {}
    first, last = history[0], history[-1]
    return {
        "rounds": len(history),
        "reward_first": first["reward/mean"],
        "reward_last": last["reward/mean"],
        "accuracy_last": last["train/accuracy"],
        "seconds_total": sum(h["time/round_s"] for h in history),
        "nfe_total": sum(h["cost/round_nfe"] for h in history),
    }


PROBE_DIR = "probe"


def probe_due(cfg: Config, rounds_done: int) -> bool:
    """Whether the policy after `rounds_done` rounds is probed on the way (the train flow also
    probes the final policy, wherever the run stops)."""
    every = cfg.train.eval_every
    return every > 0 and rounds_done % every == 0


def probe_file(run: Path, rounds_done: int) -> Path:
    return Path(run) / PROBE_DIR / f"rounds={rounds_done:04d}.json"


def read_probes(run: Path) -> dict[int, dict[str, float]]:
    """{rounds trained: probe metrics} of a run, in round order."""
    files = sorted((Path(run) / PROBE_DIR).glob("rounds=*.json"))
    return {int(f.stem.split("=")[1]): json.loads(f.read_text()) for f in files}
