"""Session 41: the stage-by-stage wall time of a fresh-clone `make run`, from the stamped stage
lines of `make_run_timed.sh` (`make_run_stages.log`), and the evaluation seconds measured after
it was stopped. Writes split.json beside this file and prints the table.

    python reports/search/make-run/split.py
"""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# `creditflow evaluate --policy P` in the same clone at two threads after the stop (seconds)
EVALUATE_SECONDS = {
    "base": 104,
    "flow_grpo-s0": 112,
    "flow_grpo-s1": 104,
    "flow_grpo-s2": 114,
    "stepwise-s0": 137,
}


def stage_minutes(lines: list[str]) -> dict[str, float]:
    """Minutes from each stage's start line to the next stamped line (setup: from the start)."""
    stamps = []
    for line in lines:
        match = re.match(r"\S+ \+(\d+)s (.*)", line)
        if match:
            name = re.match(r"Running stage '([^']+)'", match.group(2))
            stamps.append((name.group(1) if name else None, int(match.group(1))))
    minutes = {"setup (venv, pip install)": stamps[0][1] / 60}
    for (name, start), (_, end) in zip(stamps, stamps[1:], strict=False):
        if name:
            minutes[name] = (end - start) / 60
    return minutes


def main() -> None:
    lines = (HERE / "make_run_stages.log").read_text().splitlines()
    finished = stage_minutes(lines)
    finished.pop("train@stepwise-1")  # stopped 17 s after it began
    out = {
        "machine": "Intel Xeon (AVX-512, AMX), 2 cores; torch 2.13.0+cpu, 2 threads",
        "finished_stage_minutes": {k: round(v, 1) for k, v in finished.items()},
        "finished_minutes": round(sum(finished.values()), 1),
        "evaluate_minutes": {k: round(v / 60, 1) for k, v in EVALUATE_SECONDS.items()},
    }
    (HERE / "split.json").write_text(json.dumps(out, indent=2) + "\n")
    for name, minutes in out["finished_stage_minutes"].items():
        print(f"{name:28s} {minutes:5.1f} min")
    print(f"{'finished stages':28s} {out['finished_minutes']:5.1f} min")


if __name__ == "__main__":
    main()
