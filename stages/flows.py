"""Prefect flows: they only order stage tasks; the work lives in the task modules (`stages/`)
and the library (`pipeline/`), which never imports `stages/`.

Every CLI stage runs as a one-task flow inside an MLflow child run; `train` is the flow below,
looping rounds of rollout -> score -> advantages -> update (task modules never import each
other: this flow composes them). `CREDITFLOW_ORCHESTRATION=inline` calls the
task functions directly, without Prefect's temporary API server (about 10 s per process), which
is what the unit tests use; the DVC pipeline and the CLI default to Prefect. `creditflow
with-server CMD` (`make run`) gives every stage of CMD one server (`shared_prefect_server`).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from pipeline.config import Config, CreditflowError
from pipeline.leftovers import claim_prefect_server, stop_orphan_prefect_servers
from stages import STAGES

#: The stages every rank of an `accelerate launch` job takes part in (each holds a shard).
SHARDED_STAGES = ("train", "evaluate", "rescore")


def stage_task(name: str):
    """The Prefect task named `name` in `stages/<name>.py`, or the flow body of that name here
    (a plain function calling tasks)."""
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}")
    if name in FLOWS:
        return FLOWS[name]
    return importlib.import_module(f"stages.{name}").__dict__[name]


def inline() -> bool:
    """Tasks run as plain functions: when asked, and in every rank of a multi-process job
    (each rank's own Prefect server would serve nobody)."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched or os.environ.get("CREDITFLOW_ORCHESTRATION", "prefect") == "inline"


def call(task, *args: Any, **kwargs: Any) -> Any:
    """Run a task: through Prefect inside a flow, or as a plain function when inline."""
    return task.fn(*args, **kwargs) if inline() else task(*args, **kwargs)


def run_stage(name: str, cfg: Config, run_name: str | None = None, **kwargs: Any) -> Any:
    """Run one stage as a flow, inside an MLflow child run of this pipeline run (a resumed
    training run continues its own), named `<stage>/<policy>` when it trains or evaluates one."""
    from pipeline import distributed
    from pipeline.tracking import stage_run

    if not distributed.current().is_main:  # the main rank tracks the job
        if name not in SHARDED_STAGES:  # the other stages run on the main rank alone
            return None
        work = stage_task(name)
        return getattr(work, "fn", work)(cfg, **kwargs)
    policy = _policy_of(name, cfg, kwargs)
    if run_name is None and name in ("train", "evaluate"):
        run_name = f"{name}/{policy}"
    with stage_run(
        cfg,
        name,
        run_name,
        sections=STAGES[name],
        tags=policy_tags(policy) if policy else None,
        continue_run=_continued_run(cfg) if name == "train" else None,
    ):
        work = stage_task(name)
        if inline():
            return getattr(work, "fn", work)(cfg, **kwargs)
        # Prefect reads its settings when first imported: only after configure_environment
        from prefect import flow

        one_line_user_errors()
        claim_prefect_server()
        stop_orphan_prefect_servers()
        prefect_ready()

        @flow(name=f"creditflow-{name}", flow_run_name=run_name or name, validate_parameters=False)
        def stage_flow(cfg: Config, kwargs: dict[str, Any]) -> Any:
            return work(cfg, **kwargs)

        return stage_flow(cfg, kwargs)


def _policy_of(name: str, cfg: Config, kwargs: dict[str, Any]) -> str | None:
    """The policy a stage trains or evaluates: `base` or a training run's name."""
    from pathlib import Path

    from pipeline.layout import run_name

    if name == "train":
        return run_name(cfg.train.method, cfg.train.seed)
    if name == "evaluate":
        return kwargs.get("policy", "base")
    if kwargs.get("run") is not None:  # a per-round stage on a training run
        return Path(kwargs["run"]).name
    return None


def policy_tags(policy: str) -> dict[str, str]:
    """MLflow tags naming a run's policy and, for a training run `<method>-s<seed>`, its method
    and seed, so that runs can be grouped and filtered by them."""
    from pipeline.tracking import METHOD_TAG, POLICY_TAG, SEED_TAG

    method, _, seed = policy.rpartition("-s")
    if policy == "base" or not seed.isdigit():
        return {POLICY_TAG: policy, METHOD_TAG: policy}
    return {POLICY_TAG: policy, METHOD_TAG: method, SEED_TAG: seed}


def _continued_run(cfg: Config) -> str | None:
    from pipeline.layout import train_run
    from pipeline.policy import continued_tracking_run

    return continued_tracking_run(cfg, train_run(cfg))


class _OneLineUserErrors(logging.Filter):
    """Drops the traceback from Prefect's log of a failed task or flow when the error is one the
    user can act on (`CreditflowError`): the CLI prints its one line. `CREDITFLOW_DEBUG=1` keeps
    tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], CreditflowError):
            record.exc_info, record.exc_text = None, None
        return True


def one_line_user_errors() -> None:
    """Install `_OneLineUserErrors` on Prefect's run loggers (once per process)."""
    if os.environ.get("CREDITFLOW_DEBUG"):
        return
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneLineUserErrors) for f in logger.filters):
            logger.addFilter(_OneLineUserErrors())


