"""Offline environment and MLflow tracking, from one place.

Layout in MLflow (`MLFLOW_TRACKING_URI` when set, else `sqlite:///<repo>/mlflow.db` with
artifacts under `<repo>/mlruns`; `<repo>` is DVC's `DVC_ROOT`, so that `dvc exp run --temp` and
`--queue`, which run in a temporary copy, track into the project): one experiment `creditflow`;
one *parent* run per pipeline run; one *child* per stage invocation (per method and seed for
training). Every process of one `dvc repro` finds the same parent through the
`creditflow.pipeline` tag: a hash of the params file and the git commit, so an unchanged pipeline
run keeps adding to its parent while `dvc exp run -S ...` (new params) opens a new one. Set
`CREDITFLOW_PIPELINE_RUN` to group runs by hand. Parents are named after the DVC experiment
(`DVC_EXP_NAME`) when there is one and carry the git commit and the params digest as tags.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.io import file_lock, write_json
from pipeline.leftovers import mark_killed_runs, run_owner_tags

if TYPE_CHECKING:
    import mlflow

    from pipeline.config import Config

EXPERIMENT = "creditflow"
PIPELINE_TAG = "creditflow.pipeline"  # on every run of one pipeline run
PARENT_TAG = "creditflow.parent"  # on the parent run alone
STAGE_TAG = "creditflow.stage"
COMMIT_TAG = "creditflow.git_commit"
PARAMS_TAG = "creditflow.params_digest"
EXPERIMENT_TAG = "creditflow.dvc_experiment"
POLICY_TAG = "creditflow.policy"  # base, or the training run a run trains or evaluates
METHOD_TAG = "creditflow.method"
SEED_TAG = "creditflow.seed"
DATABASE = "mlflow.db"


def configure_environment(root: Path) -> None:
    """Offline, quiet defaults for every library; call before importing prefect or mlflow."""
    defaults = {
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DISABLE_TELEMETRY": "1",  # diffusers
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_HOME": str(root / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Tasks called outside a flow (tests, single stages) have no flow run to attach logs to.
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "PREFECT_UI_ENABLED": "false",
        # A fresh PREFECT_HOME migrates its database first; Prefect's 20 s default is too short
        # for that on a loaded 2-core machine (the temporary server then fails to start).
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    for noisy in ("alembic", "mlflow.store.db.utils", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def tracking_root(root: Path) -> Path:
    """The project the runs belong to: DVC's root when DVC runs the stage (a `--temp` or
    `--queue` experiment runs in a temporary copy that is deleted afterwards), else `root`."""
    return Path(os.environ.get("DVC_ROOT") or root).resolve()


def tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI` when the user set one, else the project's own sqlite database."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tracking_root(root) / DATABASE}"


def params_digest(cfg: Config) -> str:
    """The params file's bytes, hashed (the validated config when there is no file).

    The file, not the validated config: a stage's own `-S` overrides (the method and seed of a
    training run) must not split one `dvc repro` into several parents.
    """
    source = cfg.params_file.read_bytes() if cfg.params_file else cfg.model_dump_json().encode()
    return hashlib.sha256(source).hexdigest()[:12]


def pipeline_key(cfg: Config) -> str:
    """Identity of one pipeline run: the params digest + git commit (or the env override)."""
    if key := os.environ.get("CREDITFLOW_PIPELINE_RUN"):
        return key
    digest = hashlib.sha256(params_digest(cfg).encode())
    digest.update(_git_head(cfg.root).encode())
    return digest.hexdigest()[:12]


def _git_head(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
        )
    except OSError:
        return ""
    return out.stdout.strip()


def _experiment_id(root: Path) -> str:
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    found = mlflow.get_experiment_by_name(EXPERIMENT)
    if found is not None:
        return found.experiment_id
    # the project's own store keeps artifacts next to it; another store chooses its own place
    own_store = "MLFLOW_TRACKING_URI" not in os.environ
    artifacts = (tracking_root(root) / "mlruns").as_uri() if own_store else None
    return mlflow.create_experiment(EXPERIMENT, artifact_location=artifacts)


def _parent_run_id(cfg: Config, experiment_id: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    key = pipeline_key(cfg)
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{key}'", max_results=1
    )
    if found:
        return found[0].info.run_id
    experiment = os.environ.get("DVC_EXP_NAME", "")
    tags = {
        PARENT_TAG: key,
        PIPELINE_TAG: key,
        COMMIT_TAG: _git_head(cfg.root),
        PARAMS_TAG: params_digest(cfg),
    } | ({EXPERIMENT_TAG: experiment} if experiment else {})
    run = client.create_run(experiment_id, run_name=experiment or f"pipeline-{key}", tags=tags)
    client.log_batch(run.info.run_id, params=_params(cfg.flat()))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _params(flat: Mapping[str, Any]) -> list[mlflow.entities.Param]:
    from mlflow.entities import Param

    return [Param(key, str(value)[:500]) for key, value in sorted(flat.items())]


def stage_params(cfg: Config, sections: Iterable[str] | None) -> dict[str, str]:
    """The flattened params under `sections` (a section such as `model`, or one key such as
    `train.rounds`; all of them when None), as MLflow params (strings of at most 500 chars)."""
    flat = cfg.flat()
    if sections is not None:
        wanted = tuple(sections)
        flat = {
            k: v for k, v in flat.items() if any(k == w or k.startswith(w + ".") for w in wanted)
        }
    return {key: str(value)[:500] for key, value in flat.items()}


def continuable_run(record: Path, root: Path) -> str | None:
    """The MLflow run id that `record` (written by `record_run`) names, when it is a run of the
    current tracking store that still exists; else None."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not record.is_file():
        return None
    saved = json.loads(record.read_text())
    uri = tracking_uri(root)
    if saved.get("tracking_uri") != uri:
        return None
    try:
        found = MlflowClient(uri).get_run(saved["run_id"])
    except MlflowException:  # the store was reset or the run deleted
        return None
    return found.info.run_id if found.info.lifecycle_stage == "active" else None


