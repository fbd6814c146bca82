"""What one pipeline stage costs before it does any work: `creditflow prompts` (about a second of
work) timed as a process, three ways, interleaved so that a noisy machine hits all alike:

- ``temporary server``: no Prefect server configured, as a plain `dvc repro` runs each stage:
  the stage starts Prefect's temporary server and stops it at the end;
- ``one server``: under `creditflow with-server` (what `make run` does): one server for every
  stage of the command, its own start counted once, apart;
- ``inline``: `CREDITFLOW_ORCHESTRATION=inline`, no Prefect at all (the floor: imports, config,
  MLflow tracking).

    python benchmarks/stage_startup.py [--repeats 5]

Writes reports/stage_startup.{json,md}. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrain_determinism import cpu_model  # this directory: run as a script

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "reports" / "stage_startup"
MODES = ("temporary server", "one server", "inline")


def stage_seconds(project: Path, env: dict[str, str]) -> float:
    """Wall seconds of one `creditflow prompts` process in `project`."""
    command = [sys.executable, "-m", "stages.cli", "prompts", "--params", "params.yaml"]
    start = time.perf_counter()
    subprocess.run(command, cwd=project, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def inner(out: Path) -> None:
    """Run under `creditflow with-server`: time one stage on its server."""
    out.write_text(json.dumps(stage_seconds(Path.cwd(), dict(os.environ))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.inner)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {"PYTHONPATH": str(REPO), "CREDITFLOW_ORCHESTRATION": "prefect"}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    server_start: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        project = Path(scratch)
        shutil.copy(REPO / "params.yaml", project / "params.yaml")
        stage_seconds(project, env)  # the first use creates the MLflow and Prefect databases
        for _ in range(args.repeats):
            seconds["temporary server"].append(stage_seconds(project, env))
            seconds["inline"].append(
                stage_seconds(project, env | {"CREDITFLOW_ORCHESTRATION": "inline"})
            )
            timings = project / "one_server.json"
            command = [sys.executable, "-m", "stages.cli", "with-server", sys.executable,
                       __file__, "--inner", str(timings)]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(command, cwd=project, env=env, check=True, capture_output=True)
            total = time.perf_counter() - start
            one = json.loads(timings.read_text())
            seconds["one server"].append(one)
            server_start.append(total - one)
    median = {mode: statistics.median(seconds[mode]) for mode in MODES}
    result = {
        "machine": cpu_model(),
        "repeats": args.repeats,
        "seconds": seconds,
        "median_s": median,
        "with_server_overhead_median_s": statistics.median(server_start),
        "saved_per_stage_s": median["temporary server"] - median["one server"],
    }
    REPORT.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(
        f"| {mode} | {median[mode]:.1f} | {min(seconds[mode]):.1f}–{max(seconds[mode]):.1f} |"
        for mode in MODES
    )
    REPORT.with_suffix(".md").write_text(
        f"""# One stage's start-up: `creditflow prompts`, {args.repeats} runs each, interleaved

Command: `python benchmarks/stage_startup.py --repeats {args.repeats}`; {result["machine"]}.

| Prefect | median s | range s |
|---|---|---|
{rows}

`creditflow with-server` starts its server once: {result["with_server_overhead_median_s"]:.1f} s
(median) on top of the stage it ran. Per stage it saves {result["saved_per_stage_s"]:.1f} s over a
temporary server per stage; the default `dvc repro` runs 26 stages.
"""
    )
    print(REPORT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
