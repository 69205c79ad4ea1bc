"""Which part of a (query chunk, key chunk) pair a sliding window keeps, as a plain engine call. Pure Python.

Query token i of a chunk starting at global position Q0 sees key token j of a chunk starting at K0 iff
-left <= (K0 + j) - (Q0 + i) <= right (-1: unbounded; a causal mask is right = 0). Rows and columns that see
nothing are trimmed off; what remains is one engine call with a bottom-right aligned window (the convention of
every mask type but 'causal'/'padding_causal', which are top-left; on a square block the two agree).
"""
from __future__ import annotations

from typing import NamedTuple

UNBOUNDED = -1


class Band(NamedTuple):
    q_start: int   # rows [q_start, q_start + q_len) of the query chunk
    q_len: int
    k_start: int   # keys [k_start, k_start + k_len) of the key chunk
    k_len: int
    mask: str      # 'no_mask', 'causal' (square) or 'causal_bottom_right'
    window: tuple[int, int]

    @property
    def full(self) -> bool:
        return self.mask == "no_mask" and self.window == (UNBOUNDED, UNBOUNDED)


def band(n_q: int, n_k: int, delta: int, left: int, right: int) -> Band | None:
    """The block of an n_q x n_k pair whose key chunk starts `delta` tokens after the query chunk (K0 - Q0),
    or None when the window keeps nothing."""
    if n_q <= 0 or n_k <= 0:
        return None
    r0 = max(0, delta - right) if right >= 0 else 0
    r1 = min(n_q, n_k + delta + left) if left >= 0 else n_q
    if r0 >= r1:
        return None
    c0 = max(0, r0 - delta - left) if left >= 0 else 0
    c1 = min(n_k, r1 - delta + right) if right >= 0 else n_k
    if c0 >= c1:
        return None
    nq, nk = r1 - r0, c1 - c0
    shift = delta + c0 - r0 + nk - nq  # where the bottom-right diagonal sits, relative to the allowed band
    lo = left + shift if left >= 0 else UNBOUNDED
    hi = right - shift if right >= 0 else UNBOUNDED
    if lo >= nk - 1:  # the bound cuts nothing inside the block
        lo = UNBOUNDED
    if hi >= nq - 1:
        hi = UNBOUNDED
    if lo == UNBOUNDED and hi == UNBOUNDED:
        return Band(r0, nq, c0, nk, "no_mask", (UNBOUNDED, UNBOUNDED))
    if hi == 0:
        return Band(r0, nq, c0, nk, "causal" if nq == nk else "causal_bottom_right", (lo, 0))
    return Band(r0, nq, c0, nk, "no_mask", (lo, hi))


def chunk_bands(cp_size: int, rank: int, src: int, chunk: int, window: tuple[int, int]) -> list[tuple[int, int, Band]]:
    """Load-balanced layout: (local query half, key half, Band) for rank's queries against src's keys."""
    left, right = window
    q_chunks, k_chunks = (rank, 2 * cp_size - 1 - rank), (src, 2 * cp_size - 1 - src)
    out = []
    for qa, qc in enumerate(q_chunks):
        for kb, kc in enumerate(k_chunks):
            b = band(chunk, chunk, (kc - qc) * chunk, left, right)
            if b is not None:
                out.append((qa, kb, b))
    return out


def gathered_band(cp_size: int, chunk_index: int, chunk: int, window: tuple[int, int]) -> tuple[int, Band] | None:
    """All-gather: the key range [start, start + band.k_start + band.k_len) of the whole sequence that query
    chunk `chunk_index` needs, as (start, Band over the keys from `start`)."""
    left, right = window
    total = 2 * cp_size * chunk
    q0 = chunk_index * chunk
    start = max(0, q0 - left) if left >= 0 else 0
    end = min(total, q0 + chunk + right) if right >= 0 else total
    b = band(chunk, end - start, start - q0, left, right)
    return None if b is None else (start, b)


def neighbour_window(chunk: int, window: tuple[int, int]) -> bool:
    """Whether a bounded window reaches no further than the chunks next to a query chunk (left and right <= chunk):
    then a rank needs at most `left + right` keys from its neighbours."""
    left, right = window
    return 0 <= left <= chunk and 0 <= right <= chunk


def key_exchange(comm: str, qkv_format: str, chunk: int, window: tuple[int, int], fp8: bool = False) -> bool:
    """Whether a windowed CP call fetches just the keys its window reaches (window_exchange.py) instead of running
    its comm type's schedule: always for 'all_gather'; for 'p2p' and 'a2a' (bshd/sbhd, not FP8) when the window is
    within the neighbouring chunks, where a ring hop or an all-to-all would move every token for that window's
    keys. Measured on 2x H200 at 128k, window (4096, 0): 91% of one GPU against 77% for both schedules
    (benchmarks/results/cp/cp_h200x2.json)."""
    if comm == "all_gather":
        return True
    return comm in ("p2p", "a2a") and qkv_format != "thd" and not fp8 and neighbour_window(chunk, window)


def steps_needed(cp_size: int, chunk: int, window: tuple[int, int]) -> int:
    """How many ring steps any rank computes something in (the ring stops after them)."""
    last = 0
    for rank in range(cp_size):
        for step in range(cp_size):
            if chunk_bands(cp_size, rank, (rank - step) % cp_size, chunk, window):
                last = max(last, step)
    return last + 1
