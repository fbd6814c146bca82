#!/bin/bash
# The lent-GPU runs of big_rounds.py (issue 19), four side by side on one GPU, each starting no
# round after DEADLINE seconds: `run_gpu.sh scale` (session 25's first call) or `run_gpu.sh lr`
# (its second). Run from the repository root on the device machine with data/base/model,
# data/prompts and the wheels of .whl carried; results land in $OUT/<name>.
DEADLINE=${DEADLINE:-380}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
common="train.rounds=100000 train.nfe_budget=0 evaluate.batch_size=576 score.batch_size=512 score.reward_workers=2"
big="rollout.prompts_per_round=96 rollout.group_size=16"
launch() {  # name, overrides...
  local name=$1; shift
  timeout $((DEADLINE + 120)) python3 reports/search/gpu/big_rounds.py --out "$OUT/$name" \
      --deadline-s "$DEADLINE" --set $common "$@" > "$OUT/$name.log" 2>&1 &
}
case $1 in
  scale)
    launch flow_default train.method=flow_grpo
    launch flow_big train.method=flow_grpo $big update.minibatch_size=4608
    launch flow_big_4steps train.method=flow_grpo $big update.minibatch_size=1152
    launch stepwise_big train.method=stepwise $big update.minibatch_size=4608 ;;
  lr)
    for lr in 3e-3 1e-2 3e-2; do
      launch flow_big_lr$lr train.method=flow_grpo $big update.minibatch_size=4608 update.lr=$lr
    done
    launch flow_big_lr3e-3_rank32 train.method=flow_grpo $big update.minibatch_size=4608 \
        update.lr=3e-3 update.lora_rank=32 update.lora_alpha=64 ;;
  *) echo "usage: run_gpu.sh scale|lr"; exit 2 ;;
esac
wait
for f in "$OUT"/*.log; do echo "== $f"; grep -v "it/s\]\|img/s\]" "$f" | tail -3; done
