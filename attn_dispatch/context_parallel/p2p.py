"""Ring attention ('p2p'): K/V travel around the cp group; each rank merges partial results with the lse.

Step i on rank r holds the K/V of rank j = (r - i) mod P. With the load-balanced layout and a causal mask
(q and kv each = [chunk r | chunk 2P-1-r]) the blocks are:
  i == 0  (j == r): the local causal block;
  j <  r          : all local queries against the first kv half (chunk j); chunk 2P-1-j is in the future;
  j >  r          : the second query half (chunk 2P-1-r) against all of kv; chunk r sees only the future.
so steps after the first do half the work and no block is fully masked. Backward re-runs the ring: K/V
travel again and a float32 dK/dV accumulator travels with them, collecting each rank's contribution,
and reaches its owner after the last step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import TAG_DK, TAG_K, GroupInfo, Ring
from ._layout import LSE_SEQ_DIM, SEQ_DIM, Halves
from .merge import BlockState, acc_dtype, add_sink, merge_to, sink_grad

FULL, DIAG, KV_FIRST, Q_SECOND = "full", "diag", "kv_first", "q_second"


class RingPlan:
    """Which block each step computes, with the engine config and aux for it."""

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

    def kind(self, step: int, src: int, rank: int) -> str:
        if not self.causal:
            return FULL
        if step == 0:
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
        self.lead = 1 if len(buffers) == 1 else 0  # dims before a part's own

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

    def tagged(self, tag: int) -> list[tuple[torch.Tensor, int]]:
        return [(t, tag + i) for i, t in enumerate(self.buffers)]


def ring_forward(engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                 plan: RingPlan, info: GroupInfo, ring: Ring) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Returns (out in q's dtype, lse over all keys incl. the sink [float32], per-step engine states).
    Step 0's result is taken as it is; each later step merges into new tensors (float32 between steps, q's dtype
    at the last step unless a sink follows), so no block result is copied or widened on its own."""
    fmt, halves = plan.fmt, plan.halves
    q_second = halves.take(q, 1).contiguous() if halves else None
    out = lse = None
    owned = False  # whether out/lse are this function's float32 accumulators (else a block's own results)
    states: list[Any] = []
    kv = Pair.of(k, v, copy=False)  # it travels as it is
    for step in range(info.size):
        src = (info.rank - step) % info.size
        k_cur, v_cur = kv.parts
        pending, nxt = [], None
        if step + 1 < info.size:  # issue the next step's transfer before this step's compute
            nxt = kv.empty_like()
            pending = ring.start(kv.tagged(TAG_K), nxt.tagged(TAG_K))
        kind = plan.kind(step, src, info.rank)
        qb, kb, vb = q, k_cur, v_cur
        if kind == KV_FIRST:
            kb, vb = halves.take(k_cur, 0).contiguous(), halves.take(v_cur, 0).contiguous()
        elif kind == Q_SECOND:
            qb = q_second
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
    return out.to(q.dtype), lse.to(acc_dtype(q)), states


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
                  out: torch.Tensor, lse: torch.Tensor, states: list[Any], sink: torch.Tensor | None,
                  plan: RingPlan, info: GroupInfo, ring: Ring):
    """Returns (dq, dk, dv, dsink or None). Engines take the merged out/lse, as FlashAttention's backward does.
    Partial gradients add in float32 and round once: in a float32 accumulator over three ranks or more; over two,
    as one add of the two partials in their own dtype (torch adds 16-bit floats in float32 and rounds once, the
    same result in half the memory traffic). With two ranks each rank's contribution to the other's K/V goes
    straight to its owner (one hop); over more, a float32 dK/dV accumulator travels the ring with the K/V."""
    fmt, halves = plan.fmt, plan.halves
    dout = dout.contiguous()
    if halves:
        second = tuple(halves.take(t, 1).contiguous() for t in (q, dout, out))
        lse_second = halves.take(lse, 1, lse=True).contiguous()
    pair = info.size == 2
    dq = None
    kv = Pair.of(k, v, copy=False)
    dkv = None  # > 2 ranks: float32 gradient of the kv block held at the previous step, all ranks so far
    for step in range(info.size):
        src = (info.rank - step) % info.size
        k_cur, v_cur = kv.parts
        sends, recvs, nxt, incoming = [], [], None, None
        if step + 1 < info.size:
            nxt = kv.empty_like()
            sends += kv.tagged(TAG_K)
            recvs += nxt.tagged(TAG_K)
        if step > 0 and not pair:  # pass on the accumulator of the block we held last step; receive this block's
            incoming = dkv.empty_like()
            sends += dkv.tagged(TAG_DK)
            recvs += incoming.tagged(TAG_DK)
        pending = ring.start(sends, recvs)
        kind = plan.kind(step, src, info.rank)
        if kind == Q_SECOND:
            q2, dout2, out2 = second
            g = engine.backward(dout2, q2, k_cur, v_cur, out2, lse_second, states[step].state, plan.aux[kind],
                                plan.cfg(kind))
        else:
            kb, vb = k_cur, v_cur
            if kind == KV_FIRST:
                kb, vb = halves.take(k_cur, 0).contiguous(), halves.take(v_cur, 0).contiguous()
            g = engine.backward(dout, q, kb, vb, out, lse, states[step].state, plan.aux[kind], plan.cfg(kind))
        dq = _add_grad(dq, g.dq, 1 if kind == Q_SECOND else None, halves, q.dtype if pair else acc_dtype(q))
        Ring.wait(pending)
        if pair:
            if step == 0:
                dkv = Pair.of(g.dk, g.dv, copy=False)  # our own K/V's gradient: the partner's part is added below
            else:
                dkv = _exchange_pair(dkv, g, plan, info, ring)
        elif incoming is None:
            dkv = Pair.of(g.dk, g.dv, acc_dtype(q))
        else:
            dkv = incoming
            for acc, part in zip(dkv.parts, (g.dk, g.dv)):
                _add_grad(acc, part, 0 if kind == KV_FIRST else None, halves, acc.dtype)
        if nxt is not None:
            kv = nxt
    if not pair:
        # the accumulator we hold now belongs to the next rank; ours arrives from the previous one. It is complete:
        # cast to the gradient's dtype before the hop (the same rounding as after it, half the bytes of float32)
        done = Pair.of(*dkv.parts, k.dtype)
        dkv = done.empty_like()
        Ring.wait(ring.start(done.tagged(TAG_DK), dkv.tagged(TAG_DK)))
    dk, dv = dkv.parts
    dsink = sink_grad(dout, out, lse, sink, fmt) if sink is not None else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _add_grad(acc: torch.Tensor | None, part: torch.Tensor, half: int | None, halves: Halves | None,
              dtype: torch.dtype) -> torch.Tensor:
    """acc + part (part covering the rows of half `half`, or all rows): acc None starts from part, as a copy in
    `dtype` where it is not already of `dtype`. In place otherwise (acc is ours: a copy, or an engine's result)."""
    if acc is None:
        if half is not None:  # the first step covers every row
            raise RuntimeError("internal error: the ring's first block must cover every row")
        return part if part.dtype == dtype else part.to(dtype)
    if half is None:
        return acc.add_(part)
    halves.add_into(acc, part, half)
    return acc