def prefect_ready() -> None:
    """Start this process's temporary Prefect server unless a real one is configured: the flow
    then uses it (Prefect keeps one per process). With a real server nothing is imported: the
    server module alone took ~3-6 s of every stage's start-up."""
    if os.environ.get("PREFECT_API_URL"):  # a real server: it owns its database
        return
    _start_temporary_server()


def _start_temporary_server():
    """Start Prefect's temporary server while holding a lock on `PREFECT_HOME`: each temporary
    server migrates the database and registers Prefect's block types when it starts, and two
    starting at once on one database collide (three concurrent first uses of a project timed
    out on a failed UNIQUE constraint)."""
    from pathlib import Path

    from prefect.server.api.server import SubprocessASGIServer

    from pipeline.io import file_lock

    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    with file_lock(home / "server-start.lock"):
        server = SubprocessASGIServer()
        server.start()
    return server


@contextmanager
def shared_prefect_server() -> Iterator[str]:
    """One temporary Prefect server for every stage run inside the block; yields its API URL.
    This process owns it (`pipeline.leftovers`: killed with -9, it leaves the server to the next
    stage's orphan cleanup) and stops it when the block ends."""
    claim_prefect_server()
    stop_orphan_prefect_servers()
    server = _start_temporary_server()
    try:
        yield server.api_url
    finally:
        server.stop()


def train(cfg: Config) -> dict[str, float]:
    """The `train` flow (run_stage runs it as one): rounds of rollout -> score -> advantages ->
    update for one method and seed.

    Resumable: each round ends in a checkpoint, and a rerun (`creditflow train` or `dvc repro`,
    whose output is `persist: true`) continues after the newest one, unless the run's inputs
    changed (`pipeline.policy.prepare_run`): then it starts again from round 0. Per-round metrics
    go to MLflow (stepped by round) and to `reports/train/<method>-s<seed>/rounds.json` for
    `dvc plots`; the held-out probe (`stages.probe`) runs on the policy after every
    `train.eval_every` rounds and its curve, against rounds, NFEs and seconds, goes to
    `reports/train/<method>-s<seed>/probe.json`.
    """
    # imported here, not at the top: the other commands import this module and need none of it
    from pipeline import distributed
    from pipeline.layout import train_run, training_prompts
    from pipeline.policy import load_backend, run_lock

    run = train_run(cfg)
    backend = load_backend(cfg)  # first: a bad model path must fail before the run is touched
    training_prompts(cfg)  # and so must training lines that cannot be read or drawn
    ranks = distributed.current()
    if ranks.distributed:
        _bind_to_job()
    # a second train of this run must not move or overwrite its rounds (the main rank holds it)
    with run_lock(run) if ranks.is_main else nullcontext():
        try:
            return _train(cfg, run, backend, ranks)
        except distributed.RankLost:
            # this rank says why it stops; the launcher stopping it as well would cut that short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise


