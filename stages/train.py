"""`train` flow: rounds of rollout -> score -> advantages -> update for one method and seed.

Resumable: each round ends in a checkpoint, and a rerun (`creditflow train` or `dvc repro`, whose
output is `persist: true`) continues after the newest one, unless the run's inputs changed
(`pipeline.policy.prepare_run`): then it starts again from round 0. Per-round metrics go to MLflow
(stepped by round) and to `reports/train/<method>-s<seed>/rounds.json` for `dvc plots`; the
held-out probe (`stages.probe`) runs on the policy after every `train.eval_every` rounds and its
curve, against rounds, NFEs and seconds, goes to `reports/train/<method>-s<seed>/probe.json`.
"""

from __future__ import annotations

import shutil

import numpy as np
from prefect import flow

from pipeline import layout
from pipeline.config import Config
from pipeline.flows import call
from pipeline.io import write_json
from pipeline.policy import checkpoints, load_backend, prepare_run, restore, run_lock
from pipeline.tracking import log_metrics
from pipeline.trajectories import STEPS, list_rounds, round_dir
from stages.advantages import advantages
from stages.probe import probe, probe_due, probe_file, read_probes
from stages.rollout import rollout
from stages.score import score
from stages.update import update


@flow(name="creditflow-train", validate_parameters=False)
def train(cfg: Config) -> dict[str, float]:
    run = layout.train_run(cfg)
    backend = load_backend(cfg)  # first: a bad model path must fail before the run is touched
    with run_lock(run):  # a second train of this run must not move or overwrite its rounds
        return _train(cfg, run, backend)


def _train(cfg: Config, run, backend) -> dict[str, float]:
    prepare_run(cfg, run)
    policy = restore(cfg, run, backend=backend)
    done = checkpoints(run / "checkpoints")
    start = max(done, default=-1) + 1
    spent = sum(load_round_metrics(path)["cost/round_nfe"] for path in done.values())
    # the base policy, or a resumed checkpoint killed before its probe was written
    if probe_due(cfg, start) and not probe_file(run, start).is_file():
        call(probe, cfg, run, start, policy.backend)
    for r in range(start, cfg.train.rounds):
        if cfg.train.nfe_budget and spent >= cfg.train.nfe_budget:
            break
        metrics = call(rollout, cfg, run, r, policy)
        metrics |= call(score, cfg, run, r, policy)
        metrics |= call(advantages, cfg, run, r)
        metrics |= call(update, cfg, run, r, policy, metrics)
        log_metrics(metrics | phase_totals(metrics), step=r)
        spent += phase_totals(metrics)["cost/round_nfe"]
        prune_rollouts(run, keep=cfg.train.keep_rollouts)
        if probe_due(cfg, r + 1):
            call(probe, cfg, run, r + 1, policy.backend)
    trained = len(checkpoints(run / "checkpoints"))
    if cfg.train.eval_every and not probe_file(run, trained).is_file():  # the final policy
        call(probe, cfg, run, trained, policy.backend)
    probes = read_probes(run)
    history = [
        {"round": r} | load_round_metrics(path) | probes.get(r + 1, {})
        for r, path in checkpoints(run / "checkpoints").items()
    ]
    report = cfg.path(layout.REPORTS / "train" / run.name)
    write_json(report / "rounds.json", history)
    write_json(report / "probe.json", probe_curve(history, probes))
    summary = summarize(history)
    write_json(report / "metrics.json", summary)
    return summary


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
    phases = ("rollout", "score", "update")
    return {
        "time/round_s": sum(metrics.get(f"time/{p}_s", 0.0) for p in phases),
        "cost/round_nfe": sum(metrics.get(f"cost/{p}_nfe", 0.0) for p in phases),
    }


def load_round_metrics(checkpoint) -> dict[str, float]:
    import json

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


def prune_rollouts(run, keep: int) -> None:
    """Drop the cached states of all but the newest `keep` rounds (0 keeps all)."""
    if keep == 0:
        return
    for r in list_rounds(run / "rollouts", STEPS)[:-keep]:
        shutil.rmtree(round_dir(run / "rollouts", STEPS, r))