def _exchange_pair(own: Pair, g, plan: RingPlan, info: GroupInfo, ring: Ring) -> Pair:
    """Two ranks: send this rank's contribution to the partner's K/V gradient (g, of the block computed from the
    partner's K/V) to the partner, receive the partner's to ours, and add it into our own (`own`, step 0's)."""
    mine_kind = plan.kind(1, info.rank, (info.rank + 1) % 2)  # the block the partner computed from our K/V
    rows = 0 if mine_kind == KV_FIRST else None
    sent = Pair.of(g.dk, g.dv, copy=False)
    shapes = [t.shape if rows is None else plan.halves.shape_of(t, 0) for t in own.parts]
    got = Pair(tuple(torch.empty(shape, dtype=t.dtype, device=t.device) for shape, t in zip(shapes, own.parts)))
    Ring.wait(ring.start(sent.tagged(TAG_DK), got.tagged(TAG_DK)))
    return Pair(tuple(_add_grad(acc, part, rows, plan.halves, acc.dtype) for acc, part in zip(own.parts, got.parts)))


class P2PAttention:
    """cp_comm_type='p2p' for one call: forward/backward over the tensors of this rank."""

    def __init__(self, engine: Engine, plan: RingPlan, info: GroupInfo, stream=None):
        self.engine, self.plan, self.info, self.ring = engine, plan, info, Ring(info, stream)

    def forward(self, q, k, v, sink):
        out, lse, states = ring_forward(self.engine, q, k, v, sink, self.plan, self.info, self.ring)
        return out, (q, k, v, out, lse), states

    def backward(self, dout, saved, states, sink):
        q, k, v, out, lse = saved
        return ring_backward(self.engine, dout, q, k, v, out, lse, states, sink, self.plan, self.info, self.ring)
