"""Where an FP8 module step spends its time (cuDNN FP8 on the GPU), and how fast each quantization variant runs.

    source .gpu-wheels/a2/env.sh && python3 benchmarks/gpu/profile_fp8_module.py --out $OUT/fp8_profile.json

1. quantization of q, k, v (64k tokens x 16 heads x 128, bf16 -> E4M3) by the package's kernel and by variants
   (block size, warps, amax into per-block partials instead of one atomic address), against a bf16 clone of the
   same tensors (the copy bandwidth) and an unsaturated torch cast, interleaved call by call;
2. torch.profiler over the module's FP8 forward and step (delayed and current scaling) and the bf16 module on
   cuDNN: the CUDA time of each kernel name, and the host time per call.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from attn_dispatch import DotProductAttention, fp8_autocast  # noqa: E402
from attn_dispatch.fp8 import DelayedScaling, Float8CurrentScaling  # noqa: E402
from attn_dispatch.fp8 import quantize as fp8q  # noqa: E402
from probe_fp8 import time_interleaved  # noqa: E402

E4M3 = torch.float8_e4m3fn


@triton.jit
def _q_atomic(x_ptr, y_ptr, scale_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = tl.clamp(x * tl.load(scale_ptr), -448.0, 448.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _q_partial(x_ptr, y_ptr, scale_ptr, part_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = tl.clamp(x * tl.load(scale_ptr), -448.0, 448.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(part_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _q_none(x_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y = tl.clamp(x * tl.load(scale_ptr), -448.0, 448.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


def quant_variants(tokens=65536, h=16, d=128):
    xs = [torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    n = xs[0].numel()
    ys = [torch.empty(x.shape, dtype=E4M3, device="cuda") for x in xs]
    scale = torch.ones(1, device="cuda")
    amax = torch.zeros(3, device="cuda")

    def pkg():
        for i, x in enumerate(xs):
            fp8q.quantize(x, scale, E4M3, amax_into=amax[i:i + 1])

    def atomic(block, warps):
        def run():
            for i, x in enumerate(xs):
                _q_atomic[(triton.cdiv(n, block),)](x, ys[i], scale, amax[i:i + 1], n, BLOCK=block, num_warps=warps)
        return run

    def partial(block, warps):
        parts = torch.empty(3, triton.cdiv(n, block), device="cuda")

        def run():
            for i, x in enumerate(xs):
                _q_partial[(triton.cdiv(n, block),)](x, ys[i], scale, parts[i], n, BLOCK=block, num_warps=warps)
            torch.amax(parts, 1, out=amax)
        return run

    def none(block, warps):
        def run():
            for i, x in enumerate(xs):
                _q_none[(triton.cdiv(n, block),)](x, ys[i], scale, n, BLOCK=block, num_warps=warps)
        return run

    def clone():
        for x in xs:
            x.clone()

    def cast():
        for x in xs:
            x.to(E4M3)

    o8 = ys[0]

    def deq():
        fp8q.dequantize(o8, scale, torch.bfloat16)

    fns = {"package": pkg, "clone_bf16": clone, "torch_cast": cast, "dequantize_one": deq}
    for block, warps in ((4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16)):
        fns[f"atomic_b{block}_w{warps}"] = atomic(block, warps)
        fns[f"partial_b{block}_w{warps}"] = partial(block, warps)
        fns[f"none_b{block}_w{warps}"] = none(block, warps)
    times = time_interleaved(fns, rounds=12, inner=5)
    bytes_q = 3 * n * (2 + 1)
    out = {}
    for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
        moved = 3 * n * 4 if name == "clone_bf16" else n * 3 if name == "dequantize_one" else bytes_q
        out[name] = {"ms": round(ms, 4), "GB_per_s": round(moved / ms / 1e6, 1)}
    return out


def kernel_table(prof, top=14):
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key[:90], round(cuda_us / 1000, 3), e.count))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def module_profile(s, causal, recipe_name, reps=5):
    b, h, d = max(1, 32768 // s) * 2, 16, 128
    mask = "causal" if causal else "no_mask"
    m8 = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask).cuda()
    m16 = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask, backend="cudnn_fused:frontend").cuda()
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(fp8_dpa=True) if recipe_name == "delayed" else Float8CurrentScaling(fp8_dpa=True)

    def fwd8():
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            m8(q, k, v)

    def step8():
        with fp8_autocast(recipe=recipe):
            out = m8(q, k, v)
        out.backward(dout)

    def fwd16():
        with torch.no_grad():
            m16(q, k, v)

    def step16():
        m16(q, k, v).backward(dout)

    fns = {"fp8_fwd": fwd8, "fp8_step": step8, "bf16_fwd": fwd16, "bf16_step": step16}
    times = time_interleaved(fns, rounds=8, inner=2)
    row = {"s": s, "b": b, "causal": causal, "recipe": recipe_name, "engine": m8.last_decision.chosen,
           "ms": {k2: round(v2, 4) for k2, v2 in times.items()}}
    for name in ("fp8_fwd", "fp8_step"):
        fn = fns[name]
        fn()
        torch.cuda.synchronize()
        host = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - host) / reps
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        row[name + "_kernels_ms_per_call"] = [(k2, round(t / reps, 4), c // reps)
                                              for k2, t, c in kernel_table(prof)]
        row[name + "_host_ms_enqueue"] = round(host * 1000, 3)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import cudnn

    meta = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(meta, flush=True)
    result = {"meta": meta, "quantize": quant_variants(), "modules": []}
    print(json.dumps(result["quantize"], indent=0), flush=True)
    for s, causal, recipe in ((8192, True, "delayed"), (16384, False, "delayed"), (8192, True, "current")):
        row = module_profile(s, causal, recipe)
        result["modules"].append(row)
        print(json.dumps(row, indent=0), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
