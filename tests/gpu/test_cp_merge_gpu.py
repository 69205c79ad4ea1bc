"""The Triton merge of partial attention results (context_parallel/_merge_kernel.py) against float64 arithmetic
on fresh random inputs: every qkv_format, views of halves, rows with no key on one or both sides, in place,
and outputs in 16-bit and 32-bit floats."""
from __future__ import annotations

import pytest
import torch

from attn_dispatch.context_parallel import _merge_kernel
from attn_dispatch.context_parallel._layout import lse_as_out
from attn_dispatch.context_parallel.merge import merge_, merge_to

pytestmark = pytest.mark.gpu


def _reference(o_a, l_a, o_b, l_b, fmt):
    l_a, l_b = l_a.double().cpu(), l_b.double().cpu()
    lse = torch.logaddexp(l_a, l_b)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)
    out = lse_as_out(torch.exp(l_a - ref), fmt) * o_a.double().cpu() + lse_as_out(torch.exp(l_b - ref), fmt) * \
        o_b.double().cpu()
    return out, lse


def _case(fmt: str, dtype: torch.dtype, gen: torch.Generator):
    b, s, h, d = 2, 96, 5, 80
    shape = {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "thd": (s, h, d)}[fmt]
    lse_shape = (h, s) if fmt == "thd" else (b, h, s)
    o_a, o_b = (torch.randn(shape, generator=gen).to("cuda", dtype) for _ in range(2))
    l_a, l_b = (torch.randn(lse_shape, generator=gen).mul_(3).cuda() for _ in range(2))
    seq = -1
    l_a.select(seq, 3).fill_(float("-inf"))  # a row with no key on one side
    l_a.select(seq, 7).fill_(float("-inf"))
    l_b.select(seq, 7).fill_(float("-inf"))  # and on neither
    return o_a, l_a, o_b, l_b


@pytest.mark.skipif(_merge_kernel.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_matches_float64(fmt, dtype):
    gen = torch.Generator().manual_seed(7)
    o_a, l_a, o_b, l_b = _case(fmt, dtype, gen)
    want, want_lse = _reference(o_a, l_a, o_b, l_b, fmt)
    assert _merge_kernel.usable(o_a, l_a, o_b, l_b)
    for out_dtype in (dtype, torch.float32):
        out = torch.empty(o_a.shape, dtype=out_dtype, device="cuda")
        lse = torch.empty_like(l_a)
        merge_to(out, lse, o_a, l_a, o_b, l_b, fmt)
        tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)
    # in place, into a float32 accumulator, and into the second half's rows (views) only
    acc, acc_lse = o_a.to(torch.float32, copy=True), l_a.clone()
    merge_(acc, acc_lse, o_b, l_b, fmt)
    torch.testing.assert_close(acc.double().cpu(), want, rtol=1e-5, atol=1e-5)
    seq_dim, half = (0 if fmt in ("sbhd", "thd") else 1), o_a.shape[0 if fmt in ("sbhd", "thd") else 1] // 2
    acc, acc_lse = o_a.to(torch.float32, copy=True), l_a.clone()
    merge_to(acc.narrow(seq_dim, half, half), acc_lse.narrow(-1, half, half), acc.narrow(seq_dim, half, half),
             acc_lse.narrow(-1, half, half), o_b.narrow(seq_dim, half, half), l_b.narrow(-1, half, half), fmt)
    torch.testing.assert_close(acc.narrow(seq_dim, half, half).double().cpu(),
                               want.narrow(seq_dim, half, half), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc.narrow(seq_dim, 0, half), o_a.float().narrow(seq_dim, 0, half))  # untouched
