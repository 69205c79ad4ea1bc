"""Issue 12: do host-bound training steps cost different amounts in different module instances of one engine?

In the blind runs the same engine forced in two modules ("twin") read > 8% apart on 1 in 10-20 sub-millisecond
training rows (FA2 and cuDNN (torch) alike, almost never a forward), and one row's cuDNN (torch) step cost 0.27-0.48
ms across runs with SDPA in step with it (benchmarks/results/profile/README.md, session 13). This separates what
could cause it, on a few such calls:
- per instance: three modules forced to each torch provider (and flash-attn-4 where installed) and two SDPA
  closures, block-timed interleaved in a Williams order (policy.timing, as the benchmarks time); the spread of one
  engine's instances, and of its instances' first and second halves (drift in time);
- per construction: every instance built again and timed again (does a slow instance stay slow?);
- what differs: torch.profiler over the fastest and the slowest instance of each engine: host time per step by op,
  and the kernels with their device time.
JSON under --out; a table last.

    python3 benchmarks/gpu/check_step_variance.py --out $OUT/step_variance.json
    python3 benchmarks/gpu/check_step_variance.py --smoke --out /tmp/sv.json      # CPU, unfused, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.benchmarking.cases import Case  # noqa: E402
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402
from bench_user_step import _importable, environment, make_tensors, module_for, sdpa_fn, step_fn  # noqa: E402

CALLS = [  # blind8-9 rows whose engines' steps moved between modules or runs
    Case(b=4, s=1024, h=16, d=96, mask="no_mask", name="enc2"),
    Case(b=32, s=512, h=8, d=64, mask="no_mask", name="enc2"),
    Case(b=2, s=100, h=8, d=64, mask="no_mask", name="small0"),
    Case(b=64, s=256, h=8, d=64, mask="no_mask", train=False, name="enc0"),  # a forward: the control
]
SMOKE_CALLS = [Case(b=2, s=64, h=4, d=32, mask="no_mask", name="tiny"),
               Case(b=2, s=64, h=4, d=32, mask="no_mask", train=False, name="tiny")]
INSTANCES = 3
SETTINGS = TimerSettings(warmup=3, reps=48, max_reps=48, warm_ms=60.0, block_ms=3.0, confirm=0)


def providers(smoke: bool) -> list[str]:
    if smoke:
        return ["unfused:pytorch"]
    return ["cudnn_fused:torch", "flash_attn_2:torch"] + (["flash_attn_4:cute"] if _importable("flash_attn.cute")
                                                          else [])


def build_steps(case: Case, device: torch.device, engines: list[str]) -> dict[str, Callable[[], None]]:
    """Steps of fresh instances: '<engine>#i' modules and 'sdpa#i' closures (bench_user_step's), on the same
    inputs."""
    q, k, v, dout, _ = make_tensors(case, device, seed=0)
    calls = {f"{engine}#{i}": module_for(case, engine, device) for engine in engines for i in range(INSTANCES)}
    calls.update({f"sdpa#{i}": sdpa_fn(case) for i in range(2)})
    return {name: step_fn(call, q, k, v, dout, {}, case.train) for name, call in calls.items()}


def spread(timings: dict) -> dict[str, dict]:
    """Per engine: its instances' medians, max / min of them, and each instance's second half / first half."""
    out: dict[str, dict] = {}
    for name, t in timings.items():
        engine = name.split("#")[0]
        half = len(t.samples_ms) // 2
        drift = statistics.median(t.samples_ms[half:]) / statistics.median(t.samples_ms[:half]) if half else 1.0
        entry = out.setdefault(engine, {"median_ms": {}, "drift": {}})
        entry["median_ms"][name] = t.median_ms
        entry["drift"][name] = drift
    for entry in out.values():
        medians = entry["median_ms"].values()
        entry["max_over_min"] = max(medians) / min(medians)
    return out


def profiled(fn: Callable[[], None], device: str, train: bool, steps: int = 20) -> dict:
    """Host time per step by op (self CPU, the top 8) and the kernels with their device time per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.set_grad_enabled(train):
        for _ in range(3):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
    events = prof.key_averages()
    host = sorted(((e.key[:70], e.self_cpu_time_total / steps) for e in events if e.self_cpu_time_total),
                  key=lambda x: -x[1])
    kernels = {e.key[:90]: (getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) / steps
               for e in events if e.device_type.name == "CUDA"}
    return {"host_us_total": sum(us for _, us in host), "host_us_top": dict(host[:8]), "kernels_us": kernels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, the unfused engine, tiny shapes: checks the script")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    engines = providers(args.smoke)
    result = {"environment": environment(), "settings": SETTINGS.to_dict(), "rows": []}
    for case in (SMOKE_CALLS if args.smoke else CALLS):
        row: dict = {"label": case.label, "builds": []}
        for build in range(2):  # the same instances' names, built afresh: does a slow instance stay slow?
            steps = build_steps(case, device, engines)
            timings, errors = time_interleaved(steps, device.type, SETTINGS)
            row["builds"].append({"spread": spread(timings), "errors": {n: repr(e)[:200] for n, e in errors.items()}})
        last = row["builds"][-1]["spread"]
        row["profiles"] = {}
        for engine, entry in last.items():
            ranked = sorted(entry["median_ms"], key=entry["median_ms"].get)
            for name in dict.fromkeys((ranked[0], ranked[-1])):
                row["profiles"][name] = profiled(steps[name], device.type, case.train)
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'call':40s} {'engine':20s} {'build':>5s} {'instances (ms)':>30s} {'max/min':>8s} {'drift':>12s}")
    for row in result["rows"]:
        for b, build in enumerate(row["builds"]):
            for engine, entry in build["spread"].items():
                medians = " ".join(f"{v:.3f}" for v in entry["median_ms"].values())
                drifts = f"{min(entry['drift'].values()):.3f}-{max(entry['drift'].values()):.3f}"
                print(f"{row['label'][:40]:40s} {engine:20s} {b:5d} {medians:>30s} {entry['max_over_min']:8.3f} "
                      f"{drifts:>12s}")
        for name, p in row["profiles"].items():
            print(f"    {name}: host {p['host_us_total']:.0f} us/step, kernels {sum(p['kernels_us'].values()):.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
