"""Token rows copied between tensors, all of a call's in one pass: what the a2a exchange does around each transfer
(heads packed into the send region, whole sequences assembled in natural order from the rows received, each rank's
tokens written back into the rows it sends, results placed into the caller's heads).

A tensor takes part as Rows: [batch, tokens, heads, dim] elements, dim contiguous, the other strides free, so a rank's
heads read where they lie (views of q, k, v), a region's rows and a peer's memory go in alike, without copies. A Move
copies its source's rows into its destination: every row in order (Runs.full), or by a token order (SeqOrder's runs:
part p's tokens j..j+n are the whole sequence's tokens i..i+n), from a part into the whole or back.

Where Triton runs (CUDA, once a self-check against torch passed on the device), the moves of a call are one kernel
launch: a table of segments (source, first row, row and head strides; destination, the same; heads, dim, rows) made
once per geometry and cached, a table of tiles over it, and the call's base addresses (a small table cached by
address: the allocator hands a training loop the same addresses step after step). Each program copies a tile of rows
of one head of one segment, in the widest unit that every address, stride and width allows (16-byte accesses where
all are multiples of 16 bytes), so a pass reads each source row once and writes each destination row once, and
reads over NVLink overlap local ones in the same launch. Elsewhere torch copies each move in one op: copy_ for
whole moves, index_copy_ / index_select along the tokens with a cached index otherwise.

ATTN_DISPATCH_CP_A2A_COPIES: auto (the default: Triton where it runs, else torch; on one H200 the passes of a
fwd+bwd took 4.5 ms against 8.6 per chunk, benchmarks/results/README.md), pieces (one torch copy per run of tokens:
the per-chunk copies a2a ran before), torch (torch's ops), triton (the kernel without the self-check; on CPU tensors
only under Triton's interpreter, TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from collections import OrderedDict
from typing import NamedTuple

import torch

from ..env import choice

try:  # Triton ships with torch's CUDA builds; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

logger = logging.getLogger("attn_dispatch")

COPIES_ENV = "ATTN_DISPATCH_CP_A2A_COPIES"
COPY_MODES = ("auto", "torch", "pieces", "triton")
_TILE_BYTES = 16384  # per program: enough loads in flight to cover NVLink's latency on peers' rows
_MAX_BLOCK_BYTES = 2048  # per program and row: a head dim of 1024 bf16 elements
_SEGMENT_FIELDS = 12  # src slot, start, row stride, head stride; dst the same; heads, dim, rows, (pad)
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def copy_mode() -> str:
    return choice(COPIES_ENV, COPY_MODES, "auto")


class Rows(NamedTuple):
    """Rows of `tensor`: [batch, tokens, heads, dim] elements from `offset` (elements past tensor.data_ptr()) with
    strides (batch_stride, token_stride, head_stride, 1)."""
    tensor: torch.Tensor
    offset: int
    batch: int
    tokens: int
    heads: int
    dim: int
    batch_stride: int
    token_stride: int
    head_stride: int

    @classmethod
    def of(cls, x: torch.Tensor, fmt: str) -> Rows:
        """x laid out as qkv_format fmt: bshd [b, s, h, d], sbhd [s, b, h, d], thd [t, h, d]; dim contiguous."""
        if not rowable(x):
            raise ValueError(f"internal error: rows need a contiguous head dim (strides {tuple(x.stride())})")
        h, d, sh = x.shape[-2], x.shape[-1], x.stride(-2)
        if fmt == "bshd":
            return cls(x, 0, x.shape[0], x.shape[1], h, d, x.stride(0), x.stride(1), sh)
        if fmt == "sbhd":
            return cls(x, 0, x.shape[1], x.shape[0], h, d, x.stride(1), x.stride(0), sh)
        return cls(x, 0, 1, x.shape[0], h, d, 0, x.stride(0), sh)

    @classmethod
    def packed(cls, buf: torch.Tensor, offset: int, fmt: str, shape) -> Rows:
        """A contiguous piece of shape `shape` (qkv_format fmt) at `offset` elements into buf."""
        h, d = shape[-2], shape[-1]
        width = h * d
        if fmt == "bshd":
            return cls(buf, offset, shape[0], shape[1], h, d, shape[1] * width, width, d)
        if fmt == "sbhd":
            return cls(buf, offset, shape[1], shape[0], h, d, width, shape[1] * width, d)
        return cls(buf, offset, 1, shape[0], h, d, 0, width, d)

    def view(self) -> torch.Tensor:
        """The rows as a torch view [batch, tokens, heads, dim]."""
        t = self.tensor
        return t.as_strided((self.batch, self.tokens, self.heads, self.dim),
                            (self.batch_stride, self.token_stride, self.head_stride, 1),
                            t.storage_offset() + self.offset)

    def address(self) -> int:
        return self.tensor.data_ptr() + self.offset * self.tensor.element_size()


def rowable(x: torch.Tensor) -> bool:
    """Whether x [..., h, d] can take part as Rows (its head dim contiguous)."""
    return x.stride(-1) == 1 or x.shape[-1] == 1


class Runs:
    """Where a part's tokens sit in the whole sequence: (part token, whole token, count) triples covering the part's
    `tokens` tokens. Built once (SeqOrder holds its own); its key names it in the kernel's plan cache."""

    _keys = itertools.count()

    def __init__(self, triples, tokens: int, full: bool = False):
        self.triples = tuple((int(a), int(b), int(n)) for a, b, n in triples if n > 0)
        self.tokens = tokens
        self.key = next(Runs._keys)
        self.full = full  # every token to the same place, between rows of equal length: a plain copy
        self._index: dict = {}
        self._table = torch.tensor(self.triples, dtype=torch.int64).view(-1, 3)

    @classmethod
    def from_index(cls, whole_of_part: torch.Tensor) -> Runs:
        """The runs of an index (whole token of each part token), consecutive tokens on both sides joined."""
        idx = whole_of_part.detach().to("cpu", torch.int64).flatten()
        if idx.numel() == 0:
            return cls((), 0)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                            torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1])
        counts = torch.diff(torch.cat([starts, torch.tensor([idx.numel()])]))
        return cls(zip(starts.tolist(), idx[starts].tolist(), counts.tolist()), idx.numel())

    def index(self, device: torch.device) -> torch.Tensor:
        """The whole token of each part token, int64 on `device` (torch's index ops)."""
        got = self._index.get(device)
        if got is None:
            idx = torch.empty(self.tokens, dtype=torch.int64)
            for part, whole, n in self.triples:
                idx[part:part + n] = torch.arange(whole, whole + n)
            got = self._index[device] = idx.to(device)
        return got


