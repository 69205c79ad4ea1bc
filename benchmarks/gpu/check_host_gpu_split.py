"""Issue 12 (session 8): one provider's step split into host time and GPU time, on a few blind5 calls.

Per provider forced (bench_user_step.step_fn: DotProductAttention called as a user calls it, forward, and backward
into the leaves' .grad in training), bench_user_step.split_times: the step of a block of calls, the GPU time of
the same calls queued behind a spin kernel, and the host time of enqueueing them.

    PYTHONPATH=. python3 benchmarks/gpu/check_host_gpu_split.py --out $OUT/split.json
"""
from __future__ import annotations

import argparse
import json
import time
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_user_step import make_tensors, module_for, split_times, step_fn  # noqa: E402
from attn_dispatch.benchmarking.cases import CASE_GRIDS  # noqa: E402

LABELS = ("llm0 ", "d256-0 ", "small1 ", "enc2 ")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
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
                row["providers"][provider] = split_times(step_fn(module, q, k, v, dout, kwargs, case.train),
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
    Path(args.out).write_text(json.dumps({"environment": env, "samples": args.samples, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
