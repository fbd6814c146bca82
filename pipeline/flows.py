"""Prefect flows: they only order stage tasks; the work lives in `stages/` and the library.

Every CLI stage runs as a one-task flow inside an MLflow child run; `train` is a flow looping
rounds of rollout -> score -> advantages -> update. `CREDITFLOW_ORCHESTRATION=inline` calls the
task functions directly, without Prefect's temporary API server (about 10 s per process), which
is what the unit tests use; the DVC pipeline and the CLI default to Prefect.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pipeline.config import Config

STAGES = (
    "prompts",
    "base",
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

        work = stage_task(name)
        if isinstance(work, Flow):
            return work(cfg, **kwargs)

        @flow(name=f"creditflow-{name}", flow_run_name=run_name or name, validate_parameters=False)
        def stage_flow(cfg: Config, kwargs: dict[str, Any]) -> Any:
            return work(cfg, **kwargs)

        return stage_flow(cfg, kwargs)
