"""A sliding window under context parallelism, moving only the keys the window reaches (bshd/sbhd, load-balanced
layout): each query chunk needs the keys [q0 - left, q0 + chunk + right), so each rank fetches just those pieces
from their owners, point to point, and runs one trimmed band call per chunk (bands.gathered_band). Backward sends
each piece's dK/dV (float32) back to its owner, which adds them up.

'all_gather' always runs so (Transformer Engine's all-gather mode slices K/V per chunk the same way, after gathering
all of it: get_kv_seq_info_after_all_gather). 'p2p' runs so when the window reaches no further than the neighbouring
chunks (bands.neighbour_window): a ring would carry every rank's whole K/V (and a float32 dK/dV) around for a few
thousand keys; wider windows keep the ring (window_ring.py), whose hops hide under compute.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import GroupInfo
from ._layout import LSE_SEQ_DIM, SEQ_DIM
from ..constraints.cp_bands import Band, gathered_band
from .merge import BlockState, acc_dtype, add_sink, merge_, sink_grad
from .p2p import Pair
from .sharding import chunks_of_rank

_TAG = 1000


class Piece(NamedTuple):
    needer: int     # group rank that needs the keys
    need: int       # which of its query chunks (0 or 1)
    owner: int      # group rank that holds them
    src: int        # offset in the owner's local shard
    dst: int        # offset in the needer's key buffer
    length: int


class Need(NamedTuple):
    half: int       # local query chunk
    start: int      # first key (whole-sequence position) of the buffer
    band: Band      # the block, relative to the query chunk and the buffer


def _needs(size: int, rank: int, chunk: int, window) -> list[Need]:
    out = []
    for half, c in enumerate(chunks_of_rank(size, rank)):
        hit = gathered_band(size, c, chunk, window)
        if hit is not None:
            out.append(Need(half, *hit))
    return out


def _pieces(size: int, chunk: int, window) -> list[Piece]:
    """Every transfer of the call (the same list on every rank, in the same order)."""
    pieces = []
    for needer in range(size):
        for i, need in enumerate(_needs(size, needer, chunk, window)):
            lo = need.start + need.band.k_start
            hi = lo + need.band.k_len
            for c in range(2 * size):
                a, b = max(lo, c * chunk), min(hi, (c + 1) * chunk)
                if a < b:
                    owner = c if c < size else 2 * size - 1 - c
                    src = (0 if c < size else chunk) + a - c * chunk
                    pieces.append(Piece(needer, i, owner, src, a - lo, b - a))
    return pieces


class WindowExchangeAttention:
    def __init__(self, engine: Engine, cfg: AttnConfig, aux: AttnAux, fmt: str, info: GroupInfo, local_len: int):
        self.engine, self.fmt, self.info, self.dim = engine, fmt, info, SEQ_DIM[fmt]
        self.chunk = local_len // 2
        base = dataclasses.replace(cfg, softmax_type="vanilla", return_max_logit=False)
        self.needs = _needs(info.size, info.rank, self.chunk, cfg.window_size)
        self.cfgs = [dataclasses.replace(base, attn_mask_type=n.band.mask, window_size=n.band.window)
                     for n in self.needs]
        self.auxs = [AttnAux(max_seqlen_q=n.band.q_len, max_seqlen_kv=n.band.k_len, extra=aux.extra)
                     for n in self.needs]
        self.pieces = _pieces(info.size, self.chunk, cfg.window_size)

    def _ops(self, make) -> list:
        ops = []
        for n, p in enumerate(self.pieces):
            if p.owner == p.needer:
                continue
            op = make(n, p)
            if op is not None:
                ops.append(op)
        return ops

    def _fetch(self, kv: Pair) -> list[Pair]:
        """This rank's key buffers (one per need), filled from every owner."""
        r, g = self.info.rank, self.info.global_ranks
        d = self.dim + kv.lead
        bufs = [Pair(tuple(t.new_empty(_resized(t.shape, d, n.band.k_len)) for t in kv.buffers)) for n in self.needs]
        staged = []

        def make(n, p):
            if p.owner == r:
                send = Pair(tuple(t.narrow(d, p.src, p.length).contiguous() for t in kv.buffers))
                return [dist.P2POp(dist.isend, t, g[p.needer], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(send.buffers)]
            if p.needer == r:
                recv = Pair(tuple(t.new_empty(_resized(t.shape, d, p.length)) for t in kv.buffers))
                staged.append((p, recv))
                return [dist.P2POp(dist.irecv, t, g[p.owner], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(recv.buffers)]
            return None
        ops = [op for group in self._ops(make) for op in group]
        works = dist.batch_isend_irecv(ops) if ops else []
        for p in self.pieces:  # local pieces while the others travel
            if p.owner == r and p.needer == r:
                for dst, src in zip(bufs[p.need].buffers, kv.buffers):
                    dst.narrow(d, p.dst, p.length).copy_(src.narrow(d, p.src, p.length))
        for w in works:
            w.wait()
        for p, recv in staged:
            for dst, src in zip(bufs[p.need].buffers, recv.buffers):
                dst.narrow(d, p.dst, p.length).copy_(src)
        return bufs

    def _return(self, grads: list[Pair], dkv: Pair) -> None:
        """Send each piece's gradient back to its owner, which adds it into dkv (its local shard's gradient)."""
        r, g = self.info.rank, self.info.global_ranks
        d = self.dim + dkv.lead
        staged = []

        def make(n, p):
            if p.needer == r:
                send = Pair(tuple(t.narrow(d, p.dst, p.length).contiguous() for t in grads[p.need].buffers))
                return [dist.P2POp(dist.isend, t, g[p.owner], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(send.buffers)]
            if p.owner == r:
                recv = Pair(tuple(t.new_empty(_resized(t.shape, d, p.length)) for t in dkv.buffers))
                staged.append((p, recv))
                return [dist.P2POp(dist.irecv, t, g[p.needer], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(recv.buffers)]
            return None
        ops = [op for group in self._ops(make) for op in group]
        works = dist.batch_isend_irecv(ops) if ops else []
        for p in self.pieces:
            if p.owner == r and p.needer == r:
                for dst, src in zip(dkv.buffers, grads[p.need].buffers):
                    dst.narrow(d, p.src, p.length).add_(src.narrow(d, p.dst, p.length))
        for w in works:
            w.wait()
        for p, recv in staged:
            for dst, src in zip(dkv.buffers, recv.buffers):
                dst.narrow(d, p.src, p.length).add_(src)

    def _rows(self, x: torch.Tensor, need: Need, *, lse: bool = False) -> torch.Tensor:
        dim = LSE_SEQ_DIM[self.fmt] if lse else self.dim
        return x.narrow(dim, need.half * self.chunk + need.band.q_start, need.band.q_len)

    def forward(self, q, k, v, sink):
        bufs = self._fetch(Pair.of(k, v))
        acc = acc_dtype(q)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = None
        states = []
        for need, buf, cfg, aux in zip(self.needs, bufs, self.cfgs, self.auxs):
            kk, vv = buf.parts
            res = self.engine.forward(self._rows(q, need).contiguous(), kk, vv, aux, cfg)
            states.append(BlockState(res.state, res.out))
            if lse is None:
                shape = list(res.lse.shape)
                shape[LSE_SEQ_DIM[self.fmt]] = q.shape[self.dim]
                lse = torch.full(shape, float("-inf"), dtype=acc, device=q.device)
            merge_(self._rows(out, need), self._rows(lse, need, lse=True), res.out, res.lse, self.fmt)
        if sink is not None:
            out, lse = add_sink(out, lse, sink, self.fmt)
        out = out.to(q.dtype)
        return out, (q, k, v, out, lse, *[t for b in bufs for t in b.buffers]), states

    def backward(self, dout, saved, states, sink):
        q, k, v, out, lse, *flat = saved
        per = len(flat) // max(len(self.needs), 1)
        bufs = [Pair(tuple(flat[i * per:(i + 1) * per])) for i in range(len(self.needs))]
        dout = dout.contiguous()
        acc = acc_dtype(q)
        dq = torch.zeros_like(q, dtype=acc)
        grads = []
        for need, buf, cfg, aux, state in zip(self.needs, bufs, self.cfgs, self.auxs, states):
            kk, vv = buf.parts
            rows = lambda t: self._rows(t, need).contiguous()  # noqa: E731
            g = self.engine.backward(rows(dout), rows(q), kk, vv, rows(out),
                                     self._rows(lse, need, lse=True).contiguous(), state.state, aux, cfg)
            self._rows(dq, need).add_(g.dq)
            grads.append(Pair.of(g.dk, g.dv, acc))
        dkv = Pair.of(torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        self._return(grads, dkv)
        dk, dv = dkv.parts
        dsink = sink_grad(dout, out, lse, sink, self.fmt) if sink is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _resized(shape, dim: int, length: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[dim] = length
    return tuple(shape)