@functools.lru_cache(maxsize=64)
def full_runs(tokens: int) -> Runs:
    """Every token to the same place: a plain copy."""
    return Runs(((0, 0, tokens),), tokens, full=True)


class Move(NamedTuple):
    """src's rows into dst's: by `runs` from a part into the whole (into_whole) or from the whole into a part."""
    src: Rows
    dst: Rows
    runs: Runs
    into_whole: bool = False


def copy_rows(moves: list[Move], mode: str | None = None) -> None:
    """Every move, in one kernel launch where Triton runs, else one torch op per move. mode: one of COPY_MODES;
    None: the environment's (COPIES_ENV)."""
    moves = [m for m in moves if m.src.batch and m.runs.tokens and m.src.heads and m.src.dim]
    if not moves:
        return
    mode = copy_mode() if mode is None else mode
    device = moves[0].dst.tensor.device
    if mode == "triton" and triton is None:
        raise RuntimeError(f"{COPIES_ENV}=triton, but Triton is not installed; unset it (auto uses torch's ops)")
    if mode != "triton" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        mode = "pieces"  # a CUDA graph's capture: no copy of tables or indices to the device in it
    if mode == "triton" or (mode == "auto" and triton_ready(device) and _kernel_takes(moves)):
        _copy_triton(moves, device)
    else:
        _copy_torch(moves, pieces=mode == "pieces")


