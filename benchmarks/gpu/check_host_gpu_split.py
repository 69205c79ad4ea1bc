"""Issue 12 (session 8): one provider's step split into host time and GPU time, on a few blind5 calls.

Per provider forced (bench_user_step.step_fn: DotProductAttention called as a user calls it, forward, and backward
into the leaves' .grad in training), three numbers per sample of N calls, medians over samples:
- step: N calls back to back between two events (what the block timer measures);
- gpu: the same N calls enqueued behind a spin kernel (torch.cuda._sleep, private; used here, in a benchmark only)
  that keeps the GPU busy until all N are queued: the events then bracket the GPU's work alone;
- host: perf_counter around enqueueing the N calls (behind the spin kernel, so no launch waits on the GPU).

    PYTHONPATH=. python3 benchmarks/gpu/check_host_gpu_split.py --out $OUT/split.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_user_step import make_tensors, module_for, step_fn  # noqa: E402
from attn_dispatch.benchmarking.cases import CASE_GRIDS  # noqa: E402

LABELS = ("llm0 ", "d256-0 ", "small1 ", "enc2 ")


@torch.no_grad()  # as time_interleaved runs steps: a training step enables grad itself
def split(run, n: int, samples: int) -> dict[str, float]:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    step, gpu, host = [], [], []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            run()
        b.record()
        torch.cuda.synchronize()
        step.append(a.elapsed_time(b) / n)
        torch.cuda._sleep(int(2e7))  # ~10 ms of spinning: longer than enqueueing n calls
        a.record()
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        host.append((time.perf_counter() - t0) * 1e3 / n)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / n)
    return {"step_ms": statistics.median(step), "gpu_ms": statistics.median(gpu), "host_ms": statistics.median(host)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cases = [c for c in CASE_GRIDS["eval-blind5"]() if c.label.startswith(LABELS)]
    rows = []
    for case in cases:
        q, k, v, dout, kwargs = make_tensors(case, dev, 0)
        row = {"label": case.label, "providers": {}}
        for provider in ("cudnn_fused:torch", "flash_attn_2:torch", "cudnn_fused:frontend", "flash_attn_4:cute"):
            try:
                module = module_for(case, provider, dev)
                row["providers"][provider] = split(step_fn(module, q, k, v, dout, kwargs, case.train), args.n,
                                                   args.samples)
            except Exception as exc:  # not installed here, or refused for this call
                row["providers"][provider] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
        print(case.label)
        for p, r in row["providers"].items():
            if "error" not in r:
                print(f"   {p:22s} step {r['step_ms']:.3f}  gpu {r['gpu_ms']:.3f}  host {r['host_ms']:.3f}")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(args.out).write_text(json.dumps({"environment": env, "n": args.n, "samples": args.samples, "rows": rows},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
