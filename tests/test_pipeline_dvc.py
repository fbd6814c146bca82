"""The whole DVC pipeline on smoke params in a scratch git clone: every stage through the real
CLI and Prefect (one server for the repro, as `make run` has), every report file, a no-op second
`dvc repro`, DVC metrics, and MLflow (both the Python API and the `mlflow ui` REST API on
loopback)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from pipeline.config import apply_overrides

REPO = Path(__file__).resolve().parents[1]

# Tiny everything: a few seconds per stage beyond Prefect's and the imports' start-up.
SMOKE = [
    "world.image_size=32",
    "prompts.n_train=60",
    "prompts.n_test=12",
    "base.steps=30",
    "base.batch_size=16",
    "base.latent_channels=0",
    "base.ae_steps=0",
    "base.unet_channels=[16, 32]",
    "base.text_dim=16",
    "base.text_layers=1",
    "shapesclip.steps=10",
    "base.refine_steps=3",
    "shapesclip.batch_size=8",
    "sampling.num_steps=4",
    "sampling.eval_num_steps=4",
    "rollout.prompts_per_round=2",
    "rollout.group_size=4",
    "update.minibatch_size=16",
    "train.rounds=2",
    "train.seeds=[0]",
    "evaluate.images_per_prompt=1",
    "bench.repeats=1",
    "bench.round_repeats=1",
]


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def clone(root: Path) -> tuple[Path, dict[str, str]]:
    """A git repo at `root` holding the working tree's files with smoke params; its env."""
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in tracked:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(apply_overrides(yaml.safe_load(params.read_text()), SMOKE)))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLFLOW_", "PREFECT_", "CREDITFLOW_"))
    }
    # OMP_NUM_THREADS is left unset (conftest.py sets it for function-scoped tests only): the
    # other worker is done long before this module, and one thread a stage left a core idle
    # (session 46's CI: the smoke repro took 536 s with one thread a stage, 507 s with two)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = "ci"
    env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = "ci@localhost"
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "smoke"]):
        run(cmd, root, env)
    return root, env


def test_fresh_clone_dag_and_dry_run_list_every_stage(tmp_path):
    root, env = clone(tmp_path / "fresh")
    assert "train@stepwise-0" in run(["dvc", "dag"], root, env).stdout
    # A plain `--dry` trips over DVC's run-cache lookup of not-yet-built deps on a fresh clone
    # (treeverse/dvc#9021); `--force` skips that lookup and lists every stage.
    dry = run(["dvc", "repro", "--dry", "--force"], root, env).stdout
    stages = ("prompts", "base", "refine", "train@tp_grpo-0", "evaluate@stepwise-0", "rescore")
    for stage in (*stages, "bench"):
        assert f"Running stage '{stage}'" in dry
    assert not (root / "data/prompts").exists()  # a dry run builds nothing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(command: list[str], ready_url: str, cwd: Path, env: dict[str, str]) -> Iterator[None]:
    """Run a server for the duration of the block, once `ready_url` answers."""
    server = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(ready_url, timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory):
    """A git clone of the working tree with smoke params, after one `dvc repro` run as `make run`
    runs it (`creditflow with-server dvc repro`): every stage is a Prefect flow, served by one
    server for the whole repro instead of a temporary server per stage (about 10 s a stage;
    that path is what the CLI tests in test_config.py and test_tracking.py go through)."""
    root, env = clone(tmp_path_factory.mktemp("pipeline") / "repo")
    first = run(["creditflow", "with-server", "dvc", "repro"], root, env)
    yield root, env, first


def test_repro_produces_every_report_without_errors(reproduced):
    root, env, first = reproduced
    for name in [
        "reports/base/metrics.json",
        "reports/base/loss.png",
        "reports/base/refine_metrics.json",
        "reports/base/refine_loss.png",
        "reports/eval/base/metrics.json",
        "reports/eval/base/samples.png",
        "reports/rescore/summary.md",
        "reports/README.md",
        "reports/benchmark.md",
        "reports/benchmark.json",
        "reports/bench_metrics.json",
    ] + [
        f"reports/{kind}/{method}-s0/{file}"
        for method in ("flow_grpo", "stepwise", "tp_grpo")
        for kind, file in (("train", "rounds.json"), ("eval", "metrics.json"))
    ]:
        assert (root / name).is_file(), name
    log = first.stdout + first.stderr
    assert "Traceback" not in log
    assert " ERROR " not in log and "| ERROR" not in log
    bench = json.loads((root / "reports/benchmark.json").read_text())
    assert {"rounds_ratio", "wallclock_ratio", "round_cost_ratio", "rollout_efficiency"} <= set(
        bench
    )


def test_second_repro_runs_nothing_and_dry_run_lists_stages(reproduced):
    root, env, _ = reproduced
    again = run(["dvc", "repro"], root, env)
    assert "Running stage" not in again.stdout
    dry = run(["dvc", "repro", "--dry", "--force"], root, env)
    for stage in ("prompts", "base", "train@flow_grpo-0", "evaluate_base", "report", "bench"):
        assert f"Running stage '{stage}'" in dry.stdout


