"""Peak memory of attention forward + backward: the unfused engine (query blocks, recompute in backward)
against a naive implementation that materialises the [b, h, S, S] score matrix, at S = 4k, 8k, 16k.

Each measurement runs in its own process: on the GPU, torch.cuda.max_memory_allocated() above what the
inputs hold; on the CPU, the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
where the kernel allows) above the resident set once the inputs exist. The target is unfused <= 1/8 of
naive at 16k. It also cross-checks the two outputs and gradients at the smallest S.

    python benchmarks/bench_unfused_memory.py --device cpu --out benchmarks/results/unfused_memory_cpu.json
    python benchmarks/bench_unfused_memory.py --device cuda --out $OUT/unfused_memory_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_RATIO = 1 / 8


# ---------------------------------------------------------------------------------------------
# Worker side: one implementation, one sequence length
# ---------------------------------------------------------------------------------------------
def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def naive_attention(q, k, v, causal: bool, scale: float):
    """What a plain implementation does: the whole score matrix in float32, softmax, times V."""
    import torch

    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))  # [b, h, s, d]
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vh).transpose(1, 2).to(q.dtype)


def worker(args) -> dict:
    import torch

    from attn_dispatch import DotProductAttention

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, generator=gen, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
    scale = args.head_dim ** -0.5
    if args.impl == "unfused":
        dpa = DotProductAttention(args.heads, args.head_dim, qkv_format="bshd",
                                  attn_mask_type="causal" if args.causal else "no_mask", backend="unfused").to(dev)

        def run():
            return dpa(q, k, v).view(shape)
    else:
        def run():
            return naive_attention(q, k, v, args.causal, scale)

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset = _reset_cpu_peak()
        base = _rss("VmRSS")
    t0 = time.perf_counter()
    status = "ok"
    try:
        out = run()
        out.backward(dout)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        status = "oom"
    seconds = time.perf_counter() - t0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        method = "torch.cuda.max_memory_allocated() - memory_allocated() before the call"
    else:
        peak = _rss("VmHWM") - base
        method = "VmHWM - VmRSS before the call" + ("" if reset else " (VmHWM not resettable: upper bound)")
    result = {"impl": args.impl, "seqlen": args.seqlen, "status": status, "peak_bytes": peak, "seconds": seconds,
              "method": method}
    if status == "ok" and args.save_outputs:
        torch.save({"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()},
                   args.save_outputs)
    return result


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------
def run_worker(opts, impl: str, seqlen: int, save: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--impl", impl, "--seqlen", str(seqlen), "--device", opts.device,
           "--dtype", opts.dtype, "--batch", str(opts.batch), "--heads", str(opts.heads),
           "--head-dim", str(opts.head_dim)] + (["--causal"] if opts.causal else []) + \
        (["--save-outputs", save] if save else [])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"impl": impl, "seqlen": seqlen, "status": "failed", "error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cross_check(opts, seqlen: int, tmp: pathlib.Path) -> dict:
    """Unfused vs naive at one size: relative errors of out and the three gradients."""
    import torch

    paths = {impl: tmp / f"{impl}_{seqlen}.pt" for impl in ("unfused", "naive")}
    for impl, path in paths.items():
        if run_worker(opts, impl, seqlen, save=str(path))["status"] != "ok":
            return {"seqlen": seqlen, "status": "skipped"}
    a, b = (torch.load(paths[i]) for i in ("unfused", "naive"))
    errors = {key: ((a[key].double() - b[key].double()).abs().max() / b[key].double().abs().max()).item()
              for key in a}
    return {"seqlen": seqlen, "status": "ok", "rel_err_vs_naive": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default: 1 on the CPU, 8 on the GPU")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on the GPU")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="unfused", help=argparse.SUPPRESS)
    parser.add_argument("--seqlen", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--save-outputs", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.heads = opts.heads or (8 if opts.device == "cuda" else 1)
    opts.dtype = opts.dtype or ("bfloat16" if opts.device == "cuda" else "float32")
    if opts.worker:
        print(json.dumps(worker(opts)))
        return

    rows = []
    for seqlen in opts.seqlens:
        pair = {impl: run_worker(opts, impl, seqlen) for impl in ("unfused", "naive")}
        ok = all(r["status"] == "ok" for r in pair.values())
        ratio = pair["unfused"]["peak_bytes"] / pair["naive"]["peak_bytes"] if ok else None
        rows.append({"seqlen": seqlen, "unfused": pair["unfused"], "naive": pair["naive"], "ratio": ratio})
        print(_row(rows[-1]), flush=True)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        check = cross_check(opts, min(opts.seqlens), pathlib.Path(tmp))
    largest = max(rows, key=lambda r: r["seqlen"])
    verdict = largest["ratio"] is not None and largest["ratio"] <= TARGET_RATIO
    report = {
        "benchmark": "unfused engine peak memory, forward + backward, vs naive full score matrix",
        "device": opts.device, "dtype": opts.dtype, "batch": opts.batch, "heads": opts.heads,
        "head_dim": opts.head_dim, "causal": opts.causal, "rows": rows, "cross_check": check,
        "target": f"unfused <= {TARGET_RATIO:.3f} x naive at S={largest['seqlen']}", "target_met": verdict,
    }
    print(f"cross-check at S={check['seqlen']}: {check.get('rel_err_vs_naive', check['status'])}")
    print(f"target {report['target']}: {'met' if verdict else 'NOT met'}")
    if opts.out:
        pathlib.Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(opts.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {opts.out}")


def _row(row: dict) -> str:
    def mib(r):
        if r["status"] != "ok":
            return f"{r['status']:>22}"
        return f"{r['peak_bytes'] / 2**20:9.1f} MiB {r['seconds']:7.2f} s"
    ratio = f"{row['ratio']:.4f}" if row["ratio"] is not None else "n/a"
    return f"S={row['seqlen']:6d}  unfused {mib(row['unfused'])}   naive {mib(row['naive'])}   ratio {ratio}"


if __name__ == "__main__":
    main()
