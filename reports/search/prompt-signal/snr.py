"""Session 17 scratch measurement (issue 19): does exploring only the block-mean subspace of the
latent (`block_noise.block_sde_step`) give the GRPO surrogate's gradient more signal?

`benchmarks/gradient_snr.measure` on the default recipe (flow_grpo, shared x_T, window 0-3),
with every rollout and update step drawn and scored with noise block b, at P training prompts
x 4 groups x 8 trajectories (P = 24: 192 per part, the parts' prompts disjoint since group g is
prompt g mod P and part g mod 4; P = 25: 200 per part, every part holds each prompt once, so
the cosine also counts prompt-specific signal). One torch thread:

    OMP_NUM_THREADS=1 python reports/search/prompt-signal/snr.py P B [B ...]

writes reports/search/prompt-signal/snr-p<P>-b<B>.json per block.
"""

import functools
import json
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).parent))
import gradient_snr  # noqa: E402
from block_noise import block_sde_step  # noqa: E402

from pipeline import grpo, sampling  # noqa: E402


def main(prompts: int, blocks: list[int]) -> None:
    args = Namespace(
        params=str(REPO / "params.yaml"), prompts=prompts, groups_per_prompt=4, seed=100
    )
    for block in blocks:
        step = functools.partial(block_sde_step, block=block)
        sampling.sde_step = grpo.sde_step = step  # the rollout's steps and the update's rescoring
        row = gradient_snr.measure("flow_grpo", args)
        row["noise_block"] = block
        out = Path(__file__).parent / f"snr-p{prompts}-b{block}.json"
        out.write_text(json.dumps(row, indent=2) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(b) for b in sys.argv[2:]])
