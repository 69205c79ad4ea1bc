"""'all_gather': every rank gathers the whole K/V, then runs its own queries against the keys they need.

Causal, load-balanced: query chunk c (c = r, then 2P-1-r) needs the keys of chunks 0..c, i.e. a key prefix
of (c+1) chunks, with the causal diagonal aligned bottom-right. Backward reduce-scatters dK/dV (float32)
back to the ranks that own them. Transformer Engine's all-gather mode does not take thd; neither does this.
"""
from __future__ import annotations

import dataclasses

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import GroupInfo, all_gather_seq, reduce_scatter_seq
from ._layout import LSE_SEQ_DIM, SEQ_DIM, Halves
from .merge import BlockState, acc_dtype, add_sink, sink_grad
from .sharding import RankOrder, chunks_of_rank


class AllGatherAttention:
    def __init__(self, engine: Engine, cfg: AttnConfig, aux: AttnAux, fmt: str, info: GroupInfo, causal: bool,
                 sq: int, skv: int, device: torch.device):
        self.engine, self.fmt, self.info, self.causal = engine, fmt, info, causal
        self.dim = SEQ_DIM[fmt]
        vanilla = dict(softmax_type="vanilla", return_max_logit=False)
        self.order = RankOrder(fmt, info.size, device) if causal else None
        if causal:
            self.halves = Halves(fmt, sq)
            half = sq // 2
            self.cfg = dataclasses.replace(cfg, attn_mask_type="causal_bottom_right", window_size=(-1, 0), **vanilla)
            # (rows of the local q, number of gathered keys they see)
            self.blocks = [(which, (chunk + 1) * half) for which, chunk in
                           enumerate(chunks_of_rank(info.size, info.rank))]
            self.aux = [AttnAux(max_seqlen_q=half, max_seqlen_kv=n, extra=aux.extra) for _, n in self.blocks]
        else:
            self.cfg = dataclasses.replace(cfg, attn_mask_type="no_mask", window_size=(-1, -1), **vanilla)
            self.blocks = [(None, skv * info.size)]
            self.aux = [AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv * info.size, extra=aux.extra)]

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        whole = all_gather_seq(x, self.info).movedim(0, self.dim).flatten(self.dim, self.dim + 1)
        return self.order.to_natural(whole) if self.order else whole

    def _scatter(self, grad_whole: torch.Tensor) -> torch.Tensor:
        if self.order:
            grad_whole = self.order.to_ranks(grad_whole)
        per_rank = grad_whole.unflatten(self.dim, (self.info.size, -1)).movedim(self.dim, 0)
        return reduce_scatter_seq(per_rank, self.info)

    def _q_rows(self, x: torch.Tensor, which) -> torch.Tensor:
        return x if which is None else self.halves.take(x, which).contiguous()

    def _keys(self, x: torch.Tensor, n_keys: int) -> torch.Tensor:
        return x.narrow(self.dim, 0, n_keys).contiguous()

    def forward(self, q, k, v, sink):
        k_all, v_all = self._gather(k), self._gather(v)
        outs, lses, states = [], [], []
        for (which, n_keys), aux in zip(self.blocks, self.aux):
            res = self.engine.forward(self._q_rows(q, which), self._keys(k_all, n_keys), self._keys(v_all, n_keys),
                                      aux, self.cfg)
            outs.append(res.out)
            lses.append(res.lse.to(acc_dtype(q)))
            states.append(BlockState(res.state, res.out))
        out = torch.cat(outs, self.dim)
        lse = torch.cat(lses, LSE_SEQ_DIM[self.fmt])
        if sink is not None:
            out, lse = add_sink(out.to(acc_dtype(q)), lse, sink, self.fmt)
            out = out.to(q.dtype)
        return out, (q, k_all, v_all, out, lse), states

    def backward(self, dout, saved, states, sink):
        q, k_all, v_all, out, lse = saved
        dout = dout.contiguous()
        dk_all = torch.zeros_like(k_all, dtype=acc_dtype(q))
        dv_all = torch.zeros_like(v_all, dtype=acc_dtype(q))
        dqs = []
        for (which, n_keys), aux, state in zip(self.blocks, self.aux, states):
            lse_rows = lse if which is None else self.halves.take(lse, which, lse=True).contiguous()
            g = self.engine.backward(self._q_rows(dout, which), self._q_rows(q, which),
                                     self._keys(k_all, n_keys), self._keys(v_all, n_keys),
                                     self._q_rows(out, which), lse_rows, state.state, aux, self.cfg)
            dqs.append(g.dq)
            dk_all.narrow(self.dim, 0, n_keys).add_(g.dk)
            dv_all.narrow(self.dim, 0, n_keys).add_(g.dv)
        dq = torch.cat(dqs, self.dim)
        dk, dv = self._scatter(dk_all), self._scatter(dv_all)
        dsink = sink_grad(dout, out, lse, sink, self.fmt) if sink is not None else None
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), dsink
