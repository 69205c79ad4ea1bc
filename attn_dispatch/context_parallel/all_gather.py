"""'all_gather': every rank gathers the whole K/V, then runs its own queries against the keys they need.

Causal, load-balanced: query chunk c (c = r, then 2P-1-r) sees the keys of chunks 0..c. That is computed as
two engine calls merged with the lse: the diagonal chunk (square, causal) and the prefix of chunks 0..c-1
(no mask). Only square causal and unmasked blocks reach the engine, so engines without bottom-right causal
masks (torch's cuDNN op) serve this mode too. Backward reduce-scatters dK/dV (float32) back to their owners.
Transformer Engine's all-gather mode does not take thd; neither does this one.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import GroupInfo, all_gather_seq, reduce_scatter_seq
from ._layout import LSE_SEQ_DIM, SEQ_DIM, Halves
from .merge import BlockState, acc_dtype, add_sink, merge_, sink_grad
from .sharding import RankOrder, chunks_of_rank


class Block(NamedTuple):
    rows: int | None   # which half of the local queries (None: all of them)
    kv_start: int      # gathered keys [kv_start, kv_start + kv_len), natural order
    kv_len: int
    cfg: AttnConfig
    aux: AttnAux


class AllGatherAttention:
    def __init__(self, engine: Engine, cfg: AttnConfig, aux: AttnAux, fmt: str, info: GroupInfo, causal: bool,
                 sq: int, skv: int, device: torch.device):
        self.engine, self.fmt, self.info, self.causal = engine, fmt, info, causal
        self.dim = SEQ_DIM[fmt]
        vanilla = dict(softmax_type="vanilla", return_max_logit=False)
        full = dataclasses.replace(cfg, attn_mask_type="no_mask", window_size=(-1, -1), **vanilla)
        self.order = RankOrder(fmt, info.size, device) if causal else None
        self.halves = Halves(fmt, sq) if causal else None
        if not causal:
            n = skv * info.size
            self.blocks = [Block(None, 0, n, full, AttnAux(max_seqlen_q=sq, max_seqlen_kv=n, extra=aux.extra))]
            return
        diag = dataclasses.replace(cfg, attn_mask_type="causal", window_size=(-1, 0), **vanilla)
        half = sq // 2
        self.blocks = []
        for which, chunk in enumerate(chunks_of_rank(info.size, info.rank)):
            self.blocks.append(Block(which, chunk * half, half, diag,
                                     AttnAux(max_seqlen_q=half, max_seqlen_kv=half, extra=aux.extra)))
            if chunk > 0:
                self.blocks.append(Block(which, 0, chunk * half, full,
                                         AttnAux(max_seqlen_q=half, max_seqlen_kv=chunk * half, extra=aux.extra)))

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        whole = all_gather_seq(x, self.info).movedim(0, self.dim).flatten(self.dim, self.dim + 1)
        return self.order.to_natural(whole) if self.order else whole

    def _scatter(self, grad_whole: torch.Tensor) -> torch.Tensor:
        if self.order:
            grad_whole = self.order.to_ranks(grad_whole)
        per_rank = grad_whole.unflatten(self.dim, (self.info.size, -1)).movedim(self.dim, 0)
        return reduce_scatter_seq(per_rank, self.info)

    def _rows(self, x: torch.Tensor, rows, *, lse: bool = False) -> torch.Tensor:
        return x if rows is None else self.halves.take(x, rows, lse=lse)

    def _keys(self, x: torch.Tensor, b: Block) -> torch.Tensor:
        return x.narrow(self.dim, b.kv_start, b.kv_len).contiguous()

    def forward(self, q, k, v, sink):
        k_all, v_all = self._gather(k), self._gather(v)
        acc = acc_dtype(q)
        out = lse = None
        q_rows = {b.rows: self._rows(q, b.rows).contiguous() for b in self.blocks}
        states = []
        for b in self.blocks:
            res = self.engine.forward(q_rows[b.rows], self._keys(k_all, b), self._keys(v_all, b), b.aux, b.cfg)
            states.append(BlockState(res.state, res.out))
            if out is None:  # the first block of each row set is its diagonal (or the only block)
                out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
                lse = torch.empty(*_lse_shape(res.lse, self.fmt, q.shape[self.dim]), dtype=acc, device=q.device)
            o, lse_rows = self._rows(out, b.rows), self._rows(lse, b.rows, lse=True)  # views (bshd/sbhd)
            if b.cfg.attn_mask_type == "causal" or b.rows is None:
                o.copy_(res.out)
                lse_rows.copy_(res.lse)
            else:
                merge_(o, lse_rows, res.out, res.lse, self.fmt)
        if sink is not None:
            out, lse = add_sink(out, lse, sink, self.fmt)
        out = out.to(q.dtype)
        return out, (q, k_all, v_all, out, lse), states

    def backward(self, dout, saved, states, sink):
        q, k_all, v_all, out, lse = saved
        dout = dout.contiguous()
        acc = acc_dtype(q)
        dk_all = torch.zeros_like(k_all, dtype=acc)
        dv_all = torch.zeros_like(v_all, dtype=acc)
        dq = torch.zeros_like(q, dtype=acc)
        rows = {b.rows: [self._rows(t, b.rows).contiguous() for t in (q, dout, out)] +
                [self._rows(lse, b.rows, lse=True).contiguous()] for b in self.blocks}
        for b, state in zip(self.blocks, states):
            q_b, dout_b, out_b, lse_b = rows[b.rows]
            g = self.engine.backward(dout_b, q_b, self._keys(k_all, b), self._keys(v_all, b), out_b, lse_b,
                                     state.state, b.aux, b.cfg)
            self._rows(dq, b.rows).add_(g.dq)
            dk_all.narrow(self.dim, b.kv_start, b.kv_len).add_(g.dk)
            dv_all.narrow(self.dim, b.kv_start, b.kv_len).add_(g.dv)
        dk, dv = self._scatter(dk_all), self._scatter(dv_all)
        dsink = sink_grad(dout, out, lse, sink, self.fmt) if sink is not None else None
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), dsink


def _lse_shape(block_lse: torch.Tensor, fmt: str, local_len: int) -> tuple[int, ...]:
    shape = list(block_lse.shape)
    shape[LSE_SEQ_DIM[fmt]] = local_len
    return tuple(shape)