def _copy_torch(moves: list[Move], pieces: bool) -> None:
    for m in moves:
        src, dst = m.src.view(), m.dst.view()
        if m.runs.full:
            dst.copy_(src)
        elif pieces:
            for part, whole, n in m.runs.triples:
                at_src, at_dst = (part, whole) if m.into_whole else (whole, part)
                dst.narrow(1, at_dst, n).copy_(src.narrow(1, at_src, n))
        elif m.into_whole:
            dst.index_copy_(1, m.runs.index(dst.device), src)
        else:
            torch.index_select(src, 1, m.runs.index(src.device), out=dst)


# ----------------------------------------------------------------------------------------------------------------
# The Triton pass

if triton is not None:
    @triton.jit
    def _copy_rows_kernel(tiles_ptr, segments_ptr, bases_ptr, unit_ptr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_DIM: tl.constexpr, ALIGN: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        col0 = tl.program_id(2) * BLOCK_DIM
        seg = segments_ptr + tl.load(tiles_ptr + 2 * tile) * 12
        heads = tl.load(seg + 8)
        dim = tl.multiple_of(tl.load(seg + 9), ALIGN)
        if (head < heads) & (col0 < dim):
            first = tl.load(tiles_ptr + 2 * tile + 1)
            count = tl.load(seg + 10)
            src = unit_ptr + tl.multiple_of(tl.load(bases_ptr + tl.load(seg)), ALIGN)
            src_start = tl.multiple_of(tl.load(seg + 1), ALIGN)
            src_rows = tl.multiple_of(tl.load(seg + 2), ALIGN)
            src_heads = tl.multiple_of(tl.load(seg + 3), ALIGN)
            dst = unit_ptr + tl.multiple_of(tl.load(bases_ptr + tl.load(seg + 4)), ALIGN)
            dst_start = tl.multiple_of(tl.load(seg + 5), ALIGN)
            dst_rows = tl.multiple_of(tl.load(seg + 6), ALIGN)
            dst_heads = tl.multiple_of(tl.load(seg + 7), ALIGN)
            rows = first + tl.arange(0, BLOCK_ROWS)
            cols = col0 + tl.arange(0, BLOCK_DIM)
            mask = (rows < count)[:, None] & (cols < dim)[None, :]
            src_at = src_start + head * src_heads + rows * src_rows
            dst_at = dst_start + head * dst_heads + rows * dst_rows
            values = tl.load(src + src_at[:, None] + cols[None, :], mask=mask)
            tl.store(dst + dst_at[:, None] + cols[None, :], values, mask=mask)


def _pow2_at_least(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class _Plan:
    """The segments of a call's geometry in elements (slot 2m: move m's source, 2m + 1: its destination), and per
    unit and device the tables the kernel reads."""

    def __init__(self, moves: list[Move]):
        columns = []
        for m, move in enumerate(moves):
            src, dst, runs = move.src, move.dst, move.runs
            if (src.batch, src.heads, src.dim) != (dst.batch, dst.heads, dst.dim):
                raise ValueError(f"internal error: rows of {src.batch}x{src.heads}x{src.dim} copied into "
                                 f"{dst.batch}x{dst.heads}x{dst.dim}")
            heads, dim, src_heads, dst_heads = src.heads, src.dim, src.head_stride, dst.head_stride
            if heads == 1 or (src_heads == dim and dst_heads == dim):  # a token's heads in one row
                heads, dim, src_heads, dst_heads = 1, heads * dim, 0, 0
            table = runs._table
            part, whole, count = table[:, 0], table[:, 1], table[:, 2]
            at_src, at_dst = (part, whole) if move.into_whole else (whole, part)
            part_rows = src if move.into_whole or runs.full else dst
            if part_rows.tokens != runs.tokens or (runs.full and src.tokens != dst.tokens) or \
                    int((at_src + count).max()) > src.tokens or int((at_dst + count).max()) > dst.tokens:
                raise ValueError(f"internal error: runs over {runs.tokens} tokens between rows of {src.tokens} and "
                                 f"{dst.tokens} tokens")
            batch = torch.arange(src.batch, dtype=torch.int64)[:, None]
            n = batch.shape[0] * count.shape[0]
            columns.append(torch.stack([
                torch.full((n,), 2 * m), (batch * src.batch_stride + at_src * src.token_stride).flatten(),
                torch.full((n,), src.token_stride), torch.full((n,), src_heads),
                torch.full((n,), 2 * m + 1), (batch * dst.batch_stride + at_dst * dst.token_stride).flatten(),
                torch.full((n,), dst.token_stride), torch.full((n,), dst_heads),
                torch.full((n,), heads), torch.full((n,), dim), count.expand(src.batch, -1).flatten(),
                torch.zeros(n, dtype=torch.int64)], dim=1))
        self.segments = torch.cat(columns)  # elements
        # what every offset, stride and width is a multiple of, in bytes (addresses are the call's)
        esize = moves[0].src.tensor.element_size()
        quantities = self.segments[:, [1, 2, 3, 5, 6, 7, 9]].abs().flatten()
        self.byte_gcd = math.gcd(16, *(int(g) * esize for g in torch.unique(quantities).tolist()))
        self.max_heads = int(self.segments[:, 8].max())
        self.max_dim = int(self.segments[:, 9].max())
        self.max_rows = int(self.segments[:, 10].max())
        self.esize = esize
        self._tables: dict = {}

    def tables(self, unit: int, device: torch.device):
        key = (unit, device)
        got = self._tables.get(key)
        if got is None:
            scale = self.esize / unit
            segments = self.segments.clone()
            for col in (1, 2, 3, 5, 6, 7, 9):
                segments[:, col] = segments[:, col] * self.esize // unit
            dim_units = int(self.max_dim * scale)
            block_dim = min(_pow2_at_least(dim_units), _MAX_BLOCK_BYTES // unit)
            block_rows = max(2, min(_TILE_BYTES // (block_dim * unit), _pow2_at_least(self.max_rows)))
            per_segment = (segments[:, 10] + block_rows - 1) // block_rows
            seg_ids = torch.repeat_interleave(torch.arange(segments.shape[0]), per_segment)
            firsts = torch.cumsum(per_segment, 0) - per_segment
            rows = (torch.arange(seg_ids.numel()) - firsts[seg_ids]) * block_rows
            tiles = torch.stack([seg_ids, rows], dim=1)
            grid = (tiles.shape[0], self.max_heads, triton.cdiv(dim_units, block_dim))
            got = self._tables[key] = (_to_device(tiles, device), _to_device(segments, device), grid,
                                       block_rows, block_dim)
        return got


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on the device without a host sync (pinned, asynchronous) where the device is a GPU."""
    t = t.contiguous()
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_PLANS: OrderedDict = OrderedDict()
_PLAN_LIMIT = 256
_BASES: OrderedDict = OrderedDict()
_BASES_LIMIT = 2048


def _plan(moves: list[Move]) -> _Plan:
    key = (moves[0].src.tensor.element_size(),
           *((m.src[2:], m.dst[2:], m.runs.key, m.into_whole) for m in moves))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(moves)
        if len(_PLANS) > _PLAN_LIMIT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _bases(addresses: tuple[int, ...], unit: int, device: torch.device) -> torch.Tensor:
    """Each address as units past the kernel's anchor (_unit_ref): a pointer argument, whose alignment Triton knows,
    plus a hinted offset keeps 16-byte accesses (a pointer cast from a loaded integer does not)."""
    key = (device, unit, addresses)
    got = _BASES.get(key)
    if got is None:
        anchor = _unit_ref(unit, device).data_ptr()
        got = _BASES[key] = _to_device(torch.tensor([(a - anchor) // unit for a in addresses], dtype=torch.int64),
                                       device)
        if len(_BASES) > _BASES_LIMIT:
            _BASES.popitem(last=False)
    else:
        _BASES.move_to_end(key)
    return got


@functools.lru_cache(maxsize=None)
def _unit_ref(unit: int, device: torch.device) -> torch.Tensor:
    """The kernel's anchor: its pointer type is the unit copied, every address an offset from it (16 bytes long, so
    the allocator aligns it)."""
    return torch.empty(16 // unit, dtype=_UNITS[unit], device=device)


def _kernel_takes(moves: list[Move]) -> bool:
    esize = moves[0].src.tensor.element_size()
    return all(m.src.tensor.element_size() == esize and m.dst.tensor.element_size() == esize
               and m.src.tensor.device == m.dst.tensor.device for m in moves)


def _copy_triton(moves: list[Move], device: torch.device) -> None:
    plan = _plan(moves)
    addresses = tuple(a for m in moves for a in (m.src.address(), m.dst.address()))
    common = math.gcd(plan.byte_gcd, *addresses)
    unit = next(u for u in (8, 4, 2, 1) if common % u == 0)
    aligned = common % 16 == 0
    tiles, segments, grid, block_rows, block_dim = plan.tables(unit, device)
    bases = _bases(addresses, unit, device)
    launch = functools.partial(
        _copy_rows_kernel[grid], tiles, segments, bases, _unit_ref(unit, device), BLOCK_ROWS=block_rows,
        BLOCK_DIM=block_dim, ALIGN=16 // unit if aligned else 1, num_warps=4)
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch()
    else:
        launch()


# ----------------------------------------------------------------------------------------------------------------
# The self-check

_CHECKED: dict = {}  # device -> None (the kernel matched torch) or why not


def triton_ready(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA, Triton importable, and the one-time self-check passed there."""
    if triton is None or device.type != "cuda":
        return False
    if device not in _CHECKED:
        reason = self_check(device)
        _CHECKED[device] = reason
        if reason is not None:
            logger.warning("context parallelism: a2a's one-pass row copies are off on %s (%s); torch's index ops "
                           "copy the rows instead", device, reason)
    return _CHECKED[device] is None


def self_check(device: torch.device) -> str | None:
    """None where the kernel copies as torch does on `device` (random rows: strided sources, heads apart and
    together, both directions of a token order, batches, 16-byte and 2-byte units), else why not. Syncs once."""
    try:
        for dtype, dim, skew in ((torch.bfloat16, 128, 0), (torch.float16, 24, 1)):
            want_moves, want = _check_case(device, dtype, dim, skew)
            got_moves, got = _check_case(device, dtype, dim, skew)
            _copy_torch(want_moves, pieces=False)
            _copy_triton(got_moves, device)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                return "the kernel's rows differ from torch's"
    except Exception as exc:  # noqa: BLE001 - any failure means: torch's ops
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def _check_case(device: torch.device, dtype: torch.dtype, dim: int, skew: int):
    """The self-check's moves over fresh random sources (the same for the same arguments) into zeroed outputs."""
    gen = torch.Generator().manual_seed(20260612 + dim)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    tokens, parts, heads, batch = 24, 3, 3, 2
    local = tokens // parts
    order = torch.randperm(tokens, generator=gen)
    runs = [Runs.from_index(order[p * local:(p + 1) * local]) for p in range(parts)]
    whole = torch.zeros(batch, tokens, heads, dim, dtype=dtype, device=device)
    spread = torch.zeros(local, batch, 2 * heads, dim, dtype=dtype, device=device)
    flat = torch.zeros(local + 3, heads, dim + skew, dtype=dtype, device=device)
    own = rnd(batch, local, 2 * heads, dim + skew)[..., skew:]  # bshd, half the heads, skewed by `skew` elements
    received = rnd(parts - 1, local, batch, heads, dim)  # sbhd rows, contiguous
    moves = [Move(Rows.of(own[:, :, heads:], "bshd"), Rows.of(whole, "bshd"), runs[0], True)]
    moves += [Move(Rows.of(received[p - 1], "sbhd"), Rows.of(whole.transpose(0, 1), "sbhd"), runs[p], True)
              for p in range(1, parts)]
    moves.append(Move(Rows.of(rnd(tokens, batch, heads, dim), "sbhd"), Rows.of(spread[:, :, ::2], "sbhd"), runs[1]))
    moves.append(Move(Rows.of(rnd(local, heads, dim), "thd"), Rows.of(flat[3:, :, skew:], "thd"), full_runs(local)))
    return moves, [whole, spread, flat]