def test_dvc_metrics_show_lists_per_tag_scores(reproduced):
    root, env, _ = reproduced
    shown = run(["dvc", "metrics", "show", "--json"], root, env).stdout
    assert "per_tag" in shown and "overall" in shown
    # the README's per-area table: a row per policy, its overall and six tag scores, no counts
    own = [f"reports/eval/{p}/metrics.json" for p in ("base", "flow_grpo-s0", "tp_grpo-s0")]
    table = run(["dvc", "metrics", "show", *own, "--precision", "3"], root, env).stdout
    assert len(table.splitlines()[0].split()) == 1 + 7, table
    headline = json.loads((root / "reports/bench_metrics.json").read_text())
    assert len(json.dumps(headline)) < 600  # the bench's details stay out of the metrics


def test_plain_dvc_push_stores_the_verdicts_but_not_the_training_rounds(reproduced, tmp_path):
    """`dvc push` sends every output but the runs' cached rounds (push: false) to a remote: the
    evaluation verdicts, which the report and comparisons read, survive a change of machine."""
    root, env, _ = reproduced
    remote = tmp_path / "remote"
    run(["dvc", "remote", "add", "scratch", str(remote)], root, env)
    run(["dvc", "push", "-r", "scratch"], root, env)
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]

    def pushed(stage: str, path: str) -> bool:
        md5 = next(out["md5"] for out in lock[stage]["outs"] if out["path"] == path)
        return (remote / "files" / "md5" / md5[:2] / md5[2:]).is_file()

    assert pushed("evaluate@flow_grpo-0", "data/eval/flow_grpo-s0")
    assert pushed("evaluate_base", "data/eval/base")
    assert not pushed("train@flow_grpo-0", "data/train/flow_grpo-s0")


def test_dvc_plots_show_renders_every_training_curve(reproduced):
    """Per run (rounds.json, probe.json) and the all-runs overlays; the overlays name the
    default seeds 0 and 1, and the smoke params train seed 0 only."""
    root, env, _ = reproduced
    for stale in root.glob("reports/train/*-s1"):  # the repo's committed seed-1 curves
        shutil.rmtree(stale)  # (tests/test_reports_committed.py checks those on their own)
    shown = json.loads(run(["dvc", "plots", "show", "--json"], root, env).stdout)
    curves = {k: v for k, v in shown["data"].items() if k.endswith(("rounds.json", "probe.json"))}
    curves |= {k: v for k, v in shown["data"].items() if k.endswith("all runs")}
    present = {k: v for k, v in curves.items() if "-s1/" not in k}
    assert len(present) == 3 * 2 + 2  # three methods' two curves, two overlays
    for name, plots in present.items():
        values = [row for plot in plots for row in plot["content"]["data"]["values"]]
        assert values, f"{name}: no data"
    errors = [e for e in shown.get("errors", []) if "-s1/" not in e.get("source", e["name"])]
    assert not errors, errors


def test_mlflow_holds_parent_and_child_runs(reproduced):
    root, env, _ = reproduced
    code = (
        "import mlflow, json;"
        f"mlflow.set_tracking_uri('sqlite:///{root}/mlflow.db');"
        "runs = mlflow.search_runs(experiment_names=['creditflow']);"
        "print(json.dumps({'names': runs['tags.mlflow.runName'].tolist(),"
        "'parents': runs['tags.mlflow.parentRunId'].dropna().unique().tolist(),"
        "'has_reward': 'metrics.reward/mean' in runs}))"
    )
    found = json.loads(run([sys.executable, "-c", code], root, env).stdout.strip().splitlines()[-1])
    assert "train/stepwise-s0" in found["names"]
    assert "evaluate/base" in found["names"]
    assert len(found["parents"]) == 1  # one pipeline run, every stage a child of it
    assert found["has_reward"]


def test_mlflow_ui_serves_the_runs_over_loopback(reproduced):
    root, env, _ = reproduced
    port = free_port()
    ui = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
          "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with serving(ui, f"http://127.0.0.1:{port}/health", root, env):
        base = f"http://127.0.0.1:{port}/api/2.0/mlflow"
        with urllib.request.urlopen(
            f"{base}/experiments/get-by-name?experiment_name=creditflow", timeout=10
        ) as r:
            experiment = json.load(r)["experiment"]
        request = urllib.request.Request(
            f"{base}/runs/search",
            data=json.dumps(
                {"experiment_ids": [experiment["experiment_id"]], "max_results": 100}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            runs = json.load(r)["runs"]
        metric_keys = {m["key"] for run_ in runs for m in run_["data"].get("metrics", [])}
        assert "reward/mean" in metric_keys and "geneval/overall" in metric_keys


def test_dvc_exp_run_reruns_only_what_the_override_touches(reproduced):
    """An ablation as users run it, last in this module (it changes the workspace's params):
    `dvc exp run -S` re-runs the touched stages, resumes the persisted run, records the experiment
    with its per-tag metrics."""
    root, env, _ = reproduced
    ablation = ["dvc", "exp", "run", "-S", "train.methods=[flow_grpo]", "-S", "train.rounds=3"]
    ran = run(["creditflow", "with-server", *ablation], root, env).stdout
    assert "Running stage 'train@flow_grpo-0'" in ran
    assert "Running stage 'base'" not in ran and "Running stage 'train@stepwise-0'" not in ran
    rounds = json.loads((root / "reports/train/flow_grpo-s0/rounds.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]  # rounds 0-1 kept, round 2 added
    assert run(["dvc", "exp", "list", "--name-only"], root, env).stdout.strip()
    table = run(["dvc", "exp", "show", "--csv"], root, env).stdout
    header = table.splitlines()[0].split(",")
    assert "train.rounds" in header and any("per_tag.single_object" in h for h in header)
