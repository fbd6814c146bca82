"""dvc.yaml's deps follow the code: every project module a stage's command imports, directly or
through other project modules (function-local imports included), is listed in its deps, so a
code change re-runs the stages it can change and `dvc repro` never reports stale results as
up to date."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# Orchestration, configuration and logging: they order, configure and record work but compute
# nothing a stage writes (the values of params are DVC params, tracked on their own).
EXEMPT = {
    "pipeline/config.py",
    "pipeline/io.py",
    "pipeline/layout.py",
    "pipeline/leftovers.py",
    "pipeline/tracking.py",
    "stages/cli.py",
}


def module_file(name: str) -> Path | None:
    """The project file of a dotted module name, or None for third-party modules."""
    path = REPO / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path) -> set[Path]:
    """Project files imported anywhere in `path` (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pipeline import world` names a module; `from pipeline.x import f` does not
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if (file := module_file(name)) is not None and file.name != "__init__.py":
                found.add(file)
    return found


def project_closure(entry: Path) -> set[str]:
    """Repo-relative paths of every project module reachable from `entry`, itself included,
    not following EXEMPT modules (config imports the reward registry only to check names)."""
    seen, todo = set(), [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.relative_to(REPO).as_posix() not in EXEMPT:
            todo.extend(imported_files(path) - seen)
    return {p.relative_to(REPO).as_posix() for p in seen}


def stage_entries() -> dict[str, tuple[Path, list[str]]]:
    """{dvc stage: (the module its `creditflow <stage>` command runs, its deps)}."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, stage in stages.items():
        command = stage["cmd"].split()
        assert command[0] == "creditflow", f"{name}: expected a creditflow command"
        module = REPO / "stages" / f"{command[1]}.py"
        # a command without a task module of its own is a flow of stages/flows.py (`train`)
        out[name] = (module if module.is_file() else REPO / "stages" / "flows.py", stage["deps"])
    return out


@pytest.mark.parametrize("stage", sorted(stage_entries()))
def test_stage_deps_list_every_imported_project_module(stage):
    entry, deps = stage_entries()[stage]
    needed = project_closure(entry) - EXEMPT
    listed = {d for d in deps if d.endswith(".py")}
    missing, extra = sorted(needed - listed), sorted(listed - needed)
    assert not missing, f"dvc.yaml stage {stage!r} misses deps: {', '.join(missing)}"
    # a module the stage does not import would rerun it for nothing
    assert not extra, f"dvc.yaml stage {stage!r} lists deps it does not import: {', '.join(extra)}"


@pytest.mark.parametrize("stage", sorted(stage_entries()))
def test_stage_params_are_the_ones_its_mlflow_run_logs(stage):
    """dvc.yaml's params of a stage and `stages.STAGES` (what its MLflow run logs) agree."""
    from stages import STAGES

    declared = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["params"]
    command = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["cmd"].split()[1]
    assert sorted(declared) == sorted(STAGES[command])


def test_closure_follows_function_local_imports(tmp_path):
    # stages/evaluate.py imports the detector only inside pipeline/evaluation.py's `judge`
    closure = project_closure(REPO / "stages" / "evaluate.py")
    assert {"pipeline/evaluation.py", "pipeline/detector.py", "pipeline/geneval.py"} <= closure


def test_the_all_runs_plots_overlay_every_training_run_of_the_params():
    params = yaml.safe_load((REPO / "params.yaml").read_text())["train"]
    runs = {f"{m}-s{s}" for m in params["methods"] for s in params["seeds"]}
    for plot in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]:
        ((name, spec),) = plot.items()
        files = {Path(f).parent.name for f in spec["y"]}
        assert files == runs, f"dvc.yaml plot {name!r}: runs {sorted(files ^ runs)} differ"
