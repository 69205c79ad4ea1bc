"""FlashAttention engines on the GPU, side by side in one run: every installed FlashAttention provider, flash-attn-4
called directly (its own flash_attn_func), and torch's SDPA flash path (sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
which runs the same FA2 kernels as our flash_attn_2:torch provider.

bf16, D in {64, 128, 256}, S in {1k, 4k, 16k}, B x H as in ../shared/device/README.md, causal and not; forward and
forward+backward TFLOP/s (4*B*H*S^2*D flops forward, half when causal, 3.5x that for forward+backward), median of
triton.testing.do_bench (CUDA events when triton is missing). Inputs are bshd and require grad (so every path
computes the log-sum-exp, as a training step does); SDPA reads [b, h, s, d] views of the same tensors.

JIT is kept out of the timings: every configuration is run once before it is timed, and flash-attn-4's first call
per configuration (compile + run) is reported separately, with the compile seconds the engine measured.
One failing point never stops the others; the JSON goes to --out and a table is printed last.
Usage: python3 benchmarks/bench_flash.py --out $OUT/flash.json [--quick]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attn_dispatch.backends.base import AttnAux, AttnConfig  # noqa: E402

GRID = [  # (D, S, B, H) from the device README
    (64, 1024, 32, 16), (64, 4096, 8, 16), (64, 16384, 2, 16),
    (128, 1024, 32, 16), (128, 4096, 8, 16), (128, 16384, 2, 16),
    (256, 1024, 32, 8), (256, 4096, 8, 8), (256, 16384, 2, 8),
]
ENGINES = ("flash_attn_4:cute", "flash_attn_3:interface", "flash_attn_2:package", "flash_attn_2:torch")
TARGET_FA4_FWD = 680.0        # TFLOP/s, D=128 S=4k non-causal (issue 5)
TARGET_TORCH_VS_SDPA = 0.97   # flash_attn_2:torch within 3% of torch's SDPA flash path


def bench(fn, grad_to_none=None) -> float:
    """Median milliseconds of fn()."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        try:
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
        except TypeError:
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5])[0])
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        for t in grad_to_none or ():
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tflops(b, h, s, d, causal, ms, backward) -> float:
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12


def installed_engines() -> tuple[dict, dict]:
    """{provider: engine} for every FlashAttention provider whose table passes its platform/package checks here."""
    from attn_dispatch import AttentionParams, EnvFlags, Platform
    from attn_dispatch.backends import get_engine
    from attn_dispatch.constraints import TABLES

    platform, env = Platform.detect(), EnvFlags.from_environ({})
    probe = AttentionParams(dtype="bf16", batch_size=1, num_heads=16, head_dim_qk=128, max_seqlen_q=1024)
    engines, absent = {}, {}
    for provider in ENGINES:
        table = TABLES[provider]
        topics = {c.code: c.topic for c in table.checks}
        reasons = [r.message for r in table.evaluate(probe, platform, env).reasons
                   if topics.get(r.code) in ("platform", "package", "environment")]
        if reasons:
            absent[provider] = reasons
            continue
        start = time.perf_counter()
        try:
            engines[provider] = get_engine(provider)
        except Exception as exc:  # noqa: BLE001 - an engine that fails to load is reported, the rest still run
            absent[provider] = [f"failed to load: {type(exc).__name__}: {exc}"]
            continue
        print(f"  loaded {provider} in {time.perf_counter() - start:.1f} s", flush=True)
    return engines, absent


