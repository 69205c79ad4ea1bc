"""Ring attention ('p2p'): K/V travel around the cp group; each rank merges partial results with the lse.

Rank r holds chunks r and 2P-1-r of the sequence (the load-balanced layout) for q and kv alike. The block of
rank r with the K/V of rank `src` is, under a causal mask (RingPlan.kind; FULL for every block without a mask):
  DIAG      src == r: the local causal block;
  KV_FIRST  src <  r: all local queries against the first kv half (chunk src); chunk 2P-1-src is in the future;
  Q_SECOND  src >  r: the second query half (chunk 2P-1-r) against all of kv; chunk r sees only the future;
so every block is two chunk pairs of work and none is fully masked.

Forward, step i = 0 .. P-1: src = r - i (mod P); K/V move forward (to rank r+1) for the next step, issued before
this step's compute. The diagonal goes first: it needs nothing received. At its last step rank r holds rank
r+1's K/V; it keeps that block for the backward (memory: one more K/V block per rank, from forward to backward).

Backward, step t = 0 .. P-1: src = r + 1 + t (mod P), the forward's blocks in reverse order, K/V moving backward
(to rank r-1):
  t = 0      the block kept from the forward: nothing to receive before it;
  t = P-1    the diagonal, with the rank's own K/V: no K/V to receive for it.
A block's dK/dV sum travels with its K/V: its first holder (rank src-1, at t = 0) starts it, each next holder
receives it and adds its part, and the owner receives it during its own diagonal block (that hop runs under the
diagonal's compute), adds the diagonal's part and is done: no transfer is left after the last block. Each step
issues, before its compute, the next step's K/V (none for the diagonal) and the previous step's dK/dV sum.
Sums over several ranks' parts are float32 (float64 for float64): dq and the travelling dK/dV for P > 2. With
P = 2 a block's foreign part is a single engine result: it travels in its own dtype, and dq's two parts add in
theirs (one op adds in float32 and rounds once). A K/V block's holders compute Q_SECOND (all kv rows) before
KV_FIRST (the first half), so a sum covers the rows of its first part: only rank 0's block, whose foreign parts
are all KV_FIRST, travels as its first half.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import TAG_DK, TAG_DV, TAG_K, TAG_V, GroupInfo, Ring
from ._layout import LSE_SEQ_DIM, SEQ_DIM, Halves
from .merge import BlockState, acc_dtype, add_sink, merge_to, sink_grad

FULL, DIAG, KV_FIRST, Q_SECOND = "full", "diag", "kv_first", "q_second"


class RingPlan:
    """Which block a rank computes with which rank's K/V, with the engine config and aux for it."""

    def __init__(self, cfg: AttnConfig, aux: AttnAux, fmt: str, causal: bool, sq: int, skv: int,
                 cu_q: torch.Tensor | None = None, cu_kv: torch.Tensor | None = None, max_q: int = 0,
                 max_kv: int = 0):
        """sq/skv: local token counts; thd: cu_q/cu_kv are the LOCAL cu_seqlens (global // cp_size)."""
        self.fmt, self.causal = fmt, causal
        thd = fmt == "thd"
        vanilla = dict(softmax_type="vanilla", return_max_logit=False)
        self.cfg_full = dataclasses.replace(cfg, attn_mask_type="padding" if thd else "no_mask",
                                            window_size=(-1, -1), **vanilla)
        self.cfg_diag = dataclasses.replace(cfg, **vanilla)
        self.halves = Halves(fmt, sq, cu_q) if causal else None
        if thd:
            self.aux = {FULL: _thd_aux(cu_q, cu_kv, max_q, max_kv, aux)}
            self.aux[DIAG] = self.aux[FULL]
            if causal:  # self-attention: cu_q == cu_kv
                h = self.halves
                self.aux[KV_FIRST] = _thd_aux(cu_q, h.cu_half, max_q, h.max_half, aux)
                self.aux[Q_SECOND] = _thd_aux(h.cu_half, cu_kv, h.max_half, max_kv, aux)
        else:
            self.aux = {FULL: AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv, extra=aux.extra),
                        DIAG: AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv, extra=aux.extra),
                        KV_FIRST: AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv // 2, extra=aux.extra),
                        Q_SECOND: AttnAux(max_seqlen_q=sq // 2, max_seqlen_kv=skv, extra=aux.extra)}

    def kind(self, src: int, rank: int) -> str:
        """The block of `rank`'s queries against the K/V of rank `src`."""
        if not self.causal:
            return FULL
        if src == rank:
            return DIAG
        return KV_FIRST if src < rank else Q_SECOND

    def cfg(self, kind: str) -> AttnConfig:
        return self.cfg_diag if kind == DIAG else self.cfg_full


def _thd_aux(cu_q, cu_kv, max_q: int, max_kv: int, aux: AttnAux) -> AttnAux:
    return AttnAux(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_kv,
                   max_seqlen_q=max_q, max_seqlen_kv=max_kv, extra=aux.extra)


class Pair:
    """K and V (or dK and dV) travelling together: copies in one contiguous [2, ...] buffer when their shapes
    agree, else two buffers; or the two tensors themselves (of(copy=False)). One batched transfer per hop."""

    def __init__(self, buffers: tuple[torch.Tensor, ...]):
        self.buffers = buffers
        self.parts = (buffers[0][0], buffers[0][1]) if len(buffers) == 1 else buffers

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = True) -> "Pair":
        """Copies in `dtype` (accumulators, buffers this rank writes); copy=False: two buffers, the tensors
        themselves where contiguous and of `dtype` (a send only reads: K/V need no copy to travel)."""
        dtype = dtype or a.dtype
        if not copy:
            return cls((a.to(dtype).contiguous(), b.to(dtype).contiguous()))
        if a.shape == b.shape:
            return cls((torch.stack([a.to(dtype), b.to(dtype)]),))
        return cls((a.to(dtype, memory_format=torch.contiguous_format, copy=True),
                    b.to(dtype, memory_format=torch.contiguous_format, copy=True)))

    def empty_like(self) -> "Pair":
        return Pair(tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.buffers))

    def received(self, ring: Ring, tag: int) -> "Pair":
        """Empty buffers like this pair's for ring's next start to receive into (Ring.receive_buffer: valid until
        the second start after that one)."""
        return Pair(tuple(ring.receive_buffer(tag + i, t.shape, t.dtype, t.device) for i, t in enumerate(self.buffers)))

    def tagged(self, tag: int) -> list[tuple[torch.Tensor, int]]:
        return [(t, tag + i) for i, t in enumerate(self.buffers)]


