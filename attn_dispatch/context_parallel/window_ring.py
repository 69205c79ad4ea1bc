"""Ring attention ('p2p', and the ring of 'a2a+p2p') with a sliding window, bshd/sbhd, load-balanced layout.

Each step pairs this rank's two query chunks with the two key chunks it holds; bands.chunk_bands says which of
the four pairs the window keeps, and trims each to one plain band call. Pairs outside the window cost nothing,
and the ring stops after the last step any rank computes in (bands.steps_needed): K/V make that many hops, and
in backward the dK/dV accumulator then goes straight back to its owner.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import TAG_DK, TAG_DV, TAG_K, TAG_V, GroupInfo, Ring
from ._layout import LSE_SEQ_DIM, SEQ_DIM
from ..constraints.cp_bands import Band, chunk_bands, steps_needed
from .merge import BlockState, acc_dtype, add_sink, merge_, sink_grad
from .p2p import Pair


class WindowRingPlan:
    def __init__(self, cfg: AttnConfig, aux: AttnAux, fmt: str, local_len: int, info: GroupInfo):
        self.fmt, self.dim, self.chunk = fmt, SEQ_DIM[fmt], local_len // 2
        self.base = dataclasses.replace(cfg, softmax_type="vanilla", return_max_logit=False)
        self.extra = aux.extra
        self.steps = steps_needed(info.size, self.chunk, cfg.window_size)
        self.blocks = [chunk_bands(info.size, info.rank, (info.rank - s) % info.size, self.chunk, cfg.window_size)
                       for s in range(self.steps)]

    def cfg(self, b: Band) -> AttnConfig:
        return dataclasses.replace(self.base, attn_mask_type=b.mask, window_size=b.window)

    def aux(self, b: Band) -> AttnAux:
        return AttnAux(max_seqlen_q=b.q_len, max_seqlen_kv=b.k_len, extra=self.extra)

    def rows(self, x: torch.Tensor, half: int, b: Band, *, lse: bool = False) -> torch.Tensor:
        dim = LSE_SEQ_DIM[self.fmt] if lse else self.dim
        return x.narrow(dim, half * self.chunk + b.q_start, b.q_len)

    def keys(self, x: torch.Tensor, half: int, b: Band) -> torch.Tensor:
        return x.narrow(self.dim, half * self.chunk + b.k_start, b.k_len)


class WindowP2PAttention:
    def __init__(self, engine: Engine, plan: WindowRingPlan, info: GroupInfo, ring: Ring, training: bool = True):
        self.engine, self.plan, self.info, self.ring, self.training = engine, plan, info, ring, training

    def forward(self, q, k, v, sink):
        plan, fmt = self.plan, self.plan.fmt
        pieces = [(TAG_K, k.shape, k.dtype), (TAG_V, v.shape, v.dtype)]
        if self.training:  # the backward sends K/V and a float32 dK/dV sum in one hop
            pieces += [(TAG_DK, k.shape, acc_dtype(q)), (TAG_DV, v.shape, acc_dtype(q))]
        self.ring.reserve(pieces)
        kv = Pair.of(k, v)
        acc = acc_dtype(q)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
        lse = None
        states: list[list[Any]] = []
        for step in range(plan.steps):
            pending, nxt = [], None
            if step + 1 < plan.steps:
                nxt = kv.empty_like()
                pending = self.ring.start(kv.tagged(TAG_K), nxt.tagged(TAG_K))
            step_states = []
            for qa, kb, b in plan.blocks[step]:
                kk, vv = (plan.keys(t, kb, b).contiguous() for t in kv.parts)
                res = self.engine.forward(plan.rows(q, qa, b).contiguous(), kk, vv, plan.aux(b), plan.cfg(b))
                step_states.append(BlockState(res.state, res.out))
                if lse is None:
                    shape = list(res.lse.shape)
                    shape[LSE_SEQ_DIM[fmt]] = q.shape[plan.dim]
                    lse = torch.full(shape, float("-inf"), dtype=acc, device=q.device)
                merge_(plan.rows(out, qa, b), plan.rows(lse, qa, b, lse=True), res.out, res.lse, fmt)
            states.append(step_states)
            Ring.wait(pending)
            if nxt is not None:
                kv = nxt
        if sink is not None:
            out, lse = add_sink(out, lse, sink, fmt)
        out = out.to(q.dtype)
        return out, (q, k, v, out, lse), states

    def backward(self, dout, saved, states, sink):
        plan, fmt = self.plan, self.plan.fmt
        q, k, v, out, lse = saved
        dout = dout.contiguous()
        acc = acc_dtype(q)
        dq = torch.zeros_like(q, dtype=acc)
        kv = Pair.of(k, v)
        dkv = None  # float32 gradient of the K/V block held now, summed over the ranks so far
        for step in range(plan.steps):
            sends, recvs, nxt, incoming = [], [], None, None
            if step + 1 < plan.steps:
                nxt = kv.empty_like()
                sends += kv.tagged(TAG_K)
                recvs += nxt.tagged(TAG_K)
            if step > 0:
                incoming = dkv.empty_like()
                sends += dkv.tagged(TAG_DK)
                recvs += incoming.tagged(TAG_DK)
            pending = self.ring.start(sends, recvs)
            grads = []
            for (qa, kb, b), state in zip(plan.blocks[step], states[step]):
                kk, vv = (plan.keys(t, kb, b).contiguous() for t in kv.parts)
                rows = lambda t: plan.rows(t, qa, b).contiguous()  # noqa: E731
                g = self.engine.backward(rows(dout), rows(q), kk, vv, rows(out),
                                         plan.rows(lse, qa, b, lse=True).contiguous(), state.state, plan.aux(b),
                                         plan.cfg(b))
                plan.rows(dq, qa, b).add_(g.dq)
                grads.append((kb, b, g))
            Ring.wait(pending)
            dkv = incoming if incoming is not None else Pair.of(torch.zeros_like(k, dtype=acc),
                                                                torch.zeros_like(v, dtype=acc))
            dk_acc, dv_acc = dkv.parts
            for kb, b, g in grads:
                plan.keys(dk_acc, kb, b).add_(g.dk)
                plan.keys(dv_acc, kb, b).add_(g.dv)
            if nxt is not None:
                kv = nxt
        # the accumulator now belongs to rank r - (steps - 1); ours comes from rank r + (steps - 1)
        back = plan.steps - 1
        if back:  # complete: cast before the hop (the same rounding as after it, fewer bytes)
            dkv = Pair.of(*dkv.parts, k.dtype)
            mine = dkv.empty_like()
            info = self.info
            Ring.wait(self.ring.start(dkv.tagged(TAG_DK), mine.tagged(TAG_DK),
                                      send_to=info.global_ranks[(info.rank - back) % info.size],
                                      recv_from=info.global_ranks[(info.rank + back) % info.size]))
            dkv = mine
        dk, dv = dkv.parts
        dsink = sink_grad(dout, out, lse, sink, fmt) if sink is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink
