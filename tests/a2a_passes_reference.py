"""The a2a memory passes (head_groups.A2AAttention's pack, unpack, send-back and place) against the per-piece torch
copies they replaced, kept here as the reference: one copy per run of tokens of SeqOrder.runs (to_whole, write_rows)
and one copy per tensor and rank for packing and placing. Shared by tests/test_cp_row_copy.py (CPU) and
tests/gpu/test_cp_row_copy_gpu.py (the Triton kernel). Every comparison is exact: the passes only move bytes."""
from __future__ import annotations

import os

import torch

from attn_dispatch.backends import AttnAux, AttnConfig, get_engine
from attn_dispatch.context_parallel import _row_copy, head_groups
from attn_dispatch.context_parallel._comm import GroupInfo

SEQ_DIM = {"bshd": 1, "sbhd": 0, "thd": 0}


class NaNExchange:
    """The parts of the exchange interface the passes use: regions start as NaN, so a row written by one path and
    not the other shows up."""

    transport = "reference"

    def __init__(self, keeps_own_row: bool):
        self.keeps_own_row = keeps_own_row

    def buffer(self, region, shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)


def thd_lengths(size: int) -> tuple[int, ...]:
    return tuple(2 * size * n for n in (1, 3, 2, 5))


def make_attention(fmt: str, size: int, rank: int, groups: int, balanced: bool, keeps_own_row: bool, local_len: int,
                   device) -> head_groups.A2AAttention:
    order = head_groups.SeqOrder(fmt, size, local_len, balanced,
                                 thd_lengths(size) if fmt == "thd" else None)
    cfg = AttnConfig(fmt, "causal" if balanced else "no_mask", (-1, 0) if balanced else (-1, -1), 0.5)
    return head_groups.A2AAttention(get_engine("unfused:pytorch"), cfg, AttnAux(), fmt,
                                    GroupInfo(None, size, rank, tuple(range(size))), order, groups,
                                    NaNExchange(keeps_own_row))


def local_inputs(fmt: str, size: int, groups: int, heads_per_group: int, dtype, device, gen, skew: int = 1,
                 batch: int = 2, local: int | None = None, d: int = 8, dv: int = 6):
    """q, k, v on one rank: q with `heads_per_group` heads per (rank, group), k and v with one (GQA), v's head dim
    apart from q's; q strided (its heads a slice of a wider tensor, its head dim skewed by `skew` elements), k
    contiguous, v's tokens every other one of a longer tensor."""
    if local is None:
        local = sum(thd_lengths(size)) // size if fmt == "thd" else 4 * size
    h, hkv = heads_per_group * size * groups, size * groups

    def shaped(heads, dim, wider=0, skewed=0, step=1):
        lead = {"bshd": (batch, step * local), "sbhd": (step * local, batch), "thd": (step * local,)}[fmt]
        x = torch.randn(*lead, heads + wider, dim + skewed, generator=gen).to(device, dtype)[..., wider:, skewed:]
        return x.narrow(SEQ_DIM[fmt], 0, step * local).unflatten(SEQ_DIM[fmt], (local, step)).select(
            SEQ_DIM[fmt] + 1, step - 1)

    return shaped(h, d, wider=2, skewed=skew), shaped(hkv, d), shaped(hkv, dv, step=2)


def pack_reference(a2a, tensors):
    views = [a2a.group_heads(t) for t in tensors]
    layout, n = a2a._layout([v.shape[2:] for v in views])
    size = a2a.info.size
    buf = torch.full((a2a.groups, size, n), float("nan"), dtype=tensors[0].dtype, device=tensors[0].device)
    for view, (offset, numel, shape) in zip(views, layout):
        if a2a.exchange.keeps_own_row:
            for p in range(size):
                if p != a2a.info.rank:
                    buf[:, p, offset:offset + numel].unflatten(-1, shape).copy_(view[:, p])
        else:
            buf[:, :, offset:offset + numel].unflatten(-1, shape).copy_(view)
    return buf, layout


def to_whole(order, parts) -> torch.Tensor:
    """[P, *local shape] (a tensor, or a list of P tensors; slice p from rank p) -> the whole sequence in natural
    order: one copy per run of order.runs(p)."""
    first = parts[0]
    shape = list(first.shape)
    shape[order.sd] = order.local_len * order.size
    whole = torch.empty(shape, dtype=first.dtype, device=first.device)
    for p in range(order.size):
        for at_part, at_whole, n in order.runs(p).triples:
            whole.narrow(order.sd, at_whole, n).copy_(parts[p].narrow(order.sd, at_part, n))
    return whole


def write_rows(order, whole: torch.Tensor, targets: dict) -> None:
    """targets[p] (rank p's local shape, any strides) <- rank p's tokens of the whole sequence, for each p given."""
    for p, t in targets.items():
        for at_part, at_whole, n in order.runs(p).triples:
            t.narrow(order.sd, at_part, n).copy_(whole.narrow(order.sd, at_whole, n))