def ring_forward(engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                 plan: RingPlan, info: GroupInfo, ring: Ring) -> tuple[torch.Tensor, torch.Tensor, list[Any], Pair]:
    """Returns (out in q's dtype, lse over all keys incl. the sink [float32], per-step engine states, the K/V held
    at the last step: rank r+1's, where the backward starts). Step 0's result is taken as it is; each later step
    merges into new tensors (float32 between steps, q's dtype at the last step unless a sink follows), so no block
    result is copied or widened on its own."""
    fmt, halves = plan.fmt, plan.halves
    q_second = halves.take(q, 1).contiguous() if halves else None
    out = lse = None
    owned = False  # whether out/lse are this function's float32 accumulators (else a block's own results)
    states: list[Any] = []
    kv = Pair.of(k, v, copy=False)  # it travels as it is
    for step in range(info.size):
        src = (info.rank - step) % info.size
        pending, nxt = [], None
        if step + 1 < info.size:  # issue the next step's transfer before this step's compute
            # the last K/V received is kept for the backward: in memory of its own, not the ring's
            nxt = kv.empty_like() if step + 2 == info.size else kv.received(ring, TAG_K)
            pending = ring.start(kv.tagged(TAG_K), nxt.tagged(TAG_K))
        kind = plan.kind(src, info.rank)
        qb, kb, vb = _block_inputs(kind, q, q_second, kv, halves)
        res = engine.forward(qb, kb, vb, plan.aux[kind], plan.cfg(kind))
        states.append(BlockState(res.state, res.out))
        if out is None:  # step 0 covers every local query row
            out, lse = res.out, res.lse
        else:
            last = step + 1 == info.size and sink is None
            out, lse = _merge_step(out, lse, owned, res, kind, halves, fmt, q.dtype if last else acc_dtype(q))
            owned = not last
        Ring.wait(pending)
        if nxt is not None:
            kv = nxt
    if sink is not None:
        out, lse = add_sink(out.to(acc_dtype(q)), lse.to(acc_dtype(q)), sink, fmt)
    return out.to(q.dtype), lse.to(acc_dtype(q)), states, kv


def _block_inputs(kind: str, q: torch.Tensor, q_second: torch.Tensor | None, kv: Pair, halves: Halves | None):
    """(q, k, v) of a block: KV_FIRST takes the first kv half (a copy only where the half is not dense: bshd with a
    batch over 1; engines that key compiled graphs by strides then meet the layout of a whole block), Q_SECOND the
    second query half."""
    k, v = kv.parts
    if kind == KV_FIRST:
        return q, halves.take(k, 0).contiguous(), halves.take(v, 0).contiguous()
    return (q_second if kind == Q_SECOND else q), k, v


