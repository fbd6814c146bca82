#!/bin/bash
# Session 40 (reports/search.md): the two step-wise claims at more seeds, from the committed
# verdicts — stepwise vs flow_grpo (12 seeds) and joint vs per-step normalization (11 seeds),
# each paired by seed — and the mean probe curves of the three recipes.
set -e
cd "$(dirname "$0")/../../.."  # the project root
source .venv/bin/activate
export OMP_NUM_THREADS=1
M=reports/search/more-seeds; P=reports/search/per-step
FLOW12="$(echo data/eval/flow_grpo-s{0,1,2} $M/flow_grpo-s{3..11}/eval)"
SW12="$(echo data/eval/stepwise-s{0,1,2} $M/stepwise-s{3..11}/eval)"
SW11="$(echo data/eval/stepwise-s{0,1,2} $M/stepwise-s{3..10}/eval)"
PS11="$(echo reports/ablations/per_step/eval/stepwise-s{0,1,2} $P/stepwise-s{3..10}/eval)"
python reports/search/compare.py $M/stepwise-vs-flow_grpo-12-seeds.json --base data/eval/base \
  --reference $FLOW12 --candidate $SW12
python reports/search/compare.py $P/joint-vs-per-step-11-seeds.json --base data/eval/base \
  --reference $PS11 --candidate $SW11
echo "probe means at each reading (stepwise 12, flow_grpo 12, per-step 11):"
probe_mean() { python - "$@" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
for k in sorted({r["rounds"] for run in runs for r in run}):
    vals = [r["probe/geneval"] for run in runs for r in run if r["rounds"] == k]
    print(f"{k}:{sum(vals) / len(vals):.3f}(n={len(vals)})", end=" ")
print()
PY
}
probe_mean reports/train/stepwise-s{0,1,2}/probe.json $M/stepwise-s{3..11}/train/probe.json
probe_mean reports/train/flow_grpo-s{0,1,2}/probe.json $M/flow_grpo-s{3..11}/train/probe.json
probe_mean reports/ablations/per_step/train/stepwise-s{0,1,2}/probe.json $P/stepwise-s{3..10}/train/probe.json
