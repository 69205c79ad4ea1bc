#!/usr/bin/env bash
# Issue 12 (session 5): the profile's fit grids on another machine, and the blind held-out grid (eval-blind).
#   bash benchmarks/gpu/run_profile_session5.sh stock [blind-only]  # torch's providers only (~5 min): fit grids + eval-blind
# Every run times call by call (--timer call), as the profile's data and the first H200 runs were.
#   bash benchmarks/gpu/run_profile_session5.sh fit     # full stack (after .gpu-wheels/b): fit, fit-gqa, fit-extra (~8 min)
#   bash benchmarks/gpu/run_profile_session5.sh blind   # full stack: eval-blind with default, measured, SDPA (~6 min)
# JSON under $OUT, named <grid>[_stock]_<h100|h200>.json; summaries last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
grid=${BLIND_GRID:-eval-blind}  # BLIND_GRID=eval-blind2: the second blind grid (not measured in session 5)
name=${grid#eval-}
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
run() {  # grid, seconds, file, extra args...
  local grid=$1 secs=$2 file=$3; shift 3
  timeout $((${secs%.*} + 40)) python3 benchmarks/bench_user_step.py --grid "$grid" --max-seconds "$secs" \
    --out "$OUT/$file" "$@" 2>&1 | tail -n 3
}
case ${1:-} in
  stock)
    if ! python3 -c "import pydantic, rich" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/py-deps  # nothing from /tmp/gpu-site: a stock `pip install torch`
    if [ "${2:-}" != "blind-only" ]; then
      run fit 110 "fit_stock_$tag.json" --tag stock --timer call
      run fit-gqa 25 "fit_gqa_stock_$tag.json" --tag stock --timer call
      run fit-extra 60 "fit_extra_stock_$tag.json" --tag stock --timer call
    fi
    run "$grid" 120 "${name}_stock_$tag.json" --tag stock --policies --measured --timer call
    python3 benchmarks/evaluate_profile.py --timed "$OUT/${name}_stock_$tag.json" | tail -n 4
    ;;
  fit)
    source "$(dirname "$0")/setup.sh" > /dev/null
    run fit 300 "fit_$tag.json" --timer call
    run fit-gqa 40 "fit_gqa_$tag.json" --timer call
    run fit-extra 150 "fit_extra_$tag.json" --timer call
    ;;
  blind)
    source "$(dirname "$0")/setup.sh" > /dev/null
    run "$grid" 330 "${name}_$tag.json" --policies --measured --timer call
    python3 benchmarks/evaluate_profile.py --timed "$OUT/${name}_$tag.json" | tail -n 4
    ;;
  *) echo "usage: run_profile_session5.sh stock|fit|blind"; exit 2 ;;
esac
