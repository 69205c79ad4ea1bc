#!/usr/bin/env bash
# Issue 12 (session 7): the packed (thd) rows measured again after the thd host-path change, the profile rebuilt with
# them, and the fourth blind grid (eval-blind4) timed with that profile.
#   bash benchmarks/gpu/run_profile_session7.sh thd-then-stock  # full stack (after .gpu-wheels/b): fit-thd, rebuild,
#                                                              # then eval-blind4 on torch's providers only
#   bash benchmarks/gpu/run_profile_session7.sh blind           # full stack: eval-blind4, default/measured/SDPA
#   bash benchmarks/gpu/run_profile_session7.sh stock-blind     # torch's providers only: eval-blind4
# A rebuild here uses the committed runs plus this machine's fit-thd run (kept under /tmp/s7keep between calls) and
# prints the profile's sha256, so that the profile the blind grid ran with can be rebuilt and checked off the GPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/s7keep
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
run() {  # grid, seconds, file, extra args...
  local grid=$1 secs=$2 file=$3; shift 3
  timeout $((${secs%.*} + 60)) python3 benchmarks/bench_user_step.py --grid "$grid" --max-seconds "$secs" \
    --out "$OUT/$file" --timer call "$@" 2>&1 | tail -n 3
}
rebuild() {  # the README's build command, with this machine's fit-thd run (kept under /tmp/s7keep) among the runs
  cp /tmp/s7keep/fit_thd_*.json benchmarks/results/profile/ 2>/dev/null
  python3 benchmarks/build_profile.py $(ls benchmarks/results/profile/*.json benchmarks/results/profile/*.json.gz \
    | grep -v -e session3_first -e gqa_cudnn -e sdpa_gap -e blind -e "fit.*h200" -e check_ -e host_) \
    --out attn_dispatch/policy/profiles/sm90.json | tail -n 1
  sha256sum attn_dispatch/policy/profiles/sm90.json
}
stock_path() {
  if ! python3 -c "import pydantic, rich" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
  fi
  export PYTHONPATH=$PWD:/tmp/py-deps  # nothing from /tmp/gpu-site: a stock `pip install torch`
}
blind_args=(--policies --measured --reps 24)
case ${1:-} in
  thd-then-stock)
    source "$(dirname "$0")/setup.sh" > /dev/null
    run fit-thd 330 "fit_thd_$tag.json"
    cp "$OUT/fit_thd_$tag.json" /tmp/s7keep/
    rebuild
    ( stock_path
      run eval-blind4 200 "blind4_stock_$tag.json" --tag stock "${blind_args[@]}"
      python3 benchmarks/evaluate_profile.py --timed "$OUT/blind4_stock_$tag.json" | tail -n 9 )
    ;;
  blind)
    source "$(dirname "$0")/setup.sh" > /dev/null
    [ -f /tmp/s7keep/rebuilt ] || { rebuild; touch /tmp/s7keep/rebuilt; }
    run eval-blind4 470 "blind4_$tag.json" "${blind_args[@]}"
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind4_$tag.json" | tail -n 9
    ;;
  stock-blind)
    stock_path
    run eval-blind4 330 "blind4_stock_$tag.json" --tag stock "${blind_args[@]}"
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind4_stock_$tag.json" | tail -n 9
    ;;
  *) echo "usage: run_profile_session7.sh thd-then-stock|blind|stock-blind"; exit 2 ;;
esac
