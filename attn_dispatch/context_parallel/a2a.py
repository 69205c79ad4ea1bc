"""'a2a' (DeepSpeed Ulysses) and 'a2a+p2p' (Ulysses inside a group, ring across groups).

All-to-all turns [local sequence, all heads] into [whole sequence, heads / P] on each rank; attention then
runs on whole sequences for a slice of the heads, and a second all-to-all turns the output back. Needs
num_heads and num_gqa_groups divisible by the a2a group size (query head group g uses kv head group g).
The softmax sink of the local head slice enters once, after the engine, like in the other modes.

a2a+p2p: cp_group = [a2a_group, p2p_group]. A rank's place in the sharded layout is
p2p_rank * a2a_size + a2a_rank, so an a2a group holds consecutive chunks: after its all-to-all each rank
holds "super-chunks" g and 2R-1-g (R = p2p size), which is the load-balanced layout of a ring of R ranks.
"""
from __future__ import annotations

import dataclasses

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import GroupInfo, all_to_all_dim0
from ._layout import HEAD_DIM, SEQ_DIM
from .merge import BlockState, acc_dtype, add_sink, sink_grad
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


class A2AAttention:
    """cp_comm_type='a2a': the engine sees whole sequences (natural order) and heads / P."""

    def __init__(self, engine: Engine, cfg: AttnConfig, aux: AttnAux, split: HeadSplit):
        self.engine, self.split, self.fmt = engine, split, split.fmt
        self.cfg = dataclasses.replace(cfg, softmax_type="vanilla", return_max_logit=False)
        self.aux = aux

    def forward(self, q, k, v, sink):
        qh, kh, vh = (self.split.to_heads(t) for t in (q, k, v))
        res = self.engine.forward(qh, kh, vh, self.aux, self.cfg)
        out_h, lse = res.out, res.lse.to(acc_dtype(q))
        sink_h = self.split.head_slice(sink)
        if sink_h is not None:
            out_h, lse = add_sink(out_h.to(acc_dtype(q)), lse, sink_h, self.fmt)
            out_h = out_h.to(q.dtype)
        return self.split.to_seq(out_h), (qh, kh, vh, out_h, lse), BlockState(res.state, res.out)

    def backward(self, dout, saved, state, sink):
        qh, kh, vh, out_h, lse = saved
        dout_h = self.split.to_heads(dout.contiguous())
        g = self.engine.backward(dout_h, qh, kh, vh, out_h, lse, state.state, self.aux, self.cfg)
        sink_h = self.split.head_slice(sink)
        dsink = sink_grad(dout_h, out_h, lse, sink_h, self.fmt) if sink_h is not None else None
        dsink = self.split.full_heads(dsink, sink.numel()) if sink is not None else None
        return self.split.to_seq(g.dq), self.split.to_seq(g.dk), self.split.to_seq(g.dv), dsink


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
