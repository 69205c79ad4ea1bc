"""Timing shared by bench_cudnn.py and bench_flash.py: triton's do_bench, as the device README's grid was
measured (CUDA events when triton is missing), and the FLOP count that grid uses."""
from __future__ import annotations

import statistics

import torch


def bench(fn, grad_to_none=None) -> float:
    """Median milliseconds of fn(): triton's do_bench with its defaults (CUDA events when triton is missing)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        try:
            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
        except TypeError:  # triton before return_mode
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
    return statistics.median(times)


def tflops(b, h, s, d, causal, ms, backward) -> float:
    """4*B*H*S^2*D forward (half when causal), 3.5x that for forward + backward."""
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12
