#!/bin/bash
# claims.sh : collect (from this session's copies under /work; skipped where absent) stepwise seeds 6-11 (wtS) and per-step stepwise seeds 3-10 (wtU, wtV), then the
# two step-wise claims at more seeds: stepwise vs flow_grpo (12 seeds), joint vs per-step (as many as finished).
set -e
cd "$(dirname "$0")/../../.."  # the project root
source .venv/bin/activate
export OMP_NUM_THREADS=1
M=reports/search/more-seeds; P=reports/search/per-step
grab() { # grab WORKTREE RUN DEST
  test -f $1/data/eval/$2/results.jsonl || { echo "missing $1 $2"; return; }
  mkdir -p $3/train $3/eval
  cp $1/reports/train/$2/{metrics,probe,rounds}.json $3/train/
  cp $1/data/eval/$2/results.jsonl $1/reports/eval/$2/metrics.json $3/eval/
}
for s in 6 7 8 9 10 11; do grab /work/wtS stepwise-s$s $M/stepwise-s$s; done
for s in 3 4 5 6 7 8 9; do grab /work/wtU stepwise-s$s $P/stepwise-s$s; done
grab /work/wtV stepwise-s10 $P/stepwise-s10
FLOW12="data/eval/flow_grpo-s0 data/eval/flow_grpo-s1 data/eval/flow_grpo-s2 $(echo $M/flow_grpo-s{3,4,5,6,7,8,9,10,11}/eval)"
SW12="data/eval/stepwise-s0 data/eval/stepwise-s1 data/eval/stepwise-s2 $(echo $M/stepwise-s{3,4,5,6,7,8,9,10,11}/eval)"
# joint and per-step paired by seed, over every seed whose per-step run has finished
SWP="data/eval/stepwise-s0 data/eval/stepwise-s1 data/eval/stepwise-s2"; PSP="$(echo reports/ablations/per_step/eval/stepwise-s{0,1,2})"; NPS=3
for s in 3 4 5 6 7 8 9 10 11; do
  if [ -f $P/stepwise-s$s/eval/results.jsonl ]; then
    SWP="$SWP $M/stepwise-s$s/eval"; PSP="$PSP $P/stepwise-s$s/eval"; NPS=$((NPS+1))
  fi
done
show() { python - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for side in ("reference", "candidate"):
    x = d[side]; g = x["gain_over_base"]
    print(side, [round(v, 3) for v in x["geneval_per_seed"]], "gain %+.3f [%+.3f, %+.3f]" % (g["diff"], *g["ci95"]))
c = d["candidate"]; r = c["minus_reference"]
print(sys.argv[2], "%+.3f [%+.3f, %+.3f]" % (r["diff"], *r["ci95"]))
print(" gain per tag", {k: round(v, 3) for k, v in c["gain_per_tag"].items()})
for k, v in c["minus_reference_per_tag_ci"].items(): print("  ", k, "%+.3f [%+.3f, %+.3f]" % (v["diff"], *v["ci95"]))
PY
}
python reports/search/compare.py $M/stepwise-vs-flow_grpo-12-seeds.json --base data/eval/base --reference $FLOW12 --candidate $SW12 > /dev/null
show $M/stepwise-vs-flow_grpo-12-seeds.json "stepwise - flow_grpo"
python reports/search/compare.py $P/joint-vs-per-step-$NPS-seeds.json --base data/eval/base --reference $PSP --candidate $SWP > /dev/null
show $P/joint-vs-per-step-$NPS-seeds.json "joint - per_step"
echo "probe means at each reading (stepwise 12, flow_grpo 12, per-step):"
probe_mean() { python - "$@" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
for k in sorted({r["rounds"] for run in runs for r in run}):
    vals = [r["probe/geneval"] for run in runs for r in run if r["rounds"] == k]
    print(f"{k}:{sum(vals) / len(vals):.3f}(n={len(vals)})", end=" ")
print()
PY
}
probe_mean reports/train/stepwise-s{0,1,2}/probe.json $M/stepwise-s{3,4,5,6,7,8,9,10,11}/train/probe.json
probe_mean reports/train/flow_grpo-s{0,1,2}/probe.json $M/flow_grpo-s{3,4,5,6,7,8,9,10,11}/train/probe.json
probe_mean reports/ablations/per_step/train/stepwise-s{0,1,2}/probe.json $(ls $P/stepwise-s*/train/probe.json)
