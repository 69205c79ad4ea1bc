#!/usr/bin/env bash
# Issue 12 (session 4): the profile's extra fit rows and a fresh held-out grid, full stack and stock torch.
#   bash benchmarks/gpu/run_profile12.sh stock   # no wheel bundles on the path: torch's own providers (~3 min)
#   bash benchmarks/gpu/run_profile12.sh full    # after sourcing .gpu-wheels/b/env.sh (~8 min)
# JSON under $OUT (fit_extra[_stock]_h100.json, fresh[_stock]_h100.json, sdpa_gap_h100.json); summaries last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100')")
case ${1:-} in
  stock)
    # pydantic & co. from .gpu-wheels/py, the project; nothing from /tmp/gpu-site (the extra engines' bundles)
    if ! python3 -c "import pydantic, rich" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/py-deps .gpu-wheels/py/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/py-deps
    timeout 150 python3 benchmarks/bench_user_step.py --grid fit-extra --tag stock --max-seconds 120 \
      --out "$OUT/fit_extra_stock_$tag.json" | tail -n 4
    timeout 200 python3 benchmarks/bench_user_step.py --grid eval-fresh --policies --measured --tag stock \
      --max-seconds 170 --out "$OUT/fresh_stock_$tag.json" | tail -n 50
    timeout 120 python3 benchmarks/gpu/check_sdpa_gap.py --out "$OUT/sdpa_gap_$tag.json" 2>&1 | tail -n 14
    python3 benchmarks/evaluate_profile.py --timed "$OUT/fresh_stock_$tag.json"
    ;;
  full)
    source "$(dirname "$0")/setup.sh" > /dev/null
    timeout 170 python3 benchmarks/bench_user_step.py --grid fit-extra --max-seconds 150 \
      --out "$OUT/fit_extra_$tag.json" | tail -n 4
    timeout 370 python3 benchmarks/bench_user_step.py --grid eval-fresh --policies --measured --max-seconds 340 \
      --out "$OUT/fresh_$tag.json" | tail -n 50
    python3 benchmarks/evaluate_profile.py --timed "$OUT/fresh_$tag.json"
    ;;
  *) echo "usage: run_profile12.sh stock|full"; exit 2 ;;
esac
