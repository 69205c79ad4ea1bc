"""Is the profile's split GPU time optimistic for some engines under sustained load (a power-capped GPU)?

The profile's GPU rates come from bench_user_step.split_times: a block of calls queued behind a spin kernel
(torch.cuda._sleep keeps the GPU busy but draws little power). Its own interleaved step times, and the held-out grids',
read cuDNN and FA2 10-13% over that GPU time on GPU-bound dense causal forwards and flash-attn-4 6% (training 7-8%
against 3%). This times the same GPU-bound calls per provider forced four ways, with the SM clock and power logged
by nvidia-smi beside them:
  - split: split_times' GPU time (the profile's measure);
  - idle_burst: a ~3 ms block of calls after 0.3 s with the GPU idle;
  - sustained: blocks timed back to back after 1 s of the provider's own calls (as a training loop keeps the GPU);
  - interleaved: time_interleaved with the held-out grids' settings (block timer, 40 ms warm, 48 reps).

    PYTHONPATH=. python3 benchmarks/gpu/check_sustained_gpu.py --out $OUT/sustained.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_user_step import (BLOCK_MS, SETTINGS, block_ms_per_call, calls_per_block, environment,  # noqa: E402
                             make_tensors, module_for, sdpa_fn, split_times, step_fn)
from attn_dispatch.benchmarking.cases import Case  # noqa: E402
from attn_dispatch.policy.timing import time_interleaved  # noqa: E402

PROVIDERS = ("cudnn_fused:frontend", "cudnn_fused:torch", "flash_attn_2:torch", "flash_attn_4:cute")
# GPU-bound calls of the held-out families (none of them a call of a held-out grid not yet measured)
CASES = (Case(b=1, s=3000, h=32, hkv=8, d=128, name="llm-a"), Case(b=16, s=1000, h=40, hkv=4, d=128, name="llm-b"),
         Case(b=2, s=4096, h=32, hkv=8, d=128, train=False, name="llm-c"),
         Case(b=32, s=512, h=16, d=64, mask="no_mask", name="enc"), Case(b=2, s=4096, h=16, hkv=8, d=256, name="d256"))
SMI_FIELDS = "timestamp,clocks.sm,power.draw.instant,temperature.gpu,clocks_event_reasons.active"
SMI_FALLBACK = "timestamp,clocks.sm,power.draw,temperature.gpu"


def calls_for(run) -> int:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return calls_per_block((time.perf_counter() - t0) * 1e3, BLOCK_MS)


@torch.no_grad()
def idle_burst(run, repeats: int = 5, idle_s: float = 0.3) -> float:
    n, found = calls_for(run), []
    for _ in range(repeats):
        time.sleep(idle_s)
        found.append(block_ms_per_call(run, n))
    return statistics.median(found)


@torch.no_grad()
def sustained(run, heat_s: float = 1.0, blocks: int = 5) -> float:
    """Per call, the median of `blocks` blocks timed back to back, after heat_s of the provider's own calls and an
    untimed lead-in block: no synchronisation between them, so a host-bound step reads its host-limited rate, as in
    a training loop (the first version synchronised before each block and read host time into GPU-bound steps)."""
    n = calls_for(run)
    end = time.perf_counter() + heat_s
    while time.perf_counter() < end:
        for _ in range(n):
            run()
        torch.cuda.synchronize()  # keeps the queue short while heating
    events = [torch.cuda.Event(enable_timing=True) for _ in range(blocks + 1)]
    for _ in range(n):  # the lead-in: the GPU has work queued when the first timed block starts
        run()
    events[0].record()
    for i in range(blocks):
        for _ in range(n):
            run()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / n for a, b in zip(events, events[1:]))


def start_smi(path: Path) -> subprocess.Popen | None:
    for fields in (SMI_FIELDS, SMI_FALLBACK):
        try:
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if probe.returncode == 0:
            out = path.open("w")
            out.write(fields + "\n")
            out.flush()
            return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-lms", "50"],
                                    stdout=out, stderr=subprocess.DEVNULL)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    dev = torch.device("cuda")
    smi = start_smi(out.with_name("smi.csv"))
    phases, rows = [], []
    settings = dataclasses.replace(SETTINGS, reps=48, block_ms=BLOCK_MS)
    try:
        for case in CASES:
            q, k, v, dout, kwargs = make_tensors(case, dev, 0)
            fns, errors = {}, {}
            for provider in PROVIDERS:
                try:
                    fn = step_fn(module_for(case, provider, dev), q, k, v, dout, kwargs, case.train)
                    for _ in range(3):
                        fn()
                    fns[provider] = fn
                except Exception as exc:  # noqa: BLE001 - not installed here, or refused for this call
                    errors[provider] = f"{type(exc).__name__}: {exc}"[:200]
            if (sdpa := sdpa_fn(case)) is not None:
                fns["sdpa"] = step_fn(sdpa, q, k, v, dout, {}, case.train)
            row = {"label": case.label, "case": case.to_dict(), "errors": errors,
                   **{m: {} for m in ("split", "split_step", "idle_burst", "sustained")}}
            for method in ("split", "idle_burst", "sustained"):
                for name, fn in fns.items():
                    t0 = time.time()
                    if method == "split":
                        s = split_times(fn, samples=9)
                        row["split"][name], row["split_step"][name] = s["gpu_ms"], s["step_ms"]
                    else:
                        row[method][name] = (idle_burst if method == "idle_burst" else sustained)(fn)
                    phases.append({"case": case.label, "phase": method, "provider": name, "start": t0,
                                   "end": time.time()})
            t0 = time.time()
            timings, terr = time_interleaved(fns, "cuda", settings)
            phases.append({"case": case.label, "phase": "interleaved", "start": t0, "end": time.time()})
            row["interleaved"] = {n: t.median_ms for n, t in timings.items()}
            row["errors"].update({n: f"{type(e).__name__}: {e}"[:200] for n, e in terr.items()})
            q.grad = k.grad = v.grad = None
            rows.append(row)
            out.write_text(json.dumps({"environment": environment(), "phases": phases, "rows": rows}, indent=1))
            print(case.label)
            for name in fns:
                g = row["split"].get(name)
                cells = [f"{row[m].get(name, float('nan')):.3f}" for m in ("split", "idle_burst", "sustained",
                                                                           "interleaved")]
                ratio = row["sustained"].get(name, float("nan")) / g if g else float("nan")
                print(f"   {name:22s} split/idle/sustained/interleaved {' '.join(cells)}  sustained/split {ratio:.3f}")
    finally:
        if smi is not None:
            smi.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
