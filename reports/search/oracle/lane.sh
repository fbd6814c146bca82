#!/bin/bash
# One lane of search runs (sessions 42-51): train, then evaluate, each run in turn, in the checkout
# DIR (a worktree whose data/base is the committed base), at one torch thread and without a
# Prefect server, so that two lanes share the 2 cores without oversubscription. Run it with the
# project's virtual environment active (`source .venv/bin/activate`).
#   bash reports/search/oracle/lane.sh DIR "METHOD SEED [-S key=value ...]" ...
# e.g. bash reports/search/oracle/lane.sh ../wt1 "stepwise 3 -S rollout.train_on_test=4"
set -euo pipefail
dir=$1
shift
cd "$dir"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 CREDITFLOW_ORCHESTRATION=inline
for spec in "$@"; do
  read -r -a words <<< "$spec"
  run="${words[0]}-s${words[1]}"
  echo "$(date +%T) start $run ${words[*]:2}"
  creditflow train --method "${words[0]}" --seed "${words[1]}" "${words[@]:2}"
  creditflow evaluate --policy "$run" "${words[@]:2}"
  echo "$(date +%T) done $run"
done
