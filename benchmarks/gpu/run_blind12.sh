#!/usr/bin/env bash
# Issue 12 (session 5): the blind held-out grid (eval-blind, committed before any measurement; the profile was built
# without it) on this machine, full stack and stock torch; default module, measured policy and SDPA timed.
#   bash benchmarks/gpu/run_blind12.sh stock   # no wheel bundles on the path: torch's own providers (~3 min)
#   bash benchmarks/gpu/run_blind12.sh full    # after the bundles a then b (flash-attn-4) are unpacked (~6 min)
#   bash benchmarks/gpu/run_blind12.sh fit     # the H200's fit grid, full stack (when fit_h200.json is missing)
# JSON under $OUT (blind[_stock]_{h100,h200}.json); the timed and offline summaries last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
case ${1:-} in
  stock)
    if ! python3 -c "import pydantic, rich" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/py-deps
    timeout 230 python3 benchmarks/bench_user_step.py --grid eval-blind --policies --measured --tag stock \
      --max-seconds 200 --out "$OUT/blind_stock_$tag.json" | tail -n 50
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind_stock_$tag.json"
    ;;
  full)
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 420 python3 benchmarks/bench_user_step.py --grid eval-blind --policies --measured --max-seconds 390 \
      --out "$OUT/blind_$tag.json" | tail -n 50
    python3 benchmarks/evaluate_profile.py --timed "$OUT/blind_$tag.json"
    ;;
  fit)
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 560 python3 benchmarks/bench_user_step.py --grid fit --max-seconds 530 --out "$OUT/fit_$tag.json" \
      | tail -n 4
    ;;
  *) echo "usage: run_blind12.sh stock|full|fit"; exit 2 ;;
esac
