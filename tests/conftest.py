"""Shared fixtures: tiny configs and an isolated project root per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline_inline(monkeypatch, tmp_path):
    """Tests run stages inline (no Prefect server) and track into a throwaway MLflow db."""
    monkeypatch.setenv("CREDITFLOW_ORCHESTRATION", "inline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))


@pytest.fixture
def project(tmp_path) -> Path:
    """A scratch project root holding a copy of the repo's params.yaml."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    return root