def _bind_to_job() -> None:
    """A rank lives and dies with its job. A launcher killed with SIGKILL cannot stop its ranks,
    so the kernel does (Linux PR_SET_PDEATHSIG): left running, they would go on training the
    run a rerun is about to resume. A launcher stopping a rank (SIGTERM: another rank failed)
    gets one line from it and an exit at once, as after a kill -9 (which a rerun recovers
    from): an exception raised here could land inside a library that rewraps it."""
    from pipeline.distributed import RESUME, RankLost

    def stopped(signum, frame) -> None:
        message = f"error: stopped by the launcher, another rank of this job failed: {RESUME}"
        print(message, file=sys.stderr, flush=True)
        os._exit(RankLost.exit_code)

    signal.signal(signal.SIGTERM, stopped)
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806 (prctl's own name)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _train(cfg: Config, run, backend, ranks) -> dict[str, float]:
    """The rounds of `train`. Over several ranks every rank rolls out, scores and updates its
    shard of each round (the stages gather what the round needs whole); the main rank alone
    moves or records the run, assigns the credit, probes, tracks and writes the reports."""
    from tqdm.auto import tqdm

    from pipeline.distributed import barrier, from_main
    from pipeline.policy import (
        TRACKING_FILE,
        checkpoints,
        load_round_metrics,
        phase_totals,
        prepare_run,
        probe_due,
        probe_file,
        restore,
        round_fits_budget,
        write_run_reports,
    )
    from pipeline.tracking import log_metrics, record_run
    from pipeline.trajectories import prune_rollouts
    from stages.advantages import advantages
    from stages.probe import probe
    from stages.rollout import rollout
    from stages.score import score
    from stages.update import update

    main = ranks.is_main
    if main:
        prepare_run(cfg, run)
        record_run(run / TRACKING_FILE, cfg.root)
    barrier(ranks)
    policy = restore(cfg, run, backend=backend)
    done = checkpoints(run / "checkpoints")
    if main:
        log_missing_rounds(run, done)
    start = max(done, default=-1) + 1
    costs = [load_round_metrics(path)["cost/round_nfe"] for path in done.values()]
    spent, last_cost = sum(costs), (costs[-1] if costs else None)
    bar = tqdm(
        total=cfg.train.rounds, initial=start, desc=f"train {run.name}", unit="round",
        disable=not main,
    )  # fmt: skip

    def probed(rounds: int) -> float | None:
        """The held-out probe of the policy after `rounds` rounds (by the main rank)."""
        value = call(probe, cfg, run, rounds, policy.backend)["probe/geneval"] if main else None
        barrier(ranks)
        return value

    # the base policy, or a resumed checkpoint killed before its probe was written
    if probe_due(cfg, start) and not from_main(probe_file(run, start).is_file(), ranks):
        bar.set_postfix(probe=_short(probed(start)))
    with bar:
        for r in range(start, cfg.train.rounds):
            if not round_fits_budget(cfg.train.nfe_budget, spent, last_cost):
                break
            metrics = call(rollout, cfg, run, r, policy)
            metrics |= call(score, cfg, run, r, policy)
            metrics |= from_main(call(advantages, cfg, run, r) if main else None, ranks)
            metrics |= call(update, cfg, run, r, policy, metrics)
            totals = phase_totals(metrics)
            if main:
                log_metrics(metrics | totals, step=r)
                prune_rollouts(run, keep=cfg.train.keep_rollouts)
            last_cost = totals["cost/round_nfe"]
            spent += last_cost
            shown = {"reward": metrics["reward/mean"], "kl": metrics.get("train/kl")}
            if probe_due(cfg, r + 1):
                shown["probe"] = probed(r + 1)
            bar.set_postfix({k: _short(v) for k, v in shown.items()}, refresh=False)
            bar.update()
    trained = len(checkpoints(run / "checkpoints"))
    if cfg.train.eval_every and not from_main(probe_file(run, trained).is_file(), ranks):
        probed(trained)  # the final policy
    return write_run_reports(cfg, run) if main else {}


def _short(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def log_missing_rounds(run, done) -> None:
    """Log the finished rounds and probes that the MLflow run lacks (a command killed between a
    round's checkpoint and its log, or a run tracked elsewhere before), at their steps."""
    from pipeline.policy import load_round_metrics, read_probes
    from pipeline.tracking import log_metrics, logged_steps

    rounds, probes = logged_steps("reward/mean"), logged_steps("probe/geneval")
    for r, path in done.items():
        if r not in rounds:
            log_metrics(load_round_metrics(path), step=r)
    for n, metrics in read_probes(run).items():
        if n not in probes:
            log_metrics(metrics, step=n)


FLOWS = {"train": train}  # stages whose work is a flow of this module, not a task module
