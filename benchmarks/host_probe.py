"""A diagnostic of a benchmark run's host: microseconds per small op launched from Python (bench_user_step.py
records it in each run's environment, to compare with the lease's host factor).

A step's host time differs by machine: on the H100 leases that measured the held-out grids, small calls ran at
0.76-1.6x the profile's prediction, and which engine wins a near-tie follows it. This probe (a one-element add from
a Python loop, the least mean over a few short loops) did not follow that factor over three leases, so the policy
does not scale its predictions by it; the runs record it to compare with. They also record the host's CPU model and
the time of a fixed piece of pure Python (flash-attn-4's and cudnn-frontend's launches are mostly Python; FA2's
are C++). Over three H200 leases neither told a lease apart: the CPU model read the same generic name on each, and
the Python timing (3 loops then) 755-1648 us by process, 1648 and 857 in two processes of one lease.
"""
from __future__ import annotations

import functools
import math
import platform
import time

CALLS = 16   # launches per loop (a per-launch mean: 24 read the same)
LOOPS = 3
PYTHON_LOOPS = 10  # the Python timing's least of 3 read 755-1648 us by process on one machine type


def launch_us(device=None, calls: int = CALLS, loops: int = LOOPS) -> float:
    """Least mean microseconds per launch of torch.add(x, 1, out=y) on a one-element tensor of `device` (default:
    the current CUDA device), over `loops` loops of `calls`; the kernel is loaded by one launch first."""
    import torch

    device = torch.device("cuda") if device is None else torch.device(device)
    x = torch.zeros(1, device=device)
    y = torch.empty_like(x)
    torch.add(x, 1, out=y)
    best = math.inf
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(x, 1, out=y)
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    return best


@functools.lru_cache(maxsize=1)
def _measured(device_index: int) -> float:
    return round(launch_us(f"cuda:{device_index}"), 2)


def measured_launch_us() -> float | None:
    """launch_us() of this process's current CUDA device, measured once; None without CUDA or while a CUDA graph
    is being captured."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return None
    return _measured(torch.cuda.current_device())


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def python_us(loops: int = PYTHON_LOOPS) -> float:
    """Least microseconds over `loops` runs of a fixed piece of pure Python shaped like a launch's host work
    (keyword calls, dict and attribute lookups, a tuple key hashed), 1000 iterations each."""
    class Args:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    table = {(i, "bf16", 128): i for i in range(64)}
    best = math.inf
    for _ in range(loops):
        start = time.perf_counter()
        total = 0
        for i in range(1000):
            args = Args(b=i & 63, dtype="bf16", d=128, causal=bool(i & 1))
            total += table[(args.b, args.dtype, args.d)] + args.causal
        best = min(best, (time.perf_counter() - start) * 1e6)
    return round(best, 1)