def record_run(record: Path, root: Path) -> None:
    """Name the active MLflow run in `record` (an output's own file), so that resuming that
    output continues the same run (no-op outside a run)."""
    import mlflow

    if (active := mlflow.active_run()) is not None:
        write_json(record, {"run_id": active.info.run_id, "tracking_uri": tracking_uri(root)})


@contextmanager
def stage_run(
    cfg: Config,
    stage: str,
    name: str | None = None,
    *,
    sections: Iterable[str] | None = None,
    tags: Mapping[str, str] | None = None,
    continue_run: str | None = None,
) -> Iterator[mlflow.ActiveRun]:
    """A child run of this pipeline run's parent, with the params under `sections` (the ones
    that shape the stage; all when None) logged at start and `tags` set.

    Runs left RUNNING by a killed command are marked KILLED first (`pipeline.leftovers`).
    `continue_run` (a resumed training run's own run, `continuable_run`) is re-opened instead
    of a new child: one run then holds all of its rounds, and ends FINISHED once they are done.
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    # one process at a time: the first use creates the database schema, and two stages of one
    # pipeline run must find (not both create) its parent run
    with file_lock(tracking_root(cfg.root) / f"{DATABASE}.lock"):
        experiment_id = _experiment_id(cfg.root)
        mark_killed_runs(MlflowClient(), experiment_id)
        parent = _parent_run_id(cfg, experiment_id)
    params = stage_params(cfg, sections)
    all_tags = {STAGE_TAG: stage, **(tags or {}), **run_owner_tags()}
    if continue_run is not None:
        logged = MlflowClient().get_run(continue_run).data.params
        params = {k: v for k, v in params.items() if k not in logged}  # speed keys may differ
        started = mlflow.start_run(run_id=continue_run, tags=all_tags)
    else:
        started = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=name or stage,
            tags={"mlflow.parentRunId": parent, PIPELINE_TAG: pipeline_key(cfg), **all_tags},
        )
    with started as run:
        mlflow.log_params(params)
        yield run


def log_parent_metrics(metrics: Mapping[str, float]) -> None:
    """Log finite scalar metrics onto the active run's parent (the pipeline run), so that it
    carries the experiment's summary (no-op outside a child run)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    active = mlflow.active_run()
    parent = active and MlflowClient().get_run(active.info.run_id).data.tags.get(
        "mlflow.parentRunId"
    )
    if parent:
        log_run_metrics(parent, metrics)


def log_run_metrics(run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
    """Log finite scalar metrics onto another run of the tracking store (evaluation results
    onto the training run they evaluate)."""
    import time

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    batch = [Metric(k, v, now, step) for k, v in _finite(metrics).items()]
    if batch:
        MlflowClient().log_batch(run_id, metrics=batch)


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    import math

    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log finite scalar metrics to the active run (no-op outside one)."""
    import mlflow

    if mlflow.active_run() is None:
        return
    if clean := _finite(metrics):
        mlflow.log_metrics(clean, step=step)


def logged_steps(key: str) -> set[int]:
    """The steps at which the active run has metric `key` (empty outside a run)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    active = mlflow.active_run()
    if active is None:
        return set()
    return {m.step for m in MlflowClient().get_metric_history(active.info.run_id, key)}


def log_artifact(path: Path, folder: str | None = None) -> None:
    """Attach a file (a sample grid, a plot) to the active run, under `folder` of its artifacts
    (no-op outside a run)."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path), artifact_path=folder)


def evaluation_runs(root: Path, pipeline: str | None = None) -> list[dict[str, Any]]:
    """The newest finished `evaluate` run of each policy in the tracking store (of one pipeline
    run, a `creditflow.pipeline` key, when given): [{policy, method, seed, pipeline, metrics}],
    sorted by policy; metrics are the run's `geneval/...` scores."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(root))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    query = f"tags.`{STAGE_TAG}` = 'evaluate' and attributes.status = 'FINISHED'"
    if pipeline:
        query += f" and tags.`{PIPELINE_TAG}` = '{pipeline}'"
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"]
    )
    newest: dict[str, dict[str, Any]] = {}
    for run in runs:
        tags = run.data.tags
        policy = tags.get(POLICY_TAG) or run.info.run_name.removeprefix("evaluate/")
        if policy in newest:
            continue
        newest[policy] = {
            "policy": policy,
            "method": tags.get(METHOD_TAG, policy),
            "seed": int(tags[SEED_TAG]) if tags.get(SEED_TAG, "").isdigit() else None,
            "pipeline": tags.get(PIPELINE_TAG, ""),
            "metrics": {k: v for k, v in run.data.metrics.items() if k.startswith("geneval/")},
        }
    return [newest[p] for p in sorted(newest)]
