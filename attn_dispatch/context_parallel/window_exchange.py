"""A sliding window under context parallelism, moving only the keys the window reaches (bshd/sbhd, load-balanced
layout): each query chunk needs the keys [q0 - left, q0 + chunk + right), so each rank fetches just those pieces
from their owners, point to point, and runs one trimmed band call per chunk (bands.gathered_band). Backward sends
each piece's dK/dV back to its owner, which adds them up (float32 only where pieces overlap).

Each query chunk runs exactly one call, so its output, lse and dq are written where they belong, and a key's
gradient is one call's unless pieces overlap: nothing is merged, accumulated in float32 or cast when the window
lets every key have one reader (the common case: a window narrower than a chunk overlaps only at chunk edges).

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
from .merge import NEG_INF, BlockState, acc_dtype, add_sink, sink_grad
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


class Segment(NamedTuple):
    """A run of this rank's own keys [start, start + length) and the pieces whose gradients cover it."""
    start: int
    length: int
    pieces: tuple[int, ...]


def _segments(pieces: list[Piece], rank: int, local_len: int) -> list[Segment]:
    """This rank's keys cut where the set of pieces reading them changes."""
    mine = [(n, p) for n, p in enumerate(pieces) if p.owner == rank]
    cuts = sorted({0, local_len, *(p.src for _, p in mine), *(p.src + p.length for _, p in mine)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        readers = tuple(n for n, p in mine if p.src <= a and b <= p.src + p.length)
        out.append(Segment(a, b - a, readers))
    return out


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
        self.segments = _segments(self.pieces, info.rank, local_len)
        # every local query row in some call: outputs and dq need no zero fill
        self.rows_covered = sum(n.band.q_len for n in self.needs) == local_len

    def _ops(self, make) -> list:
        ops = []
        for n, p in enumerate(self.pieces):
            if p.owner == p.needer:
                continue
            op = make(n, p)
            if op is not None:
                ops.extend(op)
        return ops

    def _fetch(self, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's key buffers (K and V, one pair per need), filled from every owner."""
        r, g, d = self.info.rank, self.info.global_ranks, self.dim
        bufs = [tuple(t.new_empty(_resized(t.shape, d, n.band.k_len)) for t in (k, v)) for n in self.needs]
        staged = []

        def make(n, p):
            if p.owner == r:
                return [dist.P2POp(dist.isend, t.narrow(d, p.src, p.length).contiguous(), g[p.needer],
                                   self.info.group, _TAG + 2 * n + i) for i, t in enumerate((k, v))]
            if p.needer == r:
                recv = tuple(t.new_empty(_resized(t.shape, d, p.length)) for t in (k, v))
                staged.append((p, recv))
                return [dist.P2POp(dist.irecv, t, g[p.owner], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(recv)]
            return None
        ops = self._ops(make)
        works = dist.batch_isend_irecv(ops) if ops else []
        for p in self.pieces:  # local pieces while the others travel
            if p.owner == r and p.needer == r:
                for dst, src in zip(bufs[p.need], (k, v)):
                    dst.narrow(d, p.dst, p.length).copy_(src.narrow(d, p.src, p.length))
        for w in works:
            w.wait()
        for p, recv in staged:
            for dst, src in zip(bufs[p.need], recv):
                dst.narrow(d, p.dst, p.length).copy_(src)
        return bufs

    def _return(self, grads: list[tuple[torch.Tensor, torch.Tensor]], k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each piece's gradient goes back to its owner (in the engine's dtype: it is one call's result); the owner
        sums what covers each of its keys, in float32 only where several pieces do."""
        r, g, d = self.info.rank, self.info.global_ranks, self.dim
        received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def make(n, p):
            if p.needer == r:
                return [dist.P2POp(dist.isend, t.narrow(d, p.dst, p.length).to(like.dtype).contiguous(), g[p.owner],
                                   self.info.group, _TAG + 2 * n + i)
                        for i, (t, like) in enumerate(zip(grads[p.need], (k, v)))]
            if p.owner == r:
                recv = received[n] = tuple(t.new_empty(_resized(t.shape, d, p.length)) for t in (k, v))
                return [dist.P2POp(dist.irecv, t, g[p.needer], self.info.group, _TAG + 2 * n + i)
                        for i, t in enumerate(recv)]
            return None
        ops = self._ops(make)
        works = dist.batch_isend_irecv(ops) if ops else []
        for w in works:
            w.wait()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for i, dest in enumerate((dk, dv)):
            for seg in self.segments:
                out = dest.narrow(d, seg.start, seg.length)
                parts = []
                for n in seg.pieces:
                    p = self.pieces[n]
                    src = received[n][i] if p.needer != r else grads[p.need][i].narrow(d, p.dst, p.length)
                    parts.append(src.narrow(d, seg.start - p.src, seg.length))
                if not parts:
                    out.zero_()
                elif len(parts) == 1:
                    out.copy_(parts[0])
                else:
                    total = parts[0].to(acc_dtype(dest))
                    for part in parts[1:]:
                        total += part
                    out.copy_(total)
        return dk, dv

    def _rows(self, x: torch.Tensor, need: Need, *, lse: bool = False) -> torch.Tensor:
        dim = LSE_SEQ_DIM[self.fmt] if lse else self.dim
        return x.narrow(dim, need.half * self.chunk + need.band.q_start, need.band.q_len)

    def forward(self, q, k, v, sink):
        bufs = self._fetch(k, v)
        make = torch.empty if self.rows_covered else torch.zeros
        out = make(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = None
        states = []
        for need, (kk, vv), cfg, aux in zip(self.needs, bufs, self.cfgs, self.auxs):
            res = self.engine.forward(self._rows(q, need).contiguous(), kk, vv, aux, cfg)
            states.append(BlockState(res.state, res.out))
            if lse is None:
                shape = list(res.lse.shape)
                shape[LSE_SEQ_DIM[self.fmt]] = q.shape[self.dim]
                lse = (torch.empty(shape, dtype=acc_dtype(q), device=q.device) if self.rows_covered
                       else torch.full(shape, NEG_INF, dtype=acc_dtype(q), device=q.device))
            self._rows(out, need).copy_(res.out)
            self._rows(lse, need, lse=True).copy_(res.lse)
        if sink is not None:
            out, lse = add_sink(out.to(acc_dtype(q)), lse, sink, self.fmt)
            out = out.to(q.dtype)
        return out, (q, k, v, out, lse, *[t for pair in bufs for t in pair]), states

    def backward(self, dout, saved, states, sink):
        q, k, v, out, lse, *flat = saved
        bufs = [tuple(flat[2 * i:2 * i + 2]) for i in range(len(self.needs))]
        dout = dout.contiguous()
        dq = torch.empty_like(q) if self.rows_covered else torch.zeros_like(q)
        grads = []
        for need, (kk, vv), cfg, aux, state in zip(self.needs, bufs, self.cfgs, self.auxs, states):
            rows = lambda t: self._rows(t, need).contiguous()  # noqa: E731
            g = self.engine.backward(rows(dout), rows(q), kk, vv, rows(out),
                                     self._rows(lse, need, lse=True).contiguous(), state.state, aux, cfg)
            self._rows(dq, need).copy_(g.dq)
            grads.append((g.dk, g.dv))
        dk, dv = self._return(grads, k, v) if grads else (torch.zeros_like(k), torch.zeros_like(v))
        dsink = sink_grad(dout, out, lse, sink, self.fmt) if sink is not None else None
        return dq, dk, dv, dsink


def _resized(shape, dim: int, length: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[dim] = length
    return tuple(shape)
