"""MLflow layout: every stage is a child of one parent run per pipeline run."""

from __future__ import annotations

import mlflow

from pipeline.config import load_config
from pipeline.tracking import PARENT_TAG, log_metrics, stage_run


def test_stages_of_one_params_file_share_one_parent(project, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'runs.db'}")
    monkeypatch.delenv("CREDITFLOW_PIPELINE_RUN", raising=False)
    params = project / "params.yaml"
    with stage_run(load_config(params), "prompts"):
        log_metrics({"prompts/train": 3.0, "bad": float("nan")})
    with stage_run(load_config(params, ["train.method=tp_grpo"]), "train", "train/tp_grpo-s0"):
        log_metrics({"reward/mean": 0.5}, step=2)
    params.write_text(params.read_text() + "\n# edited: a new experiment\n")
    with stage_run(load_config(params), "prompts"):
        pass

    runs = mlflow.search_runs(experiment_names=["creditflow"]).sort_values("start_time")
    parents = runs[runs[f"tags.{PARENT_TAG}"].notna()]
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert len(parents) == 2 and len(children) == 3
    # The first two stages (one params file, different overrides) share the first parent;
    # the edited file opened a second one.
    assert children["tags.mlflow.parentRunId"].tolist() == [
        parents.run_id.iloc[0],
        parents.run_id.iloc[0],
        parents.run_id.iloc[1],
    ]
    trained = children[children["tags.mlflow.runName"] == "train/tp_grpo-s0"].iloc[0]
    assert trained["metrics.reward/mean"] == 0.5
    assert trained["params.train.method"] == "tp_grpo"
    assert "metrics.bad" not in runs.columns  # a NaN metric is dropped, not logged


def test_three_concurrent_first_uses_of_a_fresh_project_all_succeed(project):
    """Three `creditflow prompts` at once on a project with no MLflow database and no Prefect
    home: the schema creation and the Prefect database migration happen once, under a lock."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env |= {"OMP_NUM_THREADS": "1", "CREDITFLOW_ORCHESTRATION": "prefect"}
    command = [sys.executable, "-m", "stages.cli", "prompts", "--params",
               str(project / "params.yaml")]  # fmt: skip
    runs = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(3)
    ]
    for run in runs:
        output = run.communicate(timeout=600)[0]
        assert run.returncode == 0, output[-2000:]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("creditflow").experiment_id])
    assert sorted(r.info.run_name for r in runs if PARENT_TAG not in r.data.tags) == ["prompts"] * 3
    assert sum(PARENT_TAG in r.data.tags for r in runs) == 1  # one parent, not three