def implementations(engines: dict, q, k, v, dout, causal: bool, scale: float) -> dict:
    """name -> (forward callable, forward+backward callable)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = AttnConfig(attn_mask_type="causal" if causal else "no_mask", window_size=(-1, 0) if causal else (-1, -1),
                     softmax_scale=scale)
    aux = AttnAux()
    impls = {}
    for provider, engine in engines.items():
        impls[provider] = (lambda e=engine: e(q, k, v, aux, cfg)[0],
                           lambda e=engine: e(q, k, v, aux, cfg)[0].backward(dout))
    if "flash_attn_4:cute" in engines:
        from flash_attn.cute import flash_attn_func

        impls["fa4_direct"] = (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)[0],
                               lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)[0].backward(dout))
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    impls["sdpa_flash"] = (sdpa, lambda: sdpa().backward(dt))
    return impls


def point(engines: dict, d: int, s: int, b: int, h: int, causal: bool) -> dict:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    row = {"D": d, "S": s, "B": b, "H": h, "causal": causal}
    fa4 = engines.get("flash_attn_4:cute")
    for name, (fwd, fwd_bwd) in implementations(engines, q, k, v, dout, causal, 1.0 / math.sqrt(d)).items():
        for kind, fn, backward in (("fwd", fwd, False), ("fwd_bwd", fwd_bwd, True)):
            try:
                events = len(fa4.jit_events) if name == "flash_attn_4:cute" else 0
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn()  # warm-up: JIT compiles (flash-attn-4), cuDNN/cuBLAS handles, allocator
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                for t in (q, k, v):
                    t.grad = None
                if name == "flash_attn_4:cute":
                    compiled = fa4.jit_events[events:]
                    row[f"{name}_{kind}_first_call_s"] = round(first, 3)
                    row[f"{name}_{kind}_jit_s"] = round(sum(e["seconds"] for e in compiled), 3)
                ms = bench(fn, grad_to_none=[q, k, v] if backward else None)
                row[f"{name}_{kind}_ms"] = round(ms, 4)
                row[f"{name}_{kind}_tflops"] = round(tflops(b, h, s, d, causal, ms, backward), 1)
            except Exception as exc:  # noqa: BLE001 - one failing point must not stop the grid
                row[f"{name}_{kind}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for kind in ("fwd", "fwd_bwd"):
        ours, theirs = row.get(f"flash_attn_2:torch_{kind}_tflops"), row.get(f"sdpa_flash_{kind}_tflops")
        if ours and theirs:
            row[f"torch_vs_sdpa_{kind}"] = round(ours / theirs, 3)
        ours, theirs = row.get(f"flash_attn_4:cute_{kind}_tflops"), row.get(f"fa4_direct_{kind}_tflops")
        if ours and theirs:
            row[f"fa4_engine_vs_direct_{kind}"] = round(ours / theirs, 3)
    del q, k, v, dout
    torch.cuda.empty_cache()
    return row


def versions(absent: dict) -> dict:
    meta = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "flash-attn", "flash-attn-3", "triton"):
        try:
            meta[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            meta[dist] = None
    meta["not_benchmarked"] = absent
    return meta


def summary(rows: list[dict]) -> dict:
    out = {}
    fa4 = [r for r in rows if r["D"] == 128 and r["S"] == 4096 and not r["causal"]]
    if fa4 and fa4[0].get("flash_attn_4:cute_fwd_tflops"):
        value = fa4[0]["flash_attn_4:cute_fwd_tflops"]
        out["fa4_fwd_d128_s4k_tflops"] = value
        out["fa4_fwd_target_met"] = value >= TARGET_FA4_FWD
    for kind in ("fwd", "fwd_bwd"):
        ratios = [r[f"torch_vs_sdpa_{kind}"] for r in rows if f"torch_vs_sdpa_{kind}" in r]
        if ratios:
            out[f"torch_vs_sdpa_{kind}_min"] = min(ratios)
            out[f"torch_vs_sdpa_{kind}_target_met"] = min(ratios) >= TARGET_TORCH_VS_SDPA
    jit = [(r["D"], r["causal"], kind, r.get(f"flash_attn_4:cute_{kind}_jit_s"))
           for r in rows for kind in ("fwd", "fwd_bwd") if r.get(f"flash_attn_4:cute_{kind}_jit_s")]
    out["fa4_jit_s"] = [{"D": d, "causal": c, "phase": kind, "compile_s": s} for d, c, kind, s in jit]
    return out


def print_table(rows: list[dict], names: list[str], result: dict) -> None:
    short = {"flash_attn_4:cute": "fa4", "fa4_direct": "fa4-direct", "flash_attn_3:interface": "fa3",
             "flash_attn_2:package": "fa2-pkg", "flash_attn_2:torch": "fa2-torch", "sdpa_flash": "sdpa-flash"}
    head = f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} " + " ".join(f"{short.get(n, n):>15}" for n in names)
    lines = ["", f"FlashAttention TFLOP/s (fwd / fwd+bwd), bf16, {result['machine']['device']}, torch "
                 f"{result['machine']['torch']}, flash-attn-4 {result['machine'].get('flash-attn-4')}", head]
    for r in rows:
        cells = []
        for n in names:
            f, fb = r.get(f"{n}_fwd_tflops"), r.get(f"{n}_fwd_bwd_tflops")
            cells.append(f"{(f'{f:.0f}' if f else 'err'):>7} / {(f'{fb:.0f}' if fb else 'err'):<5}")
        lines.append(f"{r['D']:>4} {r['S']:>6} {str(r['B']) + 'x' + str(r['H']):>6} {str(r['causal']):>6} "
                     + " ".join(f"{c:>15}" for c in cells))
        for key in sorted(k for k in r if k.endswith("_error")):
            lines.append(f"      {key}: {r[key][:140]}")
    s = result["summary"]
    if "fa4_fwd_d128_s4k_tflops" in s:
        lines.append(f"flash-attn-4 fwd D=128 S=4k non-causal: {s['fa4_fwd_d128_s4k_tflops']} TFLOP/s "
                     f"(target >= {TARGET_FA4_FWD:.0f}: {'met' if s['fa4_fwd_target_met'] else 'NOT met'})")
    for kind in ("fwd", "fwd_bwd"):
        if f"torch_vs_sdpa_{kind}_min" in s:
            lines.append(f"flash_attn_2:torch / SDPA flash, {kind}: min ratio {s[f'torch_vs_sdpa_{kind}_min']} "
                         f"(target >= {TARGET_TORCH_VS_SDPA}: "
                         f"{'met' if s[f'torch_vs_sdpa_{kind}_target_met'] else 'NOT met'})")
    if s.get("fa4_jit_s"):
        lines.append("flash-attn-4 JIT compile seconds per configuration (first call, excluded from timings): "
                     + ", ".join(f"D{j['D']}{'c' if j['causal'] else ''}/{j['phase']}={j['compile_s']}"
                                 for j in s["fa4_jit_s"]))
    if result["machine"]["not_benchmarked"]:
        lines.append("not benchmarked: " + "; ".join(f"{p}: {' / '.join(r)[:120]}"
                                                     for p, r in result["machine"]["not_benchmarked"].items()))
    lines.append(f"total {result['seconds']} s")
    print("\n".join(lines), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="S = 1k and 4k only")
    args = ap.parse_args()
    started = time.perf_counter()
    engines, absent = installed_engines()
    rows = []
    for d, s, b, h in GRID:
        if args.quick and s > 4096:
            continue
        for causal in (False, True):
            try:
                rows.append(point(engines, d, s, b, h, causal))
            except Exception as exc:  # noqa: BLE001
                rows.append({"D": d, "S": s, "B": b, "H": h, "causal": causal,
                             "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)})
            print(f"  D={d} S={s} causal={causal} done at {time.perf_counter() - started:.0f} s", flush=True)
    names = list(engines) + (["fa4_direct"] if "flash_attn_4:cute" in engines else []) + ["sdpa_flash"]
    result = {"machine": versions(absent), "implementations": names, "grid": rows,
              "seconds": round(time.perf_counter() - started, 1)}
    result["summary"] = summary(rows)
    if "flash_attn_4:cute" in engines:
        result["fa4_jit_events"] = engines["flash_attn_4:cute"].jit_events
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print_table(rows, names, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
