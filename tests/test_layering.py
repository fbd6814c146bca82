"""The house matches its map: the library (`pipeline/`) never imports the application
(`stages/`), and task modules never import each other; only the flows and the CLI compose them."""

from __future__ import annotations

import pytest

from tests.test_dvc_deps import REPO, imported_files

APPLICATION = {"stages/flows.py", "stages/cli.py"}  # they order and run the task modules


def imports_of(path):
    return {p.relative_to(REPO).as_posix() for p in imported_files(path)}


@pytest.mark.parametrize(
    "module", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "pipeline").glob("*.py"))
)
def test_the_library_never_imports_the_stages(module):
    assert not {m for m in imports_of(REPO / module) if m.startswith("stages/")}


@pytest.mark.parametrize(
    "module",
    sorted(
        p.relative_to(REPO).as_posix()
        for p in (REPO / "stages").glob("*.py")
        if p.relative_to(REPO).as_posix() not in APPLICATION
    ),
)
def test_task_modules_never_import_each_other(module):
    assert not {m for m in imports_of(REPO / module) if m.startswith("stages/")}


def test_benchmarks_and_scripts_use_the_library_not_the_application():
    for path in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py")]:
        assert not {m for m in imports_of(path) if m.startswith("stages/")}, path.name