def unpack_reference(a2a, parts, layout):
    if isinstance(parts, torch.Tensor):
        return [to_whole(a2a.order, parts[:, offset:offset + n].unflatten(-1, shape)) for offset, n, shape in layout]
    return [to_whole(a2a.order, [row[i] if isinstance(row, list) else row[offset:offset + n].view(shape)
                                for row in parts])
            for i, (offset, n, shape) in enumerate(layout)]


def send_back_reference(a2a, wholes, row_buf, layout, dests, group):
    for whole, dest, (offset, n, shape) in zip(wholes, dests, layout):
        rows = {p: row_buf[p, offset:offset + n].unflatten(-1, shape) for p in range(a2a.info.size)}
        if a2a.exchange.keeps_own_row:
            rows[a2a.info.rank] = a2a.group_heads(dest)[group, a2a.info.rank]
        write_rows(a2a.order, whole, rows)


def place_reference(a2a, dests, received, layout):
    for g, parts in enumerate(received):
        for dest, (offset, n, _) in zip(dests, layout):
            view = a2a.group_heads(dest)[g]
            if isinstance(parts, torch.Tensor):
                view.copy_(parts[:, offset:offset + n].view(view.shape))
                continue
            for p, row in enumerate(parts):
                if p != a2a.info.rank or not a2a.exchange.keeps_own_row:
                    view[p].copy_(row[offset:offset + n].view(view.shape[1:]))


def _received(a2a, n: int, own, dtype, device, gen):
    """What a pull hands over for one group: the collective's [P, n] tensor, or P rows (peers' rows as views into a
    region of theirs, this rank's own row `own` where the exchange keeps it)."""
    size = a2a.info.size
    if not a2a.exchange.keeps_own_row:
        return torch.randn(size, n, generator=gen).to(device, dtype)
    region = torch.randn(a2a.groups, size, n, generator=gen).to(device, dtype)
    return [own if p == a2a.info.rank else region[p % a2a.groups, a2a.info.rank] for p in range(size)]


def _equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what} {i}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a.isnan(), b.isnan()), f"{what} {i}: rows written differ"
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), f"{what} {i}: values differ"


def check_passes(fmt: str, size: int, balanced: bool, groups: int, keeps_own_row: bool, heads_per_group: int,
                 dtype, device, mode: str, seed: int = 0, skew: int = 1, **sizes) -> None:
    """Every pass of a forward and a backward (q, k, v in, out back; dout in, dq, dk, dv back) through `mode`'s
    copies against the reference, bit for bit, on ranks size - 1 and 0. sizes: local_inputs' batch, local, d, dv
    (thd: leave local out: the lengths set it)."""
    gen = torch.Generator().manual_seed(seed)
    for rank in (size - 1, 0):
        q, k, v = local_inputs(fmt, size, groups, heads_per_group, dtype, device, gen, skew, **sizes)
        a2a = make_attention(fmt, size, rank, groups, balanced, keeps_own_row, q.shape[SEQ_DIM[fmt]], device)
        with _copies(_row_copy, mode):
            # in: q, k, v packed, then each group's whole sequences
            buf, layout = a2a._pack("fwd_in", (q, k, v))
            want_buf, want_layout = pack_reference(a2a, (q, k, v))
            assert layout == want_layout
            _equal([buf], [want_buf], "packed region")
            n = buf.shape[-1]
            for g in range(groups):
                parts = _received(a2a, n, a2a._own((q, k, v), g), dtype, device, gen)
                _equal(a2a._unpack(parts, layout), unpack_reference(a2a, parts, layout), f"group {g} whole")
            # back: each group's results into the rows sent and this rank's own heads, then the rows received placed
            wholes = []
            for _, _, shape in layout:
                whole_shape = list(shape)
                whole_shape[SEQ_DIM[fmt]] *= size
                wholes.append(torch.randn(whole_shape, generator=gen).to(device, dtype))
            dests, want_dests = ([torch.full(t.shape, float("nan"), dtype=dtype, device=device) for t in (q, k, v)]
                                 for _ in range(2))
            for g in range(groups):
                row_buf = torch.full((size, n), float("nan"), dtype=dtype, device=device)
                want_row_buf = row_buf.clone()
                a2a._send_back(wholes, row_buf, layout, dests, g)
                send_back_reference(a2a, wholes, want_row_buf, layout, want_dests, g)
                _equal([row_buf], [want_row_buf], f"group {g} rows sent")
            _equal(dests, want_dests, "own heads")
            received = [_received(a2a, n, torch.full((n,), float("nan"), dtype=dtype, device=device), dtype, device,
                                  gen) for _ in range(groups)]
            a2a._place(dests, received, layout)
            place_reference(a2a, want_dests, received, layout)
            _equal(dests, want_dests, "placed")
            assert not any(bool(d.isnan().any()) for d in dests), "a head left unwritten"


class _copies:
    """ATTN_DISPATCH_CP_A2A_COPIES set for a block."""

    def __init__(self, module, mode: str):
        self.module, self.mode = module, mode

    def __enter__(self):
        self.before = os.environ.get(self.module.COPIES_ENV)
        os.environ[self.module.COPIES_ENV] = self.mode

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop(self.module.COPIES_ENV, None)
        else:
            os.environ[self.module.COPIES_ENV] = self.before
