"""Log-sum-exp algebra: merging partial attention results exactly, and the softmax sink applied once.

A partial result over a key subset K_i is (o_i, l_i) with l_i = log sum_{j in K_i} exp(s_j) and
o_i = sum_{j in K_i} exp(s_j - l_i) v_j. Over the union: l = log(exp(l_a) + exp(l_b)) and
o = exp(l_a - l) o_a + exp(l_b - l) o_b. A sink logit t (per head) is one more "key" with value 0:
l_tot = log(exp(l) + exp(t)), o_tot = exp(l - l_tot) o. Folding it into every ring step would count it
cp_size times; it enters once, at the end.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _merge_kernel
from ._layout import head_vector_as_lse, lse_as_out, row_dot

NEG_INF = float("-inf")


class BlockState(NamedTuple):
    """What one engine call left for its backward. The block's own output is kept alive until backward
    because an engine may recognise "its" out by address (the unfused engine then substitutes a float32
    copy); if the block output were freed, the merged out could be allocated at that address and be
    mistaken for it."""

    state: Any
    block_out: torch.Tensor


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulators (out, lse, dq, dk, dv) are float32, float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """Rows with no key at all (-inf) get weights exp(-inf - 0) = 0 instead of NaN."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def merge_to(out: torch.Tensor, lse_out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor,
             out_b: torch.Tensor, lse_b: torch.Tensor, fmt: str) -> None:
    """out, lse_out <- the merge of (out_a, lse_a) and (out_b, lse_b). Outputs in the format's layout, lse as
    _layout says; any of them may be views (halves of a shard), out may be out_a (in place), and each output may
    have any float dtype (the arithmetic is float32, float64 for float64). On CUDA one Triton pass
    (_merge_kernel); elsewhere torch ops."""
    if _merge_kernel.usable(out, lse_out, out_a, lse_a, out_b, lse_b):
        _merge_kernel.merge(out, lse_out, out_a, lse_a, out_b, lse_b, fmt)
        return
    lse_new = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    ref = _safe(lse_new)
    w_a = lse_as_out(torch.exp(lse_a - ref), fmt)
    w_b = lse_as_out(torch.exp(lse_b.to(ref.dtype) - ref), fmt)
    if out is out_a:  # a float32 accumulator: scaled and added to where it lies
        out.mul_(w_a).addcmul_(out_b, w_b)
    else:
        out.copy_(torch.addcmul(out_a.to(ref.dtype) * w_a, out_b, w_b))
    lse_out.copy_(lse_new)


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor,
           fmt: str) -> None:
    """In place: (out_acc, lse_acc) <- merge of itself with (out_i, lse_i). out_acc and lse_acc are float32
    (they may be views of larger accumulators); out_i may be any float dtype."""
    merge_to(out_acc, lse_acc, out_acc, lse_acc, out_i, lse_i, fmt)


def sink_logits(softmax_type: str, softmax_offset: torch.Tensor | None, num_heads: int,
                device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The per-head sink logit [h] for this softmax type, or None for 'vanilla'."""
    if softmax_type == "vanilla":
        return None
    if softmax_type == "off-by-one":
        return torch.zeros(num_heads, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                           device=device)
    if softmax_offset is None:
        raise ValueError("softmax_type='learnable' needs softmax_offset (the per-head sink logit, fp32 [h]); got None")
    if softmax_offset.shape != (num_heads,):
        raise ValueError(f"softmax_offset has shape {tuple(softmax_offset.shape)}; expected ({num_heads},), "
                         "one sink logit per query head")
    return softmax_offset.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over the real keys -> (out, lse) with the sink in the normalisation. out is float32."""
    lse_tot = torch.logaddexp(lse, head_vector_as_lse(sink, fmt))
    return out * lse_as_out(torch.exp(lse - lse_tot), fmt), lse_tot


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse_tot: torch.Tensor, sink: torch.Tensor,
              fmt: str) -> torch.Tensor:
    """dL/dt for the sink t of each head, over the rows given: -sum_rows p_sink * rowsum(dout * out),
    where p_sink = exp(t - lse_tot) is the probability the sink takes."""
    p_sink = torch.exp(head_vector_as_lse(sink, fmt) - lse_tot)
    contrib = p_sink * row_dot(dout, out, fmt)
    dims = [d for d in range(contrib.dim()) if d != (1 if fmt in ("bshd", "sbhd") else 0)]
    return -contrib.sum(dim=dims)
