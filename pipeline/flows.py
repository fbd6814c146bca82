"""Prefect flows: they only order stage tasks; the work lives in `stages/` and the library.

Every CLI stage runs as a one-task flow inside an MLflow child run; `train` is a flow looping
rounds of rollout -> score -> advantages -> update. `CREDITFLOW_ORCHESTRATION=inline` calls the
task functions directly, without Prefect's temporary API server (about 10 s per process), which
is what the unit tests use; the DVC pipeline and the CLI default to Prefect.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from pipeline.config import Config, CreditflowError
from pipeline.leftovers import claim_prefect_server, stop_orphan_prefect_servers

STAGES = (
    "prompts",
    "base",
    "refine",
    "rollout",
    "score",
    "advantages",
    "update",
    "train",
    "evaluate",
    "report",
    "rescore",
    "bench",
)


def stage_task(name: str):
    """The Prefect task (for `train`, the flow) named `name` in `stages/<name>.py`."""
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}")
    return getattr(importlib.import_module(f"stages.{name}"), name)


def inline() -> bool:
    return os.environ.get("CREDITFLOW_ORCHESTRATION", "prefect") == "inline"


def call(task, *args: Any, **kwargs: Any) -> Any:
    """Run a task: through Prefect inside a flow, or as a plain function when inline."""
    return task.fn(*args, **kwargs) if inline() else task(*args, **kwargs)


def run_stage(name: str, cfg: Config, run_name: str | None = None, **kwargs: Any) -> Any:
    """Run one stage as a flow, inside an MLflow child run of this pipeline run."""
    from pipeline.tracking import stage_run

    with stage_run(cfg, name, run_name):
        if inline():
            return stage_task(name).fn(cfg, **kwargs)
        from prefect import Flow, flow

        one_line_user_errors()
        claim_prefect_server()
        stop_orphan_prefect_servers()
        prefect_ready()
        work = stage_task(name)
        if isinstance(work, Flow):
            return work(cfg, **kwargs)

        @flow(name=f"creditflow-{name}", flow_run_name=run_name or name, validate_parameters=False)
        def stage_flow(cfg: Config, kwargs: dict[str, Any]) -> Any:
            return work(cfg, **kwargs)

        return stage_flow(cfg, kwargs)


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
    """On a project's first use of Prefect, migrate its fresh `PREFECT_HOME` database while
    holding a lock: every temporary server migrates it on start, and concurrent first uses
    (three `creditflow train` at once) race on that migration and time out."""
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.io import file_lock

    if os.environ.get("PREFECT_API_URL"):  # a real server: it owns its database
        return
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    with file_lock(home / "first-use.lock"):
        if (home / "prefect.db").is_file():
            return
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            check=True,
            capture_output=True,
        )
