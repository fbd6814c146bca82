"""Sessions 48-49 (reports/search.md): the held-out probe of each group of pool runs, round by
round: mean ± standard error over runs of `probe/geneval` at every probed round, with the mean
NFEs spent by then. Equal rounds compare the credit signals; equal NFEs compare the methods.

    python reports/search/oracle/pool24/probe_rounds.py OUT.json --group NAME DIRS --group ...

DIRS: training report folders (`probe.json` inside), one per run.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from pipeline.io import write_json  # noqa: E402


def probe_by_round(runs: list[Path]) -> list[dict]:
    """[{"rounds", "runs", "nfe", "geneval", "sem"}] for every round some run probed, ascending
    (sem None where one run probed it)."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for point in json.loads((run / "probe.json").read_text()):
            by_round.setdefault(point["rounds"], []).append((point["nfe"], point["probe/geneval"]))
    out = []
    for rounds in sorted(by_round):
        nfe, geneval = np.array(by_round[rounds]).T
        sem = geneval.std(ddof=1) / np.sqrt(len(geneval)) if len(geneval) > 1 else None
        out.append(
            {"rounds": rounds, "runs": len(geneval), "nfe": nfe.mean(), "geneval": geneval.mean(),
             "sem": sem}
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--group", nargs="+", action="append", required=True, metavar=("NAME", "DIRS"),
        help="a name, then the runs' training report folders",
    )  # fmt: skip
    args = parser.parse_args()
    out = {}
    for name, *runs in args.group:
        if not runs:
            parser.error(f"--group {name}: no run folders")
        out[name] = probe_by_round([Path(run) for run in runs])
    write_json(args.out, out)
    for name, points in out.items():
        cells = (
            f"r{p['rounds']} {p['nfe'] / 1e3:.0f}k {p['geneval']:.3f}"
            + ("" if p["sem"] is None else f" ± {p['sem']:.3f}")
            for p in points
        )
        print(f"{name}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
