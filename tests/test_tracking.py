"""MLflow layout: every stage is a child of one parent run per pipeline run; runs carry the
params that shape them and their policy; a resumed training run continues its own run."""

from __future__ import annotations

import shutil

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from pipeline.config import load_config
from pipeline.tracking import (
    COMMIT_TAG,
    EXPERIMENT,
    EXPERIMENT_TAG,
    METHOD_TAG,
    PARAMS_TAG,
    PARENT_TAG,
    POLICY_TAG,
    SEED_TAG,
    log_metrics,
    params_digest,
    stage_params,
    stage_run,
    tracking_uri,
)
from stages import STAGES
from stages.flows import run_stage


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


@pytest.mark.fresh_mlflow
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
        assert "Starting temporary server" in output  # no server configured: each starts one
    client = mlflow.tracking.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("creditflow").experiment_id])
    assert sorted(r.info.run_name for r in runs if PARENT_TAG not in r.data.tags) == ["prompts"] * 3
    assert sum(PARENT_TAG in r.data.tags for r in runs) == 1  # one parent, not three


def test_with_server_gives_every_stage_of_its_command_one_server_and_stops_it(project):
    """`creditflow with-server CMD` (what `make run` wraps `dvc repro` in): the stages CMD runs
    use its server instead of starting their own, CMD's exit code is passed on, and the server
    is gone afterwards."""
    import os
    import subprocess
    import sys
    import urllib.request

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env |= {"OMP_NUM_THREADS": "1", "CREDITFLOW_ORCHESTRATION": "prefect"}
    stage = f"{sys.executable} -m stages.cli prompts --params {project / 'params.yaml'}"
    command = f"echo url=$PREFECT_API_URL && {stage} && {stage} && exit 3"
    done = subprocess.run(
        [sys.executable, "-m", "stages.cli", "with-server", "sh", "-c", command],
        cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 3, output[-2000:]
    assert "Starting temporary server" not in output  # (each stage's own would say so)
    assert output.count("Flow run 'prompts' - Finished in state Completed()") == 2
    url = output.split("url=")[1].split()[0]
    assert url.startswith("http://127.0.0.1:")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


def _client_runs(uri: str) -> list:
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])


@pytest.mark.fresh_mlflow
def test_a_user_set_tracking_uri_receives_the_runs(project, monkeypatch, tmp_path):
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    with stage_run(load_config(project / "params.yaml"), "prompts"):
        log_metrics({"prompts/train": 3.0})
    (child,) = [r for r in _client_runs(elsewhere) if PARENT_TAG not in r.data.tags]
    assert child.data.metrics == {"prompts/train": 3.0}
    assert not (project / "mlflow.db").exists()  # the project's default store is left alone


def test_a_temporary_dvc_experiment_tracks_into_the_project_under_its_name(
    project, monkeypatch, tmp_path
):
    """`dvc exp run --temp/--queue` runs the stages in a copy that it deletes afterwards, with
    DVC_ROOT naming the project and DVC_EXP_NAME the experiment."""
    copy = tmp_path / "exp-copy"
    copy.mkdir()
    shutil.copy(project / "params.yaml", copy / "params.yaml")
    monkeypatch.setenv("DVC_ROOT", str(project))
    monkeypatch.setenv("DVC_EXP_NAME", "wide-lr")
    cfg = load_config(copy / "params.yaml")
    with stage_run(cfg, "prompts"):
        pass
    assert not (copy / "mlflow.db").exists()
    runs = _client_runs(f"sqlite:///{project / 'mlflow.db'}")
    (parent,) = [r for r in runs if PARENT_TAG in r.data.tags]
    assert parent.info.run_name == "wide-lr"
    assert parent.data.tags[EXPERIMENT_TAG] == "wide-lr"
    assert parent.data.tags[PARAMS_TAG] == params_digest(cfg) != ""
    assert COMMIT_TAG in parent.data.tags


def test_training_and_evaluation_runs_log_their_params_tags_and_scores(tiny_project):
    """A training run logs only the params that shape it (its dvc.yaml params) and is tagged
    with its policy, method and seed; evaluating it tags the evaluation alike and puts the
    scores onto the training run too, at the step of its rounds trained."""
    params = tiny_project / "params.yaml"
    cfg = load_config(params, ["train.method=tp_grpo", "train.seed=3", "train.rounds=1"])
    run_stage("train", cfg)
    summary = run_stage("evaluate", load_config(params), policy="tp_grpo-s3")
    runs = {r.info.run_name: r for r in _client_runs(tracking_uri(tiny_project))}
    trained, evaluated = runs["train/tp_grpo-s3"], runs["evaluate/tp_grpo-s3"]
    assert set(trained.data.params) == set(stage_params(cfg, STAGES["train"]))
    assert "update.lr" in trained.data.params and "world.image_size" not in trained.data.params
    assert not any(k.startswith("prompts.") for k in evaluated.data.params)
    for run in (trained, evaluated):
        tags = run.data.tags
        assert (tags[POLICY_TAG], tags[METHOD_TAG], tags[SEED_TAG]) == (
            "tp_grpo-s3",
            "tp_grpo",
            "3",
        )
    assert evaluated.data.metrics["geneval/overall"] == pytest.approx(summary["overall"])
    assert trained.data.metrics["eval/geneval/overall"] == pytest.approx(summary["overall"])
    history = MlflowClient(tracking_uri(tiny_project)).get_metric_history(
        trained.info.run_id, "eval/geneval/overall"
    )
    assert [m.step for m in history] == [1]
    # and `creditflow runs` shows it from the tracking store
    from typer.testing import CliRunner

    from stages.cli import app

    shown = CliRunner().invoke(app, ["runs", "--params", str(params)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "tp_grpo-s3" in shown.output and f"{summary['overall']:.3f}" in shown.output


def test_a_killed_and_resumed_training_run_is_one_finished_mlflow_run(tiny_project):
    """kill -9 mid-run, as the OOM killer does, then the rerun: the resumed rounds go to the
    killed attempt's MLflow run, which ends FINISHED with every round's metrics."""
    import signal
    import subprocess
    import sys
    import time

    from pipeline.layout import train_run
    from pipeline.policy import checkpoints

    params = tiny_project / "params.yaml"
    run = train_run(load_config(params))
    command = [sys.executable, "-m", "stages.cli", "train", "--params", str(params),
               "-S", "train.rounds=60"]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "round-0001").exists():
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    done = len(checkpoints(run / "checkpoints"))
    assert 2 <= done < 60
    uri = tracking_uri(tiny_project)
    (killed,) = [r for r in _client_runs(uri) if r.info.run_name == "train/flow_grpo-s0"]
    assert killed.info.status == "RUNNING"  # nobody could close it

    run_stage("train", load_config(params, [f"train.rounds={done + 2}"]))
    (resumed,) = [r for r in _client_runs(uri) if r.info.run_name == "train/flow_grpo-s0"]
    assert resumed.info.run_id == killed.info.run_id
    assert resumed.info.status == "FINISHED"
    history = MlflowClient(uri).get_metric_history(resumed.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(done + 2))
