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
from .merge import BlockState, acc_dtype, add_sink, merge_, sink_grad

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
    """K and V (or dK and dV) travelling together: one contiguous [2, ...] buffer, so one transfer per hop,
    when their shapes agree; else two buffers."""

    def __init__(self, buffers: tuple[torch.Tensor, ...]):
        self.buffers = buffers
        self.parts = (buffers[0][0], buffers[0][1]) if len(buffers) == 1 else buffers
        self.lead = 1 if len(buffers) == 1 else 0  # dims before a part's own

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> "Pair":
        dtype = dtype or a.dtype
        if a.shape == b.shape:
            return cls((torch.stack([a.to(dtype), b.to(dtype)]),))
        return cls((a.to(dtype, memory_format=torch.contiguous_format, copy=True),
                    b.to(dtype, memory_format=torch.contiguous_format, copy=True)))

    def empty_like(self) -> "Pair":
        return Pair(tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.buffers))

    def tagged(self, tag: int) -> list[tuple[torch.Tensor, int]]:
        return [(t, tag + i) for i, t in enumerate(self.buffers)]


def _acc_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous accumulator copy (NCCL sends need contiguous tensors; engines may return permuted views)."""
    return x.to(dtype, memory_format=torch.contiguous_format, copy=True)


def ring_forward(engine: Engine, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                 plan: RingPlan, info: GroupInfo, ring: Ring) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Returns (out in q's dtype, lse over all keys incl. the sink [float32], per-step engine states)."""
    fmt, halves = plan.fmt, plan.halves
    q_second = halves.take(q, 1).contiguous() if halves else None
    out_acc = lse_acc = None
    states: list[Any] = []
    kv = Pair.of(k, v)  # it travels: NCCL sends contiguous memory only
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
        if out_acc is None:  # step 0 covers every local query row
            out_acc = _acc_copy(res.out, acc_dtype(q))
            lse_acc = _acc_copy(res.lse, acc_dtype(q))
        elif kind == Q_SECOND:
            _merge_rows(out_acc, lse_acc, res.out, res.lse, halves, fmt)
        else:
            merge_(out_acc, lse_acc, res.out, res.lse, fmt)
        Ring.wait(pending)
        if nxt is not None:
            kv = nxt
    if sink is not None:
        out_acc, lse_acc = add_sink(out_acc, lse_acc, sink, fmt)
    return out_acc.to(q.dtype), lse_acc, states


def _merge_rows(out_acc, lse_acc, out_i, lse_i, halves: Halves, fmt: str) -> None:
    """Merge a second-half block result into the second half of the accumulators."""
    o, l = halves.take(out_acc, 1), halves.take(lse_acc, 1, lse=True)
    merge_(o, l, out_i, lse_i, fmt)
    if halves.index is not None:  # thd halves are copies: write back
        out_acc.index_copy_(SEQ_DIM[fmt], halves.index[1], o)
        lse_acc.index_copy_(LSE_SEQ_DIM[fmt], halves.index[1], l)


def ring_backward(engine: Engine, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, states: list[Any], sink: torch.Tensor | None,
                  plan: RingPlan, info: GroupInfo, ring: Ring):
    """Returns (dq, dk, dv, dsink or None). Engines take the merged out/lse, as FlashAttention's backward does."""
    fmt, halves = plan.fmt, plan.halves
    dout = dout.contiguous()
    if halves:
        second = tuple(halves.take(t, 1).contiguous() for t in (q, dout, out))
        lse_second = halves.take(lse, 1, lse=True).contiguous()
    dq = torch.zeros_like(q, dtype=acc_dtype(q))
    kv = Pair.of(k, v)
    dkv = None  # float32 gradient of the kv block held at the previous step, all ranks so far
    for step in range(info.size):
        src = (info.rank - step) % info.size
        k_cur, v_cur = kv.parts
        sends, recvs, nxt, incoming = [], [], None, None
        if step + 1 < info.size:
            nxt = kv.empty_like()
            sends += kv.tagged(TAG_K)
            recvs += nxt.tagged(TAG_K)
        if step > 0:  # pass on the accumulator of the block we held last step; receive the one for this block
            incoming = dkv.empty_like()
            sends += dkv.tagged(TAG_DK)
            recvs += incoming.tagged(TAG_DK)
        pending = ring.start(sends, recvs)
        kind = plan.kind(step, src, info.rank)
        if kind == Q_SECOND:
            q2, dout2, out2 = second
            g = engine.backward(dout2, q2, k_cur, v_cur, out2, lse_second, states[step].state, plan.aux[kind],
                                plan.cfg(kind))
            halves.add_into(dq, g.dq, 1)
        else:
            kb, vb = k_cur, v_cur
            if kind == KV_FIRST:
                kb, vb = halves.take(k_cur, 0).contiguous(), halves.take(v_cur, 0).contiguous()
            g = engine.backward(dout, q, kb, vb, out, lse, states[step].state, plan.aux[kind], plan.cfg(kind))
            dq.add_(g.dq)
        Ring.wait(pending)
        if incoming is None:
            dkv = Pair.of(g.dk, g.dv, acc_dtype(q))
        else:
            dkv = incoming
            dk_acc, dv_acc = dkv.parts
            if kind == KV_FIRST:
                halves.add_into(dk_acc, g.dk, 0)
                halves.add_into(dv_acc, g.dv, 0)
            else:
                dk_acc.add_(g.dk)
                dv_acc.add_(g.dv)
        if nxt is not None:
            kv = nxt
    # the accumulator we hold now belongs to the next rank; ours arrives from the previous one. It is complete:
    # cast to the gradient's dtype before the hop (the same rounding as after it, half the bytes of float32)
    done = Pair.of(*dkv.parts, k.dtype)
    mine = done.empty_like()
    Ring.wait(ring.start(done.tagged(TAG_DK), mine.tagged(TAG_DK)))
    dk, dv = mine.parts
    dsink = sink_grad(dout, out, lse, sink, fmt) if sink is not None else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


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
