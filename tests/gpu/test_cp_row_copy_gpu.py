"""a2a's one-pass row copies compiled by Triton (context_parallel/_row_copy.py) against the per-piece torch copies
they replaced, on random data on the GPU, bit for bit: every pass of a forward and a backward for thd, bshd and sbhd,
2, 4 and 8 ranks, identity and load-balanced orders, odd head counts per group, both kinds of exchange, 16-bit and
32-bit rows, 16-byte and 2-byte units; one call at the benchmark's shape (32k tokens over 2 ranks, 16 heads of 128);
one kernel launch per pass; and a whole call through A2AAttention (ranks as threads) against the per-piece path.

    python -m pytest -q tests/gpu/test_cp_row_copy_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from attn_dispatch.context_parallel import _row_copy

from a2a_passes_reference import _copies, check_passes, local_inputs, make_attention
from test_cp_a2a_own_row import _run

ONE = ["_copy_rows_kernel"]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_row_copy.triton is None, reason="Triton is not installed")]


def test_the_self_check_passes():
    device = torch.device("cuda", torch.cuda.current_device())
    assert _row_copy.self_check(device) is None
    assert _row_copy.triton_ready(device)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("keeps_own_row", [True, False])
@pytest.mark.parametrize("dtype,skew", [(torch.bfloat16, 0), (torch.float16, 1), (torch.float32, 0)])
def test_kernel_equals_the_per_piece_copies(fmt, size, balanced, keeps_own_row, dtype, skew):
    assert _row_copy.triton_ready(torch.device("cuda", torch.cuda.current_device()))
    check_passes(fmt, size, balanced, 2 if size < 8 else 1, keeps_own_row, 3, dtype, "cuda", "auto", seed=size,
                 skew=skew)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_torch_index_ops_on_the_gpu_equal_the_per_piece_copies(fmt, keeps_own_row):
    """The fallback where the kernel is off: index_copy_ / index_select(out=) into strided views on CUDA."""
    check_passes(fmt, 4, True, 2, keeps_own_row, 3, torch.bfloat16, "cuda", "torch", skew=1)


def test_kernel_at_the_benchmark_shape():
    """bshd, 32k tokens over 2 ranks, 16 heads of 128 (8 per rank), bf16: 16-byte units, tens of thousands of tiles."""
    check_passes("bshd", 2, True, 1, True, 8, torch.bfloat16, "cuda", "auto", skew=0, batch=1, local=16384, d=128,
                 dv=128)


def _kernels(fn) -> list[str]:
    """The kernels fn launches (copies of the host's tables left out)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_each_pass_is_one_launch(keeps_own_row):
    gen = torch.Generator().manual_seed(3)
    size, groups = 4, 2
    q, k, v = local_inputs("bshd", size, groups, 3, torch.bfloat16, "cuda", gen, skew=0)
    a2a = make_attention("bshd", size, size - 1, groups, True, keeps_own_row, q.shape[1], "cuda")
    with _copies(_row_copy, "auto"):
        buf, layout = a2a._pack("fwd_in", (q, k, v))
        a2a.exchange.buffer = lambda *_: buf  # the test exchange fills a fresh buffer with NaN: not the pass's launch
        assert _kernels(lambda: a2a._pack("fwd_in", (q, k, v))) == ONE
        own = a2a._own((q, k, v), 0)
        parts = [own if p == size - 1 else buf[0, p] for p in range(size)] if keeps_own_row else buf[0]
        wholes = a2a._unpack(parts, layout)
        assert _kernels(lambda: a2a._unpack(parts, layout)) == ONE
        dests = [torch.empty_like(t) for t in (q, k, v)]
        assert _kernels(lambda: a2a._send_back(wholes, buf[1], layout, dests, 1)) == ONE
        assert _kernels(lambda: a2a._place(dests, [buf[0], buf[1]], layout)) == ONE


@pytest.mark.parametrize("fmt,mask", [("bshd", "causal"), ("sbhd", "no_mask")])
@pytest.mark.parametrize("keeps_own_row", [True, False])
def test_a_whole_call_is_bit_for_bit_the_per_piece_path(monkeypatch, fmt, mask, keeps_own_row):
    gen = torch.Generator().manual_seed(5)
    size, groups = 2, 2
    b, s, h, d = 2, 64 * size, 4 * size * groups, 64
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    q, k, v, dout = (torch.randn(shape, generator=gen).cuda() for _ in range(4))
    results = {}
    for mode in ("auto", "pieces"):
        monkeypatch.setenv(_row_copy.COPIES_ENV, mode)
        results[mode] = _run(fmt, mask, size, groups, keeps_own_row, q, k, v, dout)
    for rank in range(size):
        for name, got, want in zip(("out", "dq", "dk", "dv"), results["auto"][rank], results["pieces"][rank]):
            assert torch.equal(got, want), f"rank {rank} {name}"
