"""Where a packed (thd) call's time goes (issue 12): every provider's thd call costs >= 0.3 ms forward and ~1.2 ms
forward+backward at any size on the H100, against ~0.05 / 0.3 ms for dense calls of the same work.

For a thd call and its dense (bshd) twin, for each eligible provider forced, in one process:
  - host_us: CPU time per call to enqueue N calls back to back (no sync inside; the GPU is not the limit when
    host_us >> gpu_us), and gpu_us, the CUDA-event time of the same N calls;
  - the CUDA runtime calls per call (kernel launches, copies, synchronisations) from torch.profiler;
  - the functions with the most own CPU time per call (cProfile), to name what to remove.
Prints a table last; JSON to $OUT/thd_host_<h100|h200>.json.
    python3 benchmarks/gpu/profile_thd_host.py
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_user_step import environment, make_tensors, module_for, step_fn  # noqa: E402

from attn_dispatch.benchmarking.cases import Case  # noqa: E402

N = 50
CASES = [Case(b=4, s=2048, h=16, d=64, mask="padding", fmt="thd", name="packed-d64"),
         Case(b=4, s=2048, h=16, d=64, mask="no_mask", name="dense-d64"),
         Case(b=4, s=4096, h=16, hkv=4, d=128, mask="padding_causal", fmt="thd", name="packed-d128"),
         Case(b=4, s=4096, h=16, hkv=4, d=128, mask="causal", name="dense-d128")]


def timed(step, n: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        step()
    end.record()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n * 1e3


def runtime_calls(step, n: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    counts: dict[str, float] = {}
    for evt in prof.events():
        name = evt.name
        if name.startswith("cuda") or name.startswith("cu"):
            counts[name] = counts.get(name, 0) + 1 / n
    return {k: round(v, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:12]}


def top_functions(step, n: int = N) -> list[tuple[str, float]]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [(f"{Path(f).name}:{line} {fn}", tt / n * 1e6) for (f, line, fn), (_, _, tt, _, _) in stats.items()]
    return [(name, round(us, 1)) for name, us in sorted(rows, key=lambda r: -r[1])[:15]]


def main() -> int:
    device = torch.device("cuda")
    out = {"environment": environment(), "rows": []}
    for case in CASES:
        for train in (False, True):
            c = Case(**{**case.to_dict(), "train": train})
            q, k, v, dout, kwargs = make_tensors(c, device, 1)
            default = module_for(c, None, device)
            with torch.no_grad():
                default(q.detach(), k.detach(), v.detach(), **kwargs)
            eligible = [vd.id for vd in default.last_decision.verdicts
                        if vd.eligible and not vd.id.startswith("unfused")]
            for provider in eligible:
                step = step_fn(module_for(c, provider, device), q, k, v, dout, kwargs, train)
                try:
                    for _ in range(5):
                        step()
                    host, gpu = timed(step, N)
                    row = {"label": c.label, "provider": provider, "host_us": round(host, 1), "gpu_us": round(gpu, 1),
                           "runtime_calls": runtime_calls(step), "top_functions": top_functions(step)}
                except Exception as exc:  # noqa: BLE001 - recorded, the next provider runs
                    row = {"label": c.label, "provider": provider, "error": f"{type(exc).__name__}: {exc}"[:300]}
                out["rows"].append(row)
                print(json.dumps(row)[:1500], flush=True)
    tag = "h200" if "H200" in torch.cuda.get_device_name() else "h100"
    dest = Path(os.environ.get("OUT", "/tmp/out")) / f"thd_host_{tag}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"\n{'call':46s} {'provider':22s} {'host us':>8s} {'gpu us':>8s} launches")
    for r in out["rows"]:
        if "error" in r:
            print(f"{r['label']:46s} {r['provider']:22s} {r['error'][:60]}")
            continue
        launches = r["runtime_calls"].get("cudaLaunchKernel", 0) + r["runtime_calls"].get("cuLaunchKernel", 0) \
            + r["runtime_calls"].get("cuLaunchKernelEx", 0) + r["runtime_calls"].get("cudaLaunchKernelExC", 0)
        syncs = {k: v for k, v in r["runtime_calls"].items() if "ynchron" in k or "Memcpy" in k}
        print(f"{r['label']:46s} {r['provider']:22s} {r['host_us']:8.1f} {r['gpu_us']:8.1f} {launches:5.1f} {syncs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