def _merge_step(out, lse, owned: bool, res, kind: str, halves: Halves | None, fmt: str, dtype: torch.dtype):
    """(out, lse) merged with a block's result (res.out, res.lse): in place where they are our own accumulators
    of `dtype`, else into new tensors of `dtype` (lse float32, float64 for float64). A second-half block
    (Q_SECOND) merges into the second half's rows; the first half's are carried over."""
    if owned and out.dtype == dtype:
        new_out, new_lse = out, lse
    else:
        new_out = torch.empty(out.shape, dtype=dtype, device=out.device)
        new_lse = torch.empty(lse.shape, dtype=acc_dtype(new_out), device=lse.device)
        if kind == Q_SECOND:
            _put_rows(new_out, new_lse, halves.take(out, 0), halves.take(lse, 0, lse=True), halves, 0, fmt)
    if kind != Q_SECOND:
        merge_to(new_out, new_lse, out, lse, res.out, res.lse, fmt)
    elif halves.index is None:  # narrow views: merged where they lie
        merge_to(halves.take(new_out, 1), halves.take(new_lse, 1, lse=True), halves.take(out, 1),
                 halves.take(lse, 1, lse=True), res.out, res.lse, fmt)
    else:  # thd halves are index sets: merge the gathered rows, then scatter them
        rows_out = torch.empty(res.out.shape, dtype=dtype, device=out.device)
        rows_lse = torch.empty(res.lse.shape, dtype=new_lse.dtype, device=lse.device)
        merge_to(rows_out, rows_lse, halves.take(out, 1), halves.take(lse, 1, lse=True), res.out, res.lse, fmt)
        _put_rows(new_out, new_lse, rows_out, rows_lse, halves, 1, fmt)
    return new_out, new_lse


def _put_rows(out, lse, rows_out, rows_lse, halves: Halves, which: int, fmt: str) -> None:
    """out[half which] = rows_out, lse[half which] = rows_lse (cast to their dtypes)."""
    if halves.index is None:
        halves.take(out, which).copy_(rows_out)
        halves.take(lse, which, lse=True).copy_(rows_lse)
    else:
        out.index_copy_(SEQ_DIM[fmt], halves.index[which], rows_out.to(out.dtype))
        lse.index_copy_(LSE_SEQ_DIM[fmt], halves.index[which], rows_lse.to(lse.dtype))


def ring_backward(engine: Engine, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, held: Pair, states: list[Any], sink: torch.Tensor | None,
                  plan: RingPlan, info: GroupInfo, ring: Ring):
    """Returns (dq, dk, dv, dsink or None). `held`: the K/V ring_forward ended on. Engines take the merged out/lse,
    as FlashAttention's backward does. The schedule and the dtypes of the sums: the module's docstring."""
    fmt, halves, size, rank = plan.fmt, plan.halves, info.size, info.rank
    dout = dout.contiguous()
    second = None
    if halves:  # Q_SECOND's rows, taken once for every step that needs them
        second = tuple(halves.take(t, 1).contiguous() for t in (q, dout, out)) + \
            (halves.take(lse, 1, lse=True).contiguous(),)
    sum_dtype = q.dtype if size == 2 else acc_dtype(q)
    backward_ring = dict(send_to=info.prev_global, recv_from=info.next_global)
    kv = held
    dq = dq_rows = None
    dkv = dkv_rows = None  # the dK/dV sum of the block computed at the previous step, over rows dkv_rows
    for t in range(size):
        src = (rank + 1 + t) % size
        diagonal = t == size - 1
        sends, recvs, nxt, incoming = [], [], None, None
        if t + 1 < size - 1:  # the next step's K/V; the diagonal uses this rank's own
            nxt = kv.received(ring, TAG_K)
            sends += kv.tagged(TAG_K)
            recvs += nxt.tagged(TAG_K)
        if t > 0:  # pass on the previous block's sum; receive this block's, from the ranks that held it before
            in_rows = _sum_rows(plan, src, size)
            incoming = Pair(tuple(ring.receive_buffer(TAG_DK + i, _rows_shape(x, in_rows, halves), d.dtype, x.device)
                                  for i, (x, d) in enumerate(zip((k, v), dkv.parts))))
            sends += dkv.tagged(TAG_DK)
            recvs += incoming.tagged(TAG_DK)
        pending = ring.start(sends, recvs, **backward_ring)
        kind = plan.kind(src, rank)
        g = _block_backward(engine, kind, dout, q, out, lse, second, Pair.of(k, v, copy=False) if diagonal else kv,
                            states[(rank - src) % size], plan)
        dq, dq_rows = _sum(dq, dq_rows, g.dq, 1 if kind == Q_SECOND else None, halves, sum_dtype)
        Ring.wait(pending)
        part_rows = 0 if kind == KV_FIRST else None
        if incoming is None:  # the block's first holder: its sum starts here
            dkv, dkv_rows = Pair.of(g.dk, g.dv, sum_dtype, copy=False), part_rows
        elif not diagonal:
            dkv, dkv_rows = incoming, in_rows
            for total, part in zip(dkv.parts, (g.dk, g.dv)):
                _add_into(total, dkv_rows, part, part_rows, halves)
        else:  # this rank's own K/V: the other ranks' sum plus the diagonal's part
            dk, dv = (_finish(part, total, in_rows, halves) for part, total in zip((g.dk, g.dv), incoming.parts))
        if nxt is not None:
            kv = nxt
    dsink = sink_grad(dout, out, lse, sink, fmt) if sink is not None else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _block_backward(engine: Engine, kind: str, dout, q, out, lse, second, kv: Pair, state: BlockState,
                    plan: RingPlan):
    if kind == Q_SECOND:
        q2, dout2, out2, lse2 = second
        return engine.backward(dout2, q2, *kv.parts, out2, lse2, state.state, plan.aux[kind], plan.cfg(kind))
    _, kb, vb = _block_inputs(kind, q, None, kv, plan.halves)
    return engine.backward(dout, q, kb, vb, out, lse, state.state, plan.aux[kind], plan.cfg(kind))


