"""'a2a' (DeepSpeed Ulysses), pipelined over head groups.

An all-to-all turns [local sequence, all heads] into [whole sequence, heads / P] on each rank; attention runs on
whole sequences for that slice of the heads, and a second all-to-all turns the output back. The slice is cut
further into G head groups, and the exchanges of one group overlap the attention of another:

    forward:  start in(0); for g: start in(g+1), wait in(g), attend(g), start out(g); then wait every out(g)
    backward: the same, with dout going in and dq, dk, dv coming out

so only in(0) and out(G-1) are exposed (1/G of the bytes each way); the others run under attention. Each
direction is a region [G, P, n] that is written in one pass (q, k, v of all groups, or one group's out; the
backward's dq, dk, dv of a group share a row) and crosses as one exchange per group. The exchange is
_comm.CollectiveExchange (torch.distributed's all-to-all; NCCL runs it on its own stream, but its kernels wait for
SMs beside attention) or, on NVLink groups, copy_engine_a2a.CopyEngineExchange (peers' rows pulled by the copy
engines from symmetric memory). num_heads and num_gqa_groups must be divisible by P * G (query head group g uses kv
head group g). G = 1 is the plain Ulysses exchange.

The memory passes around each exchange (packing heads into a region, assembling whole sequences in natural order
from the rows received, writing each rank's tokens back, placing the rows received into the caller's heads) are one
_row_copy.copy_rows call each: one kernel launch on CUDA, reading each source row once and writing each destination
row once, the token order applied by SeqOrder's runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from ..backends.base import AttnAux, AttnConfig, Engine
from ._comm import CollectiveExchange, GroupInfo
from ._layout import HEAD_DIM, SEQ_DIM
from ._row_copy import Move, Rows, Runs, copy_rows, full_runs, rowable
from .merge import BlockState, acc_dtype, add_sink, sink_grad
from .sharding import chunks_of_rank, thd_natural_index

# The head-group count when cp.attention(cp_a2a_head_groups=None) (DotProductAttention passes None).
HEAD_GROUPS_ENV = "ATTN_DISPATCH_CP_A2A_HEAD_GROUPS"
# Counts the default may take. None: on 2x H200 (benchmarks/results/cp/, causal, b1 h16) two groups lost to one over
# NCCL (85.8% against 88.3% at 32k: its all-to-alls ran several times longer beside attention) and over the copy
# engines alike (cp_h200x2_ce_a2a_own.json: 86.5% against 88.0% at 32k, 95.5% against 97.0% at 128k), where the
# transfers hide but attention on half the heads runs 5-9% slower per head. It stays opt-in (the argument or the
# variable) until a machine or a shape shows a gain.
DEFAULT_GROUP_CHOICES: tuple[int, ...] = ()
# Below this many elements per rank and group, an all-to-all's fixed cost (tens of microseconds per NCCL call)
# is comparable to its transfer, so the default stays at one group. A guess, not a measurement: time
# benchmarks/bench_cp.py --a2a-head-groups 1,2,4 on the machine to choose.
MIN_GROUP_ELEMENTS = 1 << 20


def head_groups_from_env() -> int | None:
    raw = os.environ.get(HEAD_GROUPS_ENV)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"environment variable {HEAD_GROUPS_ENV}={raw!r} is not accepted; use a positive integer "
                         "(1 = no pipelining) or leave it unset for the default")
    return int(raw)


def resolve_head_groups(requested: int | None, num_heads: int, num_kv_heads: int, size: int,
                        elements_per_head: int) -> int:
    """The head-group count for an a2a call: `requested` (else the environment), which must divide
    num_heads / size and num_gqa_groups / size; by default the largest of DEFAULT_GROUP_CHOICES that divides both
    and leaves each group's exchange at least MIN_GROUP_ELEMENTS, else 1. elements_per_head: local tokens x
    head dim (one head's share of q on this rank)."""
    per_rank = math.gcd(num_heads // size, num_kv_heads // size)
    if requested is None:
        requested = head_groups_from_env()
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"cp_a2a_head_groups={requested!r} must be a positive integer (1 = no pipelining)")
        if per_rank % requested:
            allowed = [g for g in range(1, per_rank + 1) if per_rank % g == 0]
            raise ValueError(f"cp_a2a_head_groups={requested}: each rank's num_heads / cp_size = {num_heads // size} "
                             f"and num_gqa_groups / cp_size = {num_kv_heads // size} must split into {requested} "
                             f"equal groups; allowed: {allowed}")
        return requested
    for groups in DEFAULT_GROUP_CHOICES:
        if per_rank % groups == 0 and elements_per_head * num_heads // groups >= MIN_GROUP_ELEMENTS:
            return groups
    return 1


class SeqOrder:
    """Where each whole-sequence token sits among the shards an all-to-all delivers (rank p's local token i), and
    back. Load-balanced bshd/sbhd: rank p holds chunks p and 2P-1-p; thd: a token index, each sequence so; otherwise
    rank order is natural order. runs(p) says it as runs of consecutive tokens, which A2AAttention's passes copy by.
    Built once per layout (seq_order)."""

    def __init__(self, fmt: str, size: int, local_len: int, balanced: bool,
                 thd_lengths: tuple[int, ...] | None = None):
        self.fmt, self.size, self.local_len, self.sd = fmt, size, local_len, SEQ_DIM[fmt]
        self.identity = fmt != "thd" and not balanced
        self.chunk = local_len // 2
        if fmt == "thd":
            slot = thd_natural_index(list(thd_lengths), size)  # natural token n is token slot[n] of the rank order
            rank_order = torch.empty_like(slot)
            rank_order[slot] = torch.arange(slot.numel())
            self.rank_from = rank_order  # whole token of each rank-order token
        self._runs: list[Runs] | None = None

    def runs(self, part: int) -> Runs:
        """Where rank `part`'s tokens sit in the whole sequence, as runs of consecutive tokens (built once)."""
        if self._runs is None:
            if self.fmt == "thd":
                local = self.local_len
                self._runs = [Runs.from_index(self.rank_from[p * local:(p + 1) * local])
                              for p in range(self.size)]
            elif self.identity:
                self._runs = [Runs([(0, p * self.local_len, self.local_len)], self.local_len)
                              for p in range(self.size)]
            else:
                self._runs = [Runs([(h * self.chunk, c * self.chunk, self.chunk)
                                    for h, c in enumerate(chunks_of_rank(self.size, p))], self.local_len)
                              for p in range(self.size)]
        return self._runs[part]


@functools.lru_cache(maxsize=32)
def seq_order(fmt: str, size: int, local_len: int, balanced: bool,
              thd_lengths: tuple[int, ...] | None = None) -> SeqOrder:
    """The SeqOrder of a layout, built once."""
    return SeqOrder(fmt, size, local_len, balanced, thd_lengths)


class A2AAttention:
    """cp_comm_type='a2a': the engine sees whole sequences (natural order) for num_heads / (P * G) heads at a time."""

    def __init__(self, engine: Engine, cfg: AttnConfig, aux: AttnAux, fmt: str, info: GroupInfo, order: SeqOrder,
                 groups: int, exchange=None):
        self.engine, self.fmt, self.info, self.order, self.groups = engine, fmt, info, order, groups
        self.exchange = exchange if exchange is not None else CollectiveExchange(info)
        self._peers = [p for p in range(info.size) if p != info.rank]
        self.cfg = dataclasses.replace(cfg, softmax_type="vanilla", return_max_logit=False)
        self.aux = aux
        self.hd = HEAD_DIM[fmt]
        self.local = None  # (shape, dtype) of q, k, v on this rank, for the gradients

    def group_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h, d] (this rank's tokens, every head) as a view [G, P, ..., h / (P G), d]: the heads rank p attends
        to in group g are [G, P][g, p]."""
        hd, p, g = self.hd, self.info.size, self.groups
        return x.unflatten(hd, (p, g, x.shape[hd] // (p * g))).movedim(hd + 1, 0).movedim(hd + 1, 1)

    def _layout(self, shapes) -> tuple[list, int]:
        """Where each tensor's [g, p] piece (shape `shapes[i]`, this rank's tokens of one head group) sits in a row of a
        region: (offset, numel, shape) per tensor, and the row's length."""
        layout, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            layout.append((offset, n, shape))
            offset += n
        return layout, offset

    def _pack(self, region: str, tensors) -> tuple[torch.Tensor, list]:
        """The region as [G, P, n], holding every tensor's group-g heads for rank p at [g, p], all in one pass (rank
        p = this rank left out where the exchange never sends a rank its own row)."""
        views = [self.group_heads(t) for t in tensors]
        layout, n = self._layout([v.shape[2:] for v in views])
        size = self.info.size
        buf = self.exchange.buffer(region, (self.groups, size, n), tensors[0].dtype, tensors[0].device)
        ranks = self._peers if self.exchange.keeps_own_row else range(size)
        full = full_runs(self.order.local_len)
        copy_rows([Move(Rows.of(view[g, p], self.fmt), Rows.packed(buf, (g * size + p) * n + offset, self.fmt, shape),
                        full)
                   for view, (offset, _, shape) in zip(views, layout) for g in range(self.groups) for p in ranks])
        return buf, layout

    def _own(self, tensors, group: int) -> list[torch.Tensor] | None:
        """This rank's own row of a group, read where it lies (views of `tensors`), for an exchange that keeps it."""
        if not self.exchange.keeps_own_row:
            return None
        return [self.group_heads(t)[group, self.info.rank] for t in tensors]

    def _piece(self, parts, p: int, i: int, offset: int, shape) -> Rows:
        """Tensor i's piece of row p of `parts` (a [P, n] tensor, or P rows, each a tensor or a list of pieces)."""
        row = parts[p]
        if isinstance(row, list):
            return Rows.of(row[i], self.fmt)
        return Rows.packed(row, offset, self.fmt, shape)

    def _unpack(self, parts, layout) -> list[torch.Tensor]:
        """Each tensor's whole sequence in natural order (for this rank's heads of the group) from the P received
        rows (a row may be a list holding each tensor's piece: this rank's own, read in place), in one pass."""
        wholes, moves = [], []
        for i, (offset, _, shape) in enumerate(layout):
            whole_shape = list(shape)
            whole_shape[self.order.sd] *= self.info.size
            first = parts[0][i] if isinstance(parts[0], list) else parts[0]
            whole = torch.empty(whole_shape, dtype=first.dtype, device=first.device)
            into = Rows.of(whole, self.fmt)
            moves += [Move(self._piece(parts, p, i, offset, shape), into, self.order.runs(p), into_whole=True)
                      for p in range(self.info.size)]
            wholes.append(whole)
        copy_rows(moves)
        return wholes

    def _send_back(self, wholes, row_buf: torch.Tensor, layout, dests, group: int) -> None:
        """Each rank's tokens of each whole sequence (this rank's heads of the group) into its row of row_buf ([P, n],
        pieces at `layout`), in one pass; where the exchange keeps our own row, ours go straight to the heads of the
        group in `dests`."""
        moves = []
        for whole, dest, (offset, _, shape) in zip(wholes, dests, layout):
            src = Rows.of(whole if rowable(whole) else whole.contiguous(), self.fmt)
            for p in range(self.info.size):
                if p == self.info.rank and self.exchange.keeps_own_row:
                    into = Rows.of(self.group_heads(dest)[group, p], self.fmt)
                else:
                    into = Rows.packed(row_buf, p * row_buf.stride(0) + offset, self.fmt, shape)
                moves.append(Move(src, into, self.order.runs(p)))
        copy_rows(moves)

    def _place(self, dests, received, layout) -> None:
        """The heads of every group in `dests` (for every rank p) <- row p of received[g] (rank p sent this rank's
        tokens), every group and tensor in one pass; our own rows are in place already where the exchange keeps
        them."""
        full = full_runs(self.order.local_len)
        moves = []
        for i, (dest, (offset, _, shape)) in enumerate(zip(dests, layout)):
            view = self.group_heads(dest)
            for g, parts in enumerate(received):
                moves += [Move(self._piece(parts, p, i, offset, shape), Rows.of(view[g, p], self.fmt), full)
                          for p in range(self.info.size) if p != self.info.rank or not self.exchange.keeps_own_row]
        copy_rows(moves)

    def _reserve(self, q, k, v) -> None:
        """Every region of the call, forward and backward: q, k, v in and dq, dk, dv back; out back and dout in."""
        qkv = sum(t.numel() * t.element_size() for t in (q, k, v))
        out = q.numel() // q.shape[-1] * v.shape[-1] * q.element_size()
        self.exchange.reserve({"fwd_in": qkv, "fwd_out": out, "bwd_in": out, "bwd_out": qkv})

    def _sink(self, sink: torch.Tensor | None, group: int) -> torch.Tensor | None:
        if sink is None:
            return None
        n = sink.numel() // (self.info.size * self.groups)
        first = (self.info.rank * self.groups + group) * n
        return sink[first:first + n]

    def forward(self, q, k, v, sink):
        ex, last, size = self.exchange, self.groups - 1, self.info.size
        q, k, v = (t if rowable(t) else t.contiguous() for t in (q, k, v))
        self.local = [(t.shape, t.dtype) for t in (q, k, v)]
        self._reserve(q, k, v)
        buf, layout = self._pack("fwd_in", (q, k, v))
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        out_layout, n_out = self._layout([self.group_heads(out).shape[2:]])
        out_buf = ex.buffer("fwd_out", (self.groups, size, n_out), q.dtype, q.device)
        ex.publish("fwd_in")
        pending = ex.pull("fwd_in", 0, buf[0], "fwd_qkv:0", exposed=True, own=self._own((q, k, v), 0))
        outgoing, saved, states = [], [], []
        for g in range(self.groups):
            following = (ex.pull("fwd_in", g + 1, buf[g + 1], f"fwd_qkv:{g + 1}", own=self._own((q, k, v), g + 1))
                         if g < last else None)
            qh, kh, vh = self._unpack(pending.wait(), layout)
            with torch.profiler.record_function(f"cp_attend:fwd:{g}"):
                res = self.engine.forward(qh, kh, vh, self.aux, self.cfg)
                out_h, lse = res.out, res.lse.to(acc_dtype(q))
                sink_g = self._sink(sink, g)
                if sink_g is not None:
                    out_h, lse = add_sink(out_h.to(acc_dtype(q)), lse, sink_g, self.fmt)
                    out_h = out_h.to(q.dtype)
            self._send_back([out_h], out_buf[g], out_layout, [out], g)
            ex.publish("fwd_out", g)
            outgoing.append(ex.pull("fwd_out", g, out_buf[g], f"fwd_out:{g}", exposed=g == last))
            saved += [qh, kh, vh, out_h, lse]
            states.append(BlockState(res.state, res.out))
            pending = following
        ex.release("fwd_in")
        self._place([out], [transfer.wait() for transfer in outgoing], out_layout)
        ex.release("fwd_out")
        return out, tuple(saved), states

    def backward(self, dout, saved, states, sink):
        ex, info, last = self.exchange, self.info, self.groups - 1
        dout = dout if rowable(dout) else dout.contiguous()
        buf, layout = self._pack("bwd_in", (dout,))
        grads_local = [torch.empty(shape, dtype=dtype, device=dout.device) for shape, dtype in self.local]
        grad_layout, n = self._layout([self.group_heads(t).shape[2:] for t in grads_local])
        grad_buf = ex.buffer("bwd_out", (self.groups, info.size, n), dout.dtype, dout.device)
        ex.publish("bwd_in")
        pending = ex.pull("bwd_in", 0, buf[0], "bwd_dout:0", exposed=True, own=self._own((dout,), 0))
        dsink = torch.zeros_like(sink) if sink is not None else None
        outgoing = []
        for g in range(self.groups):
            following = (ex.pull("bwd_in", g + 1, buf[g + 1], f"bwd_dout:{g + 1}", own=self._own((dout,), g + 1))
                         if g < last else None)
            (dout_h,) = self._unpack(pending.wait(), layout)
            qh, kh, vh, out_h, lse = saved[5 * g:5 * g + 5]
            with torch.profiler.record_function(f"cp_attend:bwd:{g}"):
                grads = self.engine.backward(dout_h, qh, kh, vh, out_h, lse, states[g].state, self.aux, self.cfg)
                sink_g = self._sink(sink, g)
                if sink_g is not None:
                    n_sink = sink_g.numel()
                    first = (info.rank * self.groups + g) * n_sink
                    dsink[first:first + n_sink] = sink_grad(dout_h, out_h, lse, sink_g, self.fmt)
            self._send_back((grads.dq, grads.dk, grads.dv), grad_buf[g], grad_layout, grads_local, g)
            ex.publish("bwd_out", g)
            outgoing.append(ex.pull("bwd_out", g, grad_buf[g], f"bwd_grads:{g}", exposed=g == last))
            pending = following
        ex.release("bwd_in")
        self._place(grads_local, [transfer.wait() for transfer in outgoing], grad_layout)
        ex.release("bwd_out")
        return (*grads_local, dsink)
