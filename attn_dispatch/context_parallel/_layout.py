"""Where the sequence and heads live in each qkv_format, and the two halves of a load-balanced shard.

Shapes follow backends/base.py: bshd [b, s, h, d], sbhd [s, b, h, d], thd [t, h, d];
lse [b, h, s] for bshd/sbhd and [h, t] for thd.
"""
from __future__ import annotations

import torch

SEQ_DIM = {"bshd": 1, "sbhd": 0, "thd": 0}
HEAD_DIM = {"bshd": 2, "sbhd": 2, "thd": 1}
LSE_SEQ_DIM = {"bshd": 2, "sbhd": 2, "thd": 1}
NDIM = {"bshd": 4, "sbhd": 4, "thd": 3}


def lse_as_out(lse: torch.Tensor, fmt: str) -> torch.Tensor:
    """A view of lse that broadcasts against an output tensor of this format ([..., h, 1])."""
    if fmt == "bshd":
        return lse.transpose(1, 2).unsqueeze(-1)
    if fmt == "sbhd":
        return lse.permute(2, 0, 1).unsqueeze(-1)
    return lse.transpose(0, 1).unsqueeze(-1)


def head_vector_as_lse(vec: torch.Tensor, fmt: str) -> torch.Tensor:
    """A per-head vector [h] viewed to broadcast against lse."""
    return vec.view(1, -1, 1) if fmt in ("bshd", "sbhd") else vec.view(-1, 1)


def row_dot(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    """sum_d a*b per row, in float32 (float64 for float64), shaped like lse (FlashAttention's D)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    d = (a.to(acc) * b.to(acc)).sum(-1)  # bshd [b,s,h], sbhd [s,b,h], thd [t,h]
    if fmt == "bshd":
        return d.transpose(1, 2)
    if fmt == "sbhd":
        return d.permute(1, 2, 0)
    return d.transpose(0, 1)


class Halves:
    """The two chunks a rank holds in the load-balanced layout (chunk r, then chunk 2*cp-1-r).

    bshd/sbhd: the halves are narrow views along the sequence dim. thd: each sequence's local part is
    itself two halves, so the halves are index sets (cu_seqlens local, every length even)."""

    def __init__(self, fmt: str, local_len: int, cu_seqlens_local: torch.Tensor | None = None):
        self.fmt = fmt
        self.local_len = local_len
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None
        if fmt == "thd":
            assert cu_seqlens_local is not None
            starts = cu_seqlens_local[:-1].tolist()
            lens = (cu_seqlens_local[1:] - cu_seqlens_local[:-1]).tolist()
            first = [torch.arange(s, s + n // 2) for s, n in zip(starts, lens)]
            second = [torch.arange(s + n // 2, s + n) for s, n in zip(starts, lens)]
            dev = cu_seqlens_local.device
            self.index = (torch.cat(first).to(dev), torch.cat(second).to(dev))
            self.cu_half = (cu_seqlens_local // 2).to(torch.int32)
            self.max_half = max(lens) // 2 if lens else 0
        else:
            self.half = local_len // 2

    def take(self, x: torch.Tensor, which: int, *, lse: bool = False) -> torch.Tensor:
        dim = (LSE_SEQ_DIM if lse else SEQ_DIM)[self.fmt]
        if self.index is not None:
            return x.index_select(dim, self.index[which])
        return x.narrow(dim, which * self.half, self.half)

    def shape_of(self, x: torch.Tensor, which: int) -> torch.Size:
        """take(x, which)'s shape (x out/dq/dk-shaped), without gathering thd's rows."""
        dim = SEQ_DIM[self.fmt]
        rows = len(self.index[which]) if self.index is not None else self.half
        return torch.Size((*x.shape[:dim], rows, *x.shape[dim + 1:]))

    def add_into(self, dst: torch.Tensor, src: torch.Tensor, which: int) -> None:
        """dst[half which] += src (dst is an out/dq/dk-shaped accumulator)."""
        dim = SEQ_DIM[self.fmt]
        if self.index is not None:
            dst.index_add_(dim, self.index[which], src.to(dst.dtype))
        else:
            dst.narrow(dim, which * self.half, self.half).add_(src)
