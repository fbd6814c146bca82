"""Shared fixtures: tiny configs and an isolated project root per test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline_inline(monkeypatch, tmp_path):
    """Tests run stages inline (no Prefect server) and track into their scratch project's own
    MLflow database (a tracking URI or DVC root from the caller's shell must not catch them)."""
    monkeypatch.setenv("CREDITFLOW_ORCHESTRATION", "inline")
    for inherited in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_EXP_NAME"):
        monkeypatch.delenv(inherited, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for subprocesses (DVC, the CLI)


def pytest_configure(config):
    """One torch thread per xdist worker: two workers oversubscribing two cores run 10x slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def empty_mlflow_database(tmp_path_factory) -> Path:
    """An MLflow database with its schema created and no runs: MLflow takes about 4 s to create
    one, once for every fresh project, which added minutes to the suite."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow.tracking.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def project(tmp_path, request, empty_mlflow_database) -> Path:
    """A scratch project root holding a copy of the repo's params.yaml, and an empty MLflow
    database unless the test is marked `fresh_mlflow` (its first tracking creates it)."""
    from pipeline.tracking import DATABASE

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    if request.node.get_closest_marker("fresh_mlflow") is None:
        shutil.copy(empty_mlflow_database, root / DATABASE)
    return root


# Overrides that make a whole GRPO round take well under a second on a tiny random backend.
TINY = [
    "prompts.n_train=60",
    "prompts.n_test=12",
    "rollout.prompts_per_round=2",
    "rollout.group_size=4",
    "sampling.num_steps=4",
    "sampling.eval_num_steps=4",
    "score.batch_size=64",
    "update.minibatch_size=8",
    "update.kl_beta=0.004",  # the KL term on, so that every round exercises it (default: β 0)
    "train.rounds=2",
    "evaluate.images_per_prompt=1",
]


def _tiny_model(tmp_path_factory, **overrides) -> Path:
    """A randomly initialised, saved ShapesBackend small enough for unit tests."""
    from pipeline import world
    from pipeline.models import ShapesBackend, ShapesConfig, vocabulary

    train, test = world.make_prompts(60, 12, seed=0)
    config = ShapesConfig(
        vocab=vocabulary([m["prompt"] for m in train + test]),
        image_size=16,
        latent_channels=0,
        patch_size=4,
        num_layers=1,
        num_heads=2,
        head_dim=8,
        text_dim=16,
        text_layers=1,
        text_heads=2,
        **overrides,
    )
    path = tmp_path_factory.mktemp("tiny") / "model"
    ShapesBackend.from_config(config, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_unet_dir(tmp_path_factory) -> Path:
    """The tiny backend with the UNet denoiser instead of the MMDiT."""
    return _tiny_model(tmp_path_factory, denoiser="unet", unet_channels=(16, 32))


@pytest.fixture
def tiny_project(project, tiny_model_dir) -> Path:
    """A project root whose params.yaml holds the tiny settings, with prompts written."""
    from pipeline.config import apply_overrides, load_config
    from stages.flows import run_stage

    params = project / "params.yaml"
    tree = apply_overrides(
        yaml.safe_load(params.read_text()), [*TINY, f"model.path={tiny_model_dir}"]
    )
    params.write_text(yaml.safe_dump(tree, sort_keys=False))
    run_stage("prompts", load_config(params))
    return project
