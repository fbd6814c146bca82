"""The committed results render: every training curve in `reports/train` has uniform rows (a
file whose rows differ in keys makes `dvc plots show` drop the whole plot, overlays included),
and every run the all-runs overlays name has its curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CURVES = sorted(REPO.glob("reports/train/*/*.json"))


@pytest.mark.parametrize("path", CURVES, ids=[str(p.relative_to(REPO)) for p in CURVES])
def test_committed_training_curves_have_uniform_rows(path):
    rows = json.loads(path.read_text())
    if path.name == "metrics.json":  # a flat summary, not a curve
        assert isinstance(rows, dict)
        return
    assert rows and all(set(row) == set(rows[0]) for row in rows), path


def test_every_curve_of_the_overlays_is_committed():
    for plot in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]:
        ((name, spec),) = plot.items()
        missing = [f for f in spec["y"] if not (REPO / f).is_file()]
        assert not missing, f"{name}: {missing}"