def _sum_rows(plan: RingPlan, owner: int, size: int) -> int | None:
    """The rows the dK/dV sum of `owner`'s block covers: those of its first part (rank owner-1's block)."""
    return 0 if plan.kind(owner, (owner - 1) % size) == KV_FIRST else None


def _rows_shape(x: torch.Tensor, rows: int | None, halves: Halves | None) -> torch.Size:
    return x.shape if rows is None else halves.shape_of(x, rows)


def _add_into(total: torch.Tensor, total_rows: int | None, part: torch.Tensor, part_rows: int | None,
              halves: Halves | None) -> None:
    """total += part, in place; rows: None for all rows, 0 / 1 for that half. total must cover part's rows."""
    if total_rows == part_rows:
        total.add_(part)
    elif total_rows is None:
        halves.add_into(total, part, part_rows)
    else:
        raise RuntimeError(f"internal error: a sum over half {total_rows} cannot take a part over "
                           f"{'all rows' if part_rows is None else f'half {part_rows}'}")


def _sum(total: torch.Tensor | None, total_rows: int | None, part: torch.Tensor, part_rows: int | None,
         halves: Halves | None, dtype: torch.dtype) -> tuple[torch.Tensor, int | None]:
    """(total + part, its rows). In place where total covers part's rows; else part (all rows, or the first part)
    becomes the sum: itself where it is of `dtype` (an engine's result, ours to write), else a copy in `dtype`."""
    if total is not None and (total_rows is None or part_rows is not None):
        _add_into(total, total_rows, part, part_rows, halves)
        return total, total_rows
    base = part if part.dtype == dtype else part.to(dtype)
    if total is not None:
        _add_into(base, None, total, total_rows, halves)
    return base, part_rows


def _finish(own: torch.Tensor, others: torch.Tensor, rows: int | None, halves: Halves | None) -> torch.Tensor:
    """own (the diagonal block's part: all rows, an engine's result) + others (the other ranks' sum over `rows`),
    in one op that adds in the wider dtype and rounds once into own's."""
    if rows is not None and halves.index is not None and others.dtype != own.dtype:
        own = own.to(others.dtype)  # thd's index_add_ takes one dtype: the wider one, rounded by the caller
    _add_into(own, None, others, rows, halves)
    return own


class P2PAttention:
    """cp_comm_type='p2p' for one call: forward/backward over the tensors of this rank. ring: its transport
    (copy_engine.ring_for); training: the backward's hops are reserved with the forward's."""

    def __init__(self, engine: Engine, plan: RingPlan, info: GroupInfo, ring: Ring, training: bool = True):
        self.engine, self.plan, self.info, self.ring, self.training = engine, plan, info, ring, training

    def forward(self, q, k, v, sink):
        pieces = [(TAG_K, k.shape, k.dtype), (TAG_V, v.shape, v.dtype)]
        if self.training:  # the backward sends K/V and a dK/dV sum (full rows at most) in one hop
            sum_dtype = q.dtype if self.info.size == 2 else acc_dtype(q)
            pieces += [(TAG_DK, k.shape, sum_dtype), (TAG_DV, v.shape, sum_dtype)]
        self.ring.reserve(pieces)
        out, lse, states, held = ring_forward(self.engine, q, k, v, sink, self.plan, self.info, self.ring)
        return out, (q, k, v, out, lse, *held.buffers), states

    def backward(self, dout, saved, states, sink):
        q, k, v, out, lse, *held = saved
        return ring_backward(self.engine, dout, q, k, v, out, lse, Pair(tuple(held)), states, sink, self.plan,
                             self.info, self.ring)
