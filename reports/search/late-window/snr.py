"""Session 27 scratch measurement (issue 19, reports/search.md session 27): does the GRPO
gradient carry more shared signal when the SDE window sits on the late steps?

Why: DRaFT's gradient through only the last 3 of the 10 steps taught held-out skills as well as
through all 10 (session 26), while the default GRPO window explores the first three steps, where
the reward's response to the noise is the layout of one x_T, and the groups share that x_T.
`benchmarks/gradient_snr.measure` (the default recipe; base policy; P training prompts x 4
groups x 8 trajectories split into 4 parts) with the window at steps START..END-1. P = 24: the
parts' prompts are disjoint (the cosine counts only the signal prompts share); P = 25: every part
holds every prompt (it also counts each prompt's own signal). One torch thread:

    OMP_NUM_THREADS=1 python reports/search/late-window/snr.py P START END [START END ...]

writes reports/search/late-window/snr-p<P>-w<START>-<END>.json per window.
"""

import json
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import gradient_snr  # noqa: E402

from pipeline.io import write_json  # noqa: E402


def main(prompts: int, windows: list[tuple[int, int]]) -> None:
    args = Namespace(
        params=str(REPO / "params.yaml"), prompts=prompts, groups_per_prompt=4, seed=100
    )
    for start, end in windows:
        name = f"flow_grpo, window {start}-{end}"
        overrides = [f"rollout.window_start={start}", f"rollout.window_end={end}"]
        gradient_snr.ROWS[name] = ("flow_grpo", overrides)
        row = gradient_snr.measure(name, args)
        out = Path(__file__).parent / f"snr-p{prompts}-w{start}-{end}.json"
        write_json(out, row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:]]
    main(numbers[0], list(zip(numbers[1::2], numbers[2::2], strict=True)))
