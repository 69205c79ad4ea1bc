"""The interleaved timer's CUDA path: block samples (a synchronisation, a lead-in call, n calls between two events)
and confirmed cuts run every call they account for and report per-call times of real kernels. How much they cut the
timer's own noise is a benchmark's question (bench_user_step.py's pick_twin, the A/A spread)."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch.policy.timing import TimerSettings, time_interleaved

pytestmark = pytest.mark.gpu


def _matmuls(size: int, counts: dict, name: str):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, generator=gen, device="cuda")

    def fn() -> None:
        counts[name] += 1
        a @ a
    return fn


def test_block_timing_on_cuda_counts_its_calls_and_orders_real_work():
    counts = {"small": 0, "large": 0}
    fns = {"small": _matmuls(256, counts, "small"), "large": _matmuls(2048, counts, "large")}
    settings = TimerSettings(warmup=2, reps=4, max_reps=4, target_ms=0.0, confirm=2, block_ms=1.0)
    timings, errors = time_interleaved(fns, "cuda", settings)
    assert not errors
    small, large = timings["small"], timings["large"]
    assert small.calls_per_sample > 1 and small.calls_per_sample >= large.calls_per_sample >= 1
    assert small.reps == large.reps == 4
    # first call + estimate + 4 samples: blocks of (lead-in + n), or single calls where n would be 1; no warm
    # period, no cut, so no confirmation
    for name, timing in timings.items():
        n = timing.calls_per_sample
        assert counts[name] == 2 + 4 * (n + 1 if n > 1 else 1), name
    assert 0 < small.median_ms < large.median_ms  # 512x the flops


def test_a_confirmed_cut_on_cuda_keeps_its_samples():
    counts = {"small": 0, "large": 0}
    fns = {"small": _matmuls(128, counts, "small"), "large": _matmuls(4096, counts, "large")}
    settings = TimerSettings(warmup=2, reps=3, max_reps=3, target_ms=0.0, confirm=2, block_ms=1.0)
    timings, errors = time_interleaved(fns, "cuda", settings, cutoff_ratio=2.0)
    assert not errors and timings["large"].cut_short and not timings["small"].cut_short
    assert timings["large"].reps == 3 and counts["large"] == 1 + 3  # first call, estimate, two single calls
