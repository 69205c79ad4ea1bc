"""cuDNN fused attention on the GPU: our cudnn-frontend engine beside torch's own cuDNN SDPA, same run.

bf16, D in {64, 128, 256}, S in {1k, 4k, 16k}, B x H as in ../shared/device/README.md, causal and not; forward and
forward+backward TFLOP/s (4*B*H*S^2*D flops forward, half when causal, 3.5x that for forward+backward).
Each point is timed in --rounds alternating rounds (ours then torch, torch then ours, ...), each a median of
triton.testing.do_bench (CUDA events when triton is missing); the reported time is the median over rounds, and
the per-round ratios are kept, so one noisy measurement cannot make the ratio.
Both engines see the same memory: bshd tensors (q, k, v, dO), ours through strides, torch's SDPA through
[b, h, s, d] views of them, under sdpa_kernel(SDPBackend.CUDNN_ATTENTION); both outputs come out in that layout
and both compute the log-sum-exp in the forward (inputs require grad), as a training step does; neither runs a
deterministic backward.

Also measured: the first call of a new shape (which builds the forward and backward graphs) and the host time per
cached call (the same way as before: engine.forward vs torch's SDPA with a grad-requiring query, on a tiny
problem), for our lean launch, for cudnn-frontend's own execute, and through autograd.
Usage: python3 benchmarks/bench_cudnn.py --out $OUT/cudnn.json [--quick] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attn_dispatch.backends.base import AttnAux, AttnConfig  # noqa: E402
from gpu_timing import bench, tflops  # noqa: E402  (benchmarks/, the script's own folder)

GRID = [  # (D, S, B, H) from the device README
    (64, 1024, 32, 16), (64, 4096, 8, 16), (64, 16384, 2, 16),
    (128, 1024, 32, 16), (128, 4096, 8, 16), (128, 16384, 2, 16),
    (256, 1024, 32, 8), (256, 4096, 8, 8), (256, 16384, 2, 8),
]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def point(engine, d, s, b, h, causal, rounds: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    cfg = AttnConfig(attn_mask_type="causal" if causal else "no_mask", window_size=(-1, 0) if causal else (-1, -1),
                     softmax_scale=scale)
    aux = AttnAux()
    row = {"D": d, "S": s, "B": b, "H": h, "causal": causal}

    def ours_fwd():
        return engine(q, k, v, aux, cfg)[0]

    def ours_fwd_bwd():
        engine(q, k, v, aux, cfg)[0].backward(dout)

    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def torch_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    def torch_fwd_bwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).backward(dt)

    layouts = {"ours_out": list(ours_fwd().stride()), "torch_out_bshd": list(torch_fwd().transpose(1, 2).stride())}
    row["same_output_layout"] = layouts["ours_out"] == layouts["torch_out_bshd"]
    for kind, backward, pair in (("fwd", False, (("ours", ours_fwd), ("torch", torch_fwd))),
                                 ("fwd_bwd", True, (("ours", ours_fwd_bwd), ("torch", torch_fwd_bwd)))):
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        try:
            for r in range(rounds):
                for name, fn in (pair if r % 2 == 0 else pair[::-1]):
                    times[name].append(bench(fn, grad_to_none=[q, k, v] if backward else None))
        except Exception as exc:  # noqa: BLE001 - one failing point must not stop the grid
            row[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        for name in ("ours", "torch"):
            ms = _median(times[name])
            row[f"{name}_{kind}_ms"] = round(ms, 4)
            row[f"{name}_{kind}_tflops"] = round(tflops(b, h, s, d, causal, ms, backward), 1)
        row[f"{kind}_ratio"] = round(row[f"torch_{kind}_ms"] / row[f"ours_{kind}_ms"], 3)
        row[f"{kind}_round_ratios"] = [round(t / o, 3) for o, t in zip(times["ours"], times["torch"])]
    row["ours_plans"] = sorted({c.plan for key, c in engine._graphs.items()
                                if (key.b, key.h, key.sq, key.dqk) == (b, h, s, d)
                                and (key.alignment is not None) == causal})
    q = k = v = dout = qt = kt = vt = dt = None  # the closures' cells: drop the tensors before empty_cache
    torch.cuda.empty_cache()
    return row


def _host_us(fn, n: int = 500, repeats: int = 3) -> float:
    """Host microseconds per call (best of `repeats` loops of n calls): a tiny problem, so the GPU keeps up."""
    for _ in range(20):
        fn()
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return round(best, 1)


def build_and_overhead(engine) -> dict:
    """First call of a new shape (builds the forward graph and, inputs requiring grad, the backward one) vs a cached
    call; host microseconds per cached call, ours (lean launch / cudnn-frontend's execute / through autograd) and
    torch's SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from attn_dispatch.backends.cudnn_fused import CudnnFrontendEngine

    out = {}
    b, s, h, d = 2, 640, 8, 128  # a shape no grid point uses: its graphs are new
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cfg = AttnConfig(attn_mask_type="causal", softmax_scale=1 / math.sqrt(d))
    aux = AttnAux()
    builds, build_s = engine.stats["builds"], engine.stats["build_seconds"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = engine(q, k, v, aux, cfg)[0]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    o.sum().backward()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    o = engine(q, k, v, aux, cfg)[0]
    o.sum().backward()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    out.update(first_fwd_call_s=round(t1 - t0, 4), first_bwd_call_s=round(t2 - t1, 4),
               cached_fwd_bwd_s=round(t3 - t2, 5), new_shape_graph_builds=engine.stats["builds"] - builds,
               new_shape_build_s=round(engine.stats["build_seconds"] - build_s, 4))
    # host overhead: a tiny problem, so the GPU keeps up and the wall time per call is the host's
    b, s, h, d = 1, 128, 1, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out["ours_forward_host_us"] = _host_us(lambda: engine.forward(q, k, v, aux, cfg))
    frontend_execute = CudnnFrontendEngine(execute_path="ordered")
    out["ours_frontend_execute_host_us"] = _host_us(lambda: frontend_execute.forward(q, k, v, aux, cfg))
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    out["ours_autograd_host_us"] = _host_us(lambda: engine(qg, kg, vg, aux, cfg))
    qt, kt, vt = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt.requires_grad_(True)  # torch then computes the log-sum-exp too, as ours always does

    def torch_call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    out["torch_sdpa_host_us"] = _host_us(torch_call)
    out["host_gap_us"] = round(out["ours_forward_host_us"] - out["torch_sdpa_host_us"], 1)
    out["execute_paths"] = sorted({c.path for c in engine._graphs.values()})
    out["plans"] = sorted({c.plan for c in engine._graphs.values()})
    out["engine_stats"] = dict(engine.stats)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="S = 1k and 4k only")
    ap.add_argument("--rounds", type=int, default=3, help="alternating ours/torch timing rounds per point")
    args = ap.parse_args()
    from attn_dispatch.backends import get_engine

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn_runtime": torch.backends.cudnn.version()}
    engine = get_engine("cudnn_fused:frontend")
    import cudnn

    meta.update(cudnn_frontend=cudnn.__version__, cudnn_backend=cudnn.backend_version_string())
    started = time.perf_counter()
    rows = []
    for d, s, b, h in GRID:
        if args.quick and s > 4096:
            continue
        for causal in (False, True):
            try:
                rows.append(point(engine, d, s, b, h, causal, args.rounds))
            except Exception as exc:  # noqa: BLE001
                rows.append({"D": d, "S": s, "B": b, "H": h, "causal": causal,
                             "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)})
            print(f"  D={d} S={s} causal={causal}: {rows[-1]}", flush=True)
    try:
        overhead = build_and_overhead(engine)
    except Exception as exc:  # noqa: BLE001
        overhead = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
    result = {"machine": meta, "grid": rows, "overhead": overhead,
              "seconds": round(time.perf_counter() - started, 1)}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\ncuDNN attention, bf16, {meta['device']}, torch {meta['torch']}, cuDNN FE {meta['cudnn_frontend']} "
          f"/ backend {meta['cudnn_backend']} (TFLOP/s, median of {args.rounds} alternating rounds; ratio = "
          "torch ms / ours ms)")
    print(f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} | {'ours fwd':>8} {'torch fwd':>9} {'ratio [rounds]':>20} | "
          f"{'ours f+b':>8} {'torch f+b':>9} {'ratio [rounds]':>20}")
    worst = {"fwd": 9.9, "fwd_bwd": 9.9}
    for r in rows:
        if "error" in r:
            print(f"{r['D']:>4} {r['S']:>6} {r['B']}x{r['H']:<3} {str(r['causal']):>6} | ERROR {r['error'][:80]}")
            continue
        cells = []
        for kind in ("fwd", "fwd_bwd"):
            ratio = r.get(f"{kind}_ratio")
            if ratio:
                worst[kind] = min(worst[kind], ratio)
            spread = r.get(f"{kind}_round_ratios") or [0.0]
            cells.append(f"{r.get(f'ours_{kind}_tflops', 'err'):>8} {r.get(f'torch_{kind}_tflops', 'err'):>9} "
                         f"{ratio if ratio else '-':>6} [{min(spread):.3f}-{max(spread):.3f}]")
        print(f"{r['D']:>4} {r['S']:>6} {str(r['B']) + 'x' + str(r['H']):>6} {str(r['causal']):>6} | "
              + " | ".join(cells))
    print(f"worst ratio ours/torch: fwd {worst['fwd']}, fwd+bwd {worst['fwd_bwd']} (target >= 0.97); "
          f"D=128 S=4k non-causal fwd target >= 550 TFLOP/s")
    print("graph build / host overhead:", json.dumps(overhead))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
