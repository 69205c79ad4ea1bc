#!/usr/bin/env bash
# Issue 12 (session 6): where thd calls' time goes, the fit-drawn grids, and the third blind grid.
#   bash benchmarks/gpu/run_profile_session6.sh stock-thd        # torch's providers only: thd host profile (~1 min)
#   bash benchmarks/gpu/run_profile_session6.sh fit GRID SECS    # full stack (after .gpu-wheels/b): a fit-drawn grid
#   bash benchmarks/gpu/run_profile_session6.sh thd              # full stack: thd host profile
#   bash benchmarks/gpu/run_profile_session6.sh stock-blind      # torch's providers only: eval-blind3 (~3 min)
#   bash benchmarks/gpu/run_profile_session6.sh blind            # full stack: eval-blind3, default/measured/SDPA
# Every run times call by call (--timer call), as the profile's data. JSON under $OUT; summaries last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
run() {  # grid, seconds, file, extra args...
  local grid=$1 secs=$2 file=$3; shift 3
  timeout $((${secs%.*} + 45)) python3 benchmarks/bench_user_step.py --grid "$grid" --max-seconds "$secs" \
    --out "$OUT/$file" "$@" 2>&1 | tail -n 4
}
stock_path() {
  if ! python3 -c "import pydantic, rich" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
  fi
  export PYTHONPATH=$PWD:/tmp/py-deps  # nothing from /tmp/gpu-site: a stock `pip install torch`
}
case ${1:-} in
  stock-thd)
    stock_path
    OUT=$OUT/stock timeout 150 python3 benchmarks/gpu/profile_thd_host.py 2>&1 | tail -n 24
    ;;
  thd)
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 200 python3 benchmarks/gpu/profile_thd_host.py 2>&1 | tail -n 30
    ;;
  fit)
    source "$(dirname "$0")/setup.sh" > /dev/null
    run "$2" "$3" "${2//-/_}_$tag.json" --timer call
    ;;
  stock-blind)
    stock_path
    run eval-blind3 150 "blind3_stock_$tag.json" --tag stock --policies --measured --timer call
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind3_stock_$tag.json" | tail -n 4
    ;;
  blind)
    source "$(dirname "$0")/setup.sh" > /dev/null
    run eval-blind3 420 "blind3_$tag.json" --policies --measured --timer call
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind3_$tag.json" | tail -n 4
    ;;
  after-thd-stock)  # after the thd host-path change (merge of thd-host): stock thd profile, blind3's other stock rows
    stock_path
    OUT=$OUT/stock timeout 150 python3 benchmarks/gpu/profile_thd_host.py 2>&1 | tail -n 14
    run eval-blind3 170 "blind3_stock_rest_$tag.json" --start 17 --tag stock --policies --measured --timer call
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind3_stock_rest_$tag.json" | tail -n 4
    ;;
  after-thd)  # full stack: thd profile, blind3's packed rows again, the thd GPU tests
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 200 python3 benchmarks/gpu/profile_thd_host.py 2>&1 | tail -n 26
    run eval-blind3 90 "blind3_packed_after_thd_$tag.json" --match packed --policies --measured --timer call
    timeout 200 python3 -m pytest -m gpu tests/gpu/test_thd_host_gpu.py -q -rf 2>&1 | tail -n 15
    ;;
  *) echo "usage: run_profile_session6.sh stock-thd|thd|fit GRID SECS|stock-blind|blind"; exit 2 ;;
esac
