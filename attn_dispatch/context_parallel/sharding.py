"""Split whole sequences into context-parallel shards and put them back, in Transformer Engine's layout.

Load-balanced layout (needed for causal masks, harmless otherwise): each sequence is cut in 2*cp_size
equal chunks and rank r holds chunk r followed by chunk 2*cp_size-1-r, so every rank gets the same
amount of causal work. Plain layout (load_balance=False): cp_size contiguous chunks, rank r holds chunk r;
fine for no_mask only. thd: every sequence of the packed batch is split that way on its own, and the
local cu_seqlens are the global ones divided by cp_size.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ._layout import SEQ_DIM


def chunks_of_rank(cp_size: int, cp_rank: int, load_balance: bool = True) -> tuple[int, ...]:
    """Which chunks (of 2*cp_size, or cp_size without load balance) rank cp_rank holds, in order."""
    if load_balance:
        return (cp_rank, 2 * cp_size - 1 - cp_rank)
    return (cp_rank,)


def _check(qkv_format: str, cp_size: int, cp_rank: int | None = None) -> None:
    if qkv_format not in SEQ_DIM:
        raise ValueError(f"qkv_format={qkv_format!r} is not supported; expected 'bshd', 'sbhd' or 'thd'")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive integer")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} must be in [0, {cp_size})")


def _seq_lengths(cu_seqlens: torch.Tensor | None, qkv_format: str) -> list[int]:
    if qkv_format != "thd":
        return []
    if cu_seqlens is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens (int32 [b+1], where each sequence starts in the "
                         "packed tensor: the padded variant when sequences are padded)")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens={cu!r} must start at 0 and never decrease")
    return [b - a for a, b in zip(cu, cu[1:])]


def _divisible(length: int, n_chunks: int, what: str) -> int:
    if length % n_chunks:
        raise ValueError(f"{what}={length} is not divisible by {n_chunks} (the number of context-parallel "
                         f"chunks); pad every sequence to a multiple of {n_chunks}")
    return length // n_chunks


def _thd_index(lengths: list[int], cp_size: int, cp_rank: int, load_balance: bool) -> torch.Tensor:
    n_chunks = 2 * cp_size if load_balance else cp_size
    parts, start = [], 0
    for i, n in enumerate(lengths):
        c = _divisible(n, n_chunks, f"length of sequence {i}")
        parts += [torch.arange(start + k * c, start + (k + 1) * c) for k in chunks_of_rank(cp_size, cp_rank,
                                                                                              load_balance)]
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def shard(x: torch.Tensor, qkv_format: str, cp_size: int, cp_rank: int, *, load_balance: bool = True,
          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's slice of a whole-sequence tensor (q, k, v, out, or a gradient); contiguous."""
    _check(qkv_format, cp_size, cp_rank)
    if qkv_format == "thd":
        index = _thd_index(_seq_lengths(cu_seqlens, "thd"), cp_size, cp_rank, load_balance).to(x.device)
        return x.index_select(0, index)
    dim = SEQ_DIM[qkv_format]
    n_chunks = 2 * cp_size if load_balance else cp_size
    c = _divisible(x.shape[dim], n_chunks, "sequence length")
    pieces = [x.narrow(dim, k * c, c) for k in chunks_of_rank(cp_size, cp_rank, load_balance)]
    return torch.cat(pieces, dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], qkv_format: str, *, load_balance: bool = True,
            cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The whole-sequence tensor from every rank's slice (shards[r] from rank r)."""
    cp_size = len(shards)
    _check(qkv_format, cp_size)
    if qkv_format == "thd":
        lengths = _seq_lengths(cu_seqlens, "thd")
        stacked = torch.cat(list(shards), 0)
        return stacked.index_select(0, thd_natural_index(lengths, cp_size, load_balance).to(stacked.device))
    dim = SEQ_DIM[qkv_format]
    per_chunk = len(chunks_of_rank(cp_size, 0, load_balance))
    pieces: dict[int, torch.Tensor] = {}
    for rank, s in enumerate(shards):
        c = _divisible(s.shape[dim], per_chunk, f"shard {rank} length")
        for k, chunk in enumerate(chunks_of_rank(cp_size, rank, load_balance)):
            pieces[chunk] = s.narrow(dim, k * c, c)
    return torch.cat([pieces[k] for k in sorted(pieces)], dim)


