"""The one-shot Ulysses exchange (HeadSplit), used by FP8 'a2a' and by 'a2a+p2p' (Ulysses inside a group, ring
across groups). Plain 'a2a' pipelines it over head groups instead (head_groups.py).

All-to-all turns [local sequence, all heads] into [whole sequence, heads / P] on each rank; attention then
runs on whole sequences for a slice of the heads, and a second all-to-all turns the output back. Needs
num_heads and num_gqa_groups divisible by the a2a group size (query head group g uses kv head group g).
The softmax sink of the local head slice enters once, after the engine, like in the other modes.

a2a+p2p: cp_group = [a2a_group, p2p_group]. A rank's place in the sharded layout is
p2p_rank * a2a_size + a2a_rank, so an a2a group holds consecutive chunks: after its all-to-all each rank
holds "super-chunks" g and 2R-1-g (R = p2p size), which is the load-balanced layout of a ring of R ranks.
"""
from __future__ import annotations


import torch

from ._comm import GroupInfo, all_to_all_dim0
from ._layout import HEAD_DIM, SEQ_DIM
from .p2p import P2PAttention
from .sharding import RankOrder


class HeadSplit:
    """Sequence-split <-> head-split over one group, with the load-balanced reorder when causal."""

    def __init__(self, fmt: str, info: GroupInfo, order: RankOrder | None):
        self.fmt, self.info, self.order = fmt, info, order
        self.sd, self.hd = SEQ_DIM[fmt], HEAD_DIM[fmt]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        p = self.info.size
        parts = x.unflatten(self.hd, (p, x.shape[self.hd] // p)).movedim(self.hd, 0)
        whole = all_to_all_dim0(parts, self.info).movedim(0, self.sd).flatten(self.sd, self.sd + 1)
        return self.order.to_natural(whole) if self.order else whole

    def to_seq(self, y: torch.Tensor) -> torch.Tensor:
        if self.order:
            y = self.order.to_ranks(y)
        p = self.info.size
        parts = y.unflatten(self.sd, (p, y.shape[self.sd] // p)).movedim(self.sd, 0)
        return all_to_all_dim0(parts, self.info).movedim(0, self.hd).flatten(self.hd, self.hd + 1)

    def head_slice(self, sink: torch.Tensor | None) -> torch.Tensor | None:
        if sink is None:
            return None
        n = sink.numel() // self.info.size
        return sink[self.info.rank * n:(self.info.rank + 1) * n]

    def full_heads(self, dsink_slice: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
        """This rank's sink gradient, placed in its heads (other ranks contribute the other heads)."""
        if dsink_slice is None:
            return None
        full = torch.zeros(num_heads, dtype=dsink_slice.dtype, device=dsink_slice.device)
        n = dsink_slice.numel()
        full[self.info.rank * n:(self.info.rank + 1) * n] = dsink_slice
        return full


class A2AP2PAttention:
    """cp_comm_type='a2a+p2p': Ulysses over the a2a group, then the ring over the p2p group."""

    def __init__(self, split: HeadSplit, ring: P2PAttention):
        self.split, self.ring = split, ring

    def forward(self, q, k, v, sink):
        qh, kh, vh = (self.split.to_heads(t) for t in (q, k, v))
        out_h, saved, states = self.ring.forward(qh, kh, vh, self.split.head_slice(sink))
        return self.split.to_seq(out_h), saved, states

    def backward(self, dout, saved, states, sink):
        dout_h = self.split.to_heads(dout.contiguous())
        dq, dk, dv, dsink = self.ring.backward(dout_h, saved, states, self.split.head_slice(sink))
        dsink = self.split.full_heads(dsink, sink.numel()) if sink is not None else None
        return self.split.to_seq(dq), self.split.to_seq(dk), self.split.to_seq(dv), dsink
