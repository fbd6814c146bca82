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
    """Minutes of each stage that finished: from its start line to the next stage's, or to the
    END line of a run that succeeded (setup: from the start to the first stage). A stage cut
    off by a stop (a stamped KILLED line, or END with a non-zero rc) is left out."""
    marks = []  # (stage name, or None where the run stopped; seconds since the start)
    for line in lines:
        stamped = re.match(r"\S+ \+(\d+)s (.*)", line)
        end = re.match(r"END rc=(\d+) .* elapsed=(\d+)s", line)
        if stamped:
            stage = re.match(r"Running stage '([^']+)'", stamped.group(2))
            marks.append((stage.group(1) if stage else None, int(stamped.group(1))))
        elif end:
            marks.append(("END" if end.group(1) == "0" else None, int(end.group(2))))
    minutes = {"setup (venv, pip install)": marks[0][1] / 60}
    for (name, start), (after, end) in zip(marks, marks[1:], strict=False):
        if name and name != "END" and after is not None:
            minutes[name] = (end - start) / 60
    return minutes


def main() -> None:
    lines = (HERE / "make_run_stages.log").read_text().splitlines()
    finished = stage_minutes(lines)
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
