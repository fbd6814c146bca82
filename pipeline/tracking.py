"""Offline environment and MLflow tracking, from one place.

Layout in MLflow (`sqlite:///<repo>/mlflow.db`, artifacts under `<repo>/mlruns`): one experiment
`creditflow`; one *parent* run per pipeline run; one *child* per stage invocation (per method and
seed for training). Every process of one `dvc repro` finds the same parent through the
`creditflow.pipeline` tag: a hash of the params file and the git commit, so an unchanged pipeline
run keeps adding to its parent while `dvc exp run -S ...` (new params) opens a new one. Set
`CREDITFLOW_PIPELINE_RUN` to group runs by hand.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.io import file_lock
from pipeline.leftovers import mark_killed_runs, run_owner_tags

if TYPE_CHECKING:
    import mlflow

    from pipeline.config import Config

EXPERIMENT = "creditflow"
PIPELINE_TAG = "creditflow.pipeline"  # on every run of one pipeline run
PARENT_TAG = "creditflow.parent"  # on the parent run alone
STAGE_TAG = "creditflow.stage"
DATABASE = "mlflow.db"


def configure_environment(root: Path) -> None:
    """Offline, quiet defaults for every library; call before importing prefect or mlflow."""
    defaults = {
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_TRACKING_URI": tracking_uri(root),
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


def tracking_uri(root: Path) -> str:
    return f"sqlite:///{Path(root).resolve() / DATABASE}"


def pipeline_key(cfg: Config) -> str:
    """Identity of one pipeline run: the params file's bytes + git commit (or the env override).

    The file, not the validated config: a stage's own `-S` overrides (the method and seed of a
    training run) must not split one `dvc repro` into several parents.
    """
    if key := os.environ.get("CREDITFLOW_PIPELINE_RUN"):
        return key
    source = cfg.params_file.read_bytes() if cfg.params_file else cfg.model_dump_json().encode()
    digest = hashlib.sha256(source)
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
    artifacts = (Path(root).resolve() / "mlruns").as_uri()
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
    tags = {PARENT_TAG: key, PIPELINE_TAG: key}
    run = client.create_run(experiment_id, run_name=f"pipeline-{key}", tags=tags)
    client.log_batch(run.info.run_id, params=_params(cfg.flat()))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _params(flat: Mapping[str, Any]) -> list[mlflow.entities.Param]:
    from mlflow.entities import Param

    return [Param(key, str(value)[:500]) for key, value in sorted(flat.items())]


@contextmanager
def stage_run(cfg: Config, stage: str, name: str | None = None) -> Iterator[mlflow.ActiveRun]:
    """A child run of this pipeline run's parent, with the flattened params logged at start.

    Runs left RUNNING by a killed command are marked KILLED first (`pipeline.leftovers`); a
    resumed training run opens a new child with the same name, so a run's rounds are the union
    of its children's steps.
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    # one process at a time: the first use creates the database schema, and two stages of one
    # pipeline run must find (not both create) its parent run
    with file_lock(Path(cfg.root) / f"{DATABASE}.lock"):
        experiment_id = _experiment_id(cfg.root)
        mark_killed_runs(MlflowClient(), experiment_id)
        parent = _parent_run_id(cfg, experiment_id)
    run_name = name or stage
    with mlflow.start_run(
        experiment_id=experiment_id,
        run_name=run_name,
        tags={
            "mlflow.parentRunId": parent,
            PIPELINE_TAG: pipeline_key(cfg),
            STAGE_TAG: stage,
            **run_owner_tags(),
        },
    ) as run:
        mlflow.log_params({key: str(value)[:500] for key, value in cfg.flat().items()})
        yield run


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log finite scalar metrics to the active run (no-op outside one)."""
    import math

    import mlflow

    if mlflow.active_run() is None:
        return
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    if clean:
        mlflow.log_metrics(clean, step=step)


def log_artifact(path: Path) -> None:
    """Attach a file (a sample grid, a plot) to the active run (no-op outside one)."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path))