def thd_natural_index(lengths: list[int], cp_size: int, load_balance: bool = True) -> torch.Tensor:
    """For thd: natural = cat(shards of ranks 0..P-1)[index]."""
    local = [_thd_index(lengths, cp_size, r, load_balance) for r in range(cp_size)]
    order = torch.cat(local)  # order[j] = natural position of the j-th token in rank order
    index = torch.empty_like(order)
    index[order] = torch.arange(order.numel())
    return index


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Each rank's cu_seqlens for thd: the global ones divided by cp_size (TE's convention)."""
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor").to(cu_seqlens.dtype)


def cp_rank_of(cp_group) -> int:
    """This process's rank in the sharded layout. For cp_comm_type='a2a+p2p' (cp_group = [a2a_group,
    p2p_group]) it is p2p_rank * a2a_size + a2a_rank: the a2a group holds consecutive chunks."""
    if isinstance(cp_group, (list, tuple)):
        a2a, p2p = cp_group
        return dist.get_rank(p2p) * dist.get_world_size(a2a) + dist.get_rank(a2a)
    return dist.get_rank(cp_group)


def cp_size_of(cp_group) -> int:
    if isinstance(cp_group, (list, tuple)):
        return dist.get_world_size(cp_group[0]) * dist.get_world_size(cp_group[1])
    return dist.get_world_size(cp_group)


def gather(local: torch.Tensor, qkv_format: str, cp_group, *, load_balance: bool = True,
           cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Collective: the whole-sequence tensor on every rank (for checks and evaluation; not differentiable)."""
    size = cp_size_of(cp_group)
    groups = list(cp_group) if isinstance(cp_group, (list, tuple)) else [cp_group]
    if len(groups) == 1:
        parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=groups[0])
    else:  # gather over the product of the two groups, then order by cp_rank_of
        a2a, p2p = groups
        inner = [torch.empty_like(local, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(a2a))]
        dist.all_gather(inner, local.contiguous(), group=a2a)
        stacked = torch.stack(inner)
        outer = [torch.empty_like(stacked, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(p2p))]
        dist.all_gather(outer, stacked, group=p2p)
        parts = [t for block in outer for t in block]
    return unshard(parts, qkv_format, load_balance=load_balance, cu_seqlens=cu_seqlens)


class RankOrder:
    """Converts between 'rank order' (the shards of ranks 0..P-1 concatenated along the sequence, what an
    all-gather or all-to-all delivers) and natural order, for a load-balanced layout.

    bshd/sbhd: a chunk permutation (rank p's two chunks are p and 2P-1-p). thd: a token index built from
    the sequence lengths (lengths of the gathered sequences, each divisible by 2P)."""

    def __init__(self, qkv_format: str, cp_size: int, device: torch.device, lengths: list[int] | None = None):
        self.fmt, self.dim = qkv_format, SEQ_DIM[qkv_format]
        p = cp_size
        if qkv_format == "thd":
            assert lengths is not None
            self.natural = thd_natural_index(lengths, p).to(device)
            self.ranks = torch.cat([_thd_index(lengths, p, r, True) for r in range(p)]).to(device)
        else:
            # natural chunk c sits at rank-order slot 2c (c < P) or 2(2P-1-c)+1 (c >= P)
            nat = [2 * c if c < p else 2 * (2 * p - 1 - c) + 1 for c in range(2 * p)]
            self.n_chunks = 2 * p
            self.natural = torch.tensor(nat, device=device)
            inv = [0] * (2 * p)
            for c, slot in enumerate(nat):
                inv[slot] = c
            self.ranks = torch.tensor(inv, device=device)

    def _apply(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if self.fmt == "thd":
            return x.index_select(0, index)
        chunked = x.unflatten(self.dim, (self.n_chunks, x.shape[self.dim] // self.n_chunks))
        return chunked.index_select(self.dim, index).flatten(self.dim, self.dim + 1)

    def to_natural(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, self.natural)

    def to_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, self.ranks)
