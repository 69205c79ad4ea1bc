"""benchmarks/bench_cp.py --profile: the per-rank summary of a profiled step, on a trace with known answers."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cp.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel(name, start, dur, stream):
    return {"cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}


def test_trace_summary(bench):
    steps = bench.PROFILED_STEPS
    events = [_kernel("flash_fwd_kernel", 0, 100, 7), _kernel("_merge_kernel", 100, 10, 7),
              _kernel("flash_bwd_dq_dk_dv_loop", 150, 100, 7),       # the compute stream idles 110..150
              _kernel("vectorized_elementwise_kernel", 400, 5, 9),   # another stream: not the compute stream
              _kernel("ncclDevKernel_SendRecv", 50, 80, 20),         # 60 of its 80 us under compute
              _kernel("ncclDevKernel_AllToAll", 260, 40, 20),        # none of it under compute
              {"cat": "user_annotation", "name": "cp_a2a_wait:fwd_out:0", "ts": 0, "dur": 30}]
    got = bench.summarise_trace(events)
    assert got["attention_ms"] == pytest.approx(0.200 / steps)
    assert got["merge_ms"] == pytest.approx(0.010 / steps)
    assert got["nccl_ms"] == pytest.approx(0.120 / steps)
    assert got["other_kernels_ms"] == pytest.approx(0.005 / steps)
    assert got["compute_stream"] == 7 and got["kernels"] == 6
    assert got["compute_span_ms"] == pytest.approx(0.250 / steps)
    assert got["compute_idle_ms"] == pytest.approx(0.040 / steps)
    assert got["nccl_not_hidden_ms"] == pytest.approx(0.060 / steps)
    assert got["host_a2a_wait_ms"] == pytest.approx(0.030 / steps)


def test_intervals(bench):
    assert bench._union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert bench._overlap([(0, 3), (5, 6)], [(2, 5.5)]) == pytest.approx(1.5)
