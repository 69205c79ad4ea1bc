#!/usr/bin/env bash
# Issue 12 (session 8): the fifth blind grid (eval-blind5) with the shipped profile, timed in a steady state: the
# harness's default block timer (a call under 2 ms is sampled as a ~3 ms block of back-to-back calls of one module),
# the timer the measured policy tunes with, where eval-blind1-4 took one call per sample (--timer call).
#   bash benchmarks/gpu/run_profile_session8.sh full [START]    # full stack (after .gpu-wheels/b): default, measured, SDPA
#   bash benchmarks/gpu/run_profile_session8.sh stock [START]   # torch's providers only (a stock `pip install torch`)
# SECONDS_FOR (env) caps the grid's time; rows from START on (bench_user_step.py --start) continue a cut run.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
start=${2:-0}
secs=${SECONDS_FOR:-480}
args=(--grid eval-blind5 --policies --measured --reps 16 --start "$start" --max-seconds "$secs")
case ${1:-} in
  full)
    source "$(dirname "$0")/setup.sh" > /dev/null
    file="blind5_${tag}_from${start}.json"
    timeout $((secs + 90)) python3 benchmarks/bench_user_step.py "${args[@]}" --out "$OUT/$file" 2>&1 | tail -n 3
    ;;
  stock)
    if ! python3 -c "import pydantic, rich" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/py-deps  # nothing from /tmp/gpu-site: a stock `pip install torch`
    file="blind5_stock_${tag}_from${start}.json"
    timeout $((secs + 90)) python3 benchmarks/bench_user_step.py "${args[@]}" --tag stock --out "$OUT/$file" 2>&1 \
      | tail -n 3
    ;;
  *) echo "usage: run_profile_session8.sh full|stock [START]"; exit 2 ;;
esac
python3 benchmarks/evaluate_profile.py --timed "$OUT/$file" | tail -n 9
