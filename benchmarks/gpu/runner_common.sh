# Sourced by the profile runners on the GPU machine: the output folder, the machine's tag, the profile's source
# grids, and blind_run (a blind grid with the default, measured and SDPA columns, as sessions 8-10 ran them).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
SOURCES=fit,fit-drawn-a,fit-drawn-b,fit-drawn-c,fit-extra,fit-gqa,fit-thd,eval,eval-fresh  # the profile's grids

# blind_run GRID NAME full|stock [START]: $OUT/NAME[_stock]_<tag>_from<START>.json, then its offline evaluation;
# REPS (default 16, sessions 8-12) sets --reps; EXTRA, more flags for bench_user_step.py (--checked)
blind_run() {
  local grid=$1 name=$2 stack_name=$3 start=${4:-0} file stack
  if [ "$stack_name" = stock ]; then
    source "$(dirname "${BASH_SOURCE[0]}")/stock_env.sh"
    file="${name}_stock_${tag}_from${start}.json"; stack=(--tag stock)
  else
    source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" > /dev/null
    file="${name}_${tag}_from${start}.json"; stack=()
  fi
  timeout 560 python3 benchmarks/bench_user_step.py --grid "$grid" --policies --measured --reps "${REPS:-16}" \
    --start "$start" --max-seconds 480 ${EXTRA:-} "${stack[@]}" --out "$OUT/$file" 2>&1 | tail -n 3
  python3 benchmarks/evaluate_profile.py --timed "$OUT/$file" | tail -n 13
}
