"""Bool attention masks (torch SDPA's convention: True = take part) that are exactly a padding pattern, recognised
so that the SDPA function runs them as Transformer Engine mask types the fused engines take, with torch SDPA's
semantics on every row (padded rows too).

A mask [1|b, 1|h (the same for every head), sq, skv] is recognised when, in every batch element b, the keys a row
sees form one range [start_b, end_b) cut by at most a diagonal and a sliding window of `left` keys before it (one
`left` for the whole mask):
- key padding, no diagonal: row i sees [start_b, end_b) (BERT-like batches; decode steps over a padded cache);
- top-left causal: row i sees [max(start_b, i - left), min(end_b, i + 1)) (a padded decoder batch, torch's
  is_causal, transformers' sliding-window layers);
- bottom-right causal: the same about the diagonal i + skv - sq (generation with a KV cache).
The window becomes window_size=(left, 0) on the causal mask type (Transformer Engine aligns it with the mask's
diagonal), and with right padding the rows past end_b + left, which see no key through the window, leave their
sequence (the engines return 0 there, as SDPA does).
The call then becomes lengths (and offsets) in Transformer Engine's terms, exact on every row:
- right padding (start_b = 0): bshd with cu_seqlens, every query row real (q length sq): 'padding' (row i sees
  the first end_b keys), 'padding_causal' (top-left: j <= i and j < end_b, so a padded row sees every real key,
  as SDPA's does). The query and key lengths then differ per sequence, which the flash engines' top-left
  alignment check refuses (they align the diagonal bottom-right); cuDNN and the unfused engine take it.
- keys starting at start_b > 0 (left padding): thd views of the dense tensors with cu_seqlens_*_padded offsets
  (`PaddingLayout.thd`): keys [start_b, end_b) of row b, and for a diagonal the query rows from the first that sees
  a key; rows before it are left out of every sequence, so the engines return 0 there (SDPA's fully masked rows).
  Bottom-right: the query rows [a_b, sq) with a_b = max(0, start_b - (skv - sq)), 'padding_causal_bottom_right'
  (kv' <= q' + len_kv - len_q is j <= i + skv - sq whatever a_b is), valid when end_b = skv; top-left: rows
  [start_b, sq), 'padding_causal'. Only the cuDNN frontend (thd with gaps, pad_between_seqs) and the unfused engine
  take such offsets; every flash table refuses pad_between_seqs, with its reason.
Anything else (a mask that differs per head, keys that are not one range, a bottom-right diagonal with right
padding and sq < skv, which no TE mask type aligns, a batch element that sees no key at all) stays 'arbitrary', and
`why` says so.

Recognition runs a few reductions over the mask on its device and reads back one small tensor (one host sync),
once per mask tensor and version (cached on the tensor, as every content check is).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tensor_cache import cached_on, remember_values


@dataclass(frozen=True)
class PaddingLayout:
    """A recognised padding pattern in Transformer Engine's terms. For thd, the rows of the dense [b, s, h, d]
    tensors flattened to [b * s, h, d] and the first `q_skip` / `kv_skip` rows dropped (so that offsets start at
    0, as cu_seqlens_*_padded must): sequence i's queries start at cu_seqlens_q_padded[i] of that view."""

    mask_type: str
    cu_seqlens_q: torch.Tensor | None = None   # int32 [b + 1], query rows per sequence (None: no padding at all)
    cu_seqlens_kv: torch.Tensor | None = None  # int32 [b + 1], keys per sequence
    cu_seqlens_q_padded: torch.Tensor | None = None  # thd with gaps between sequences only
    cu_seqlens_kv_padded: torch.Tensor | None = None
    q_skip: int = 0
    kv_skip: int = 0
    thd_view: bool = False  # run as thd views of the rows (else bshd with cu_seqlens)
    window: tuple[int, int] | None = None  # a causal mask's sliding window (left, 0); None: unbounded

    @property
    def thd(self) -> bool:
        return self.thd_view

    def describe(self) -> str:
        kind = f"{self.mask_type!r}" + (f" with window_size={self.window}" if self.window else "")
        if self.cu_seqlens_q is None:
            return f"{kind} (no padding)"
        text = (f"{kind} with query lengths {self.cu_seqlens_q.diff().tolist()} and key lengths "
                f"{self.cu_seqlens_kv.diff().tolist()}")
        if self.cu_seqlens_q_padded is not None:
            text += (f", as thd views of the rows with offsets (queries at {self.cu_seqlens_q_padded.tolist()} + "
                     f"{self.q_skip}, keys at {self.cu_seqlens_kv_padded.tolist()} + {self.kv_skip})")
        elif self.thd:
            text += (f", as thd views of the rows from query row {self.q_skip} and key row {self.kv_skip} on "
                     "(back to back)")
        return text


@dataclass(frozen=True)
class NotRecognised:
    """Why a bool mask stays 'arbitrary'."""

    why: str


def recognise_padding(mask: torch.Tensor, mask4: torch.Tensor, b: int, sq: int, skv: int
                      ) -> PaddingLayout | NotRecognised:
    """The layout a [1|b, 1|h, sq, skv] bool view `mask4` of `mask` encodes (True = take part); cached on `mask`."""
    return cached_on((mask,), ("sdpa_padding", tuple(mask4.shape), b, sq, skv),
                      lambda: _recognise(mask4, b, sq, skv))


def _recognise(mask4: torch.Tensor, b: int, sq: int, skv: int) -> PaddingLayout | NotRecognised:
    if mask4.shape[0] > 1 and mask4.stride(0) == 0:
        mask4 = mask4[:1]  # one mask expanded over the batch (transformers' masks often are): looked at once
    per_head = mask4.shape[1] > 1
    m = mask4[:, 0]  # [B, sq, skv], B = 1 or b
    stats = _row_stats(m, sq, skv)
    if per_head:  # a mask materialised per head may still be one pattern for all of them
        same = torch.eq(mask4, mask4[:, :1]).all().view(1, 1).expand(stats.shape[0], 1)
        stats = torch.cat([stats, same.to(stats.dtype)], dim=1)
    rows = stats.tolist()  # the one host sync
    if per_head and not all(r[-1] for r in rows):
        return NotRecognised("the mask differs between heads (Transformer Engine's mask types are shared by heads)")
    starts, ends = [r[0] for r in rows], [r[1] for r in rows]
    keys, top_left, bottom_right = (all(r[n] for r in rows) for n in (2, 3, 5))
    windows = {"top_left": rows[0][4], "bottom_right": rows[0][6]}  # -1: no window (the same for every element)
    if len(rows) == 1:
        starts, ends = starts * b, ends * b
    empty = [i for i, (s, e) in enumerate(zip(starts, ends)) if e <= s]
    if empty:
        return NotRecognised(f"batch element {empty[0]} attends to no key at all")
    if not (keys or top_left or bottom_right):
        return NotRecognised("the mask is not a padding pattern: in some batch element the keys a row sees are not "
                             "one range [start, end) cut by a causal diagonal (and a sliding window) at most")
    device = mask4.device
    if keys:
        return _layout("padding", b, sq, skv, [0] * b, [sq] * b, starts, ends, None, device)
    if top_left:
        left = windows["top_left"]
        # rows past end + left see no key through the window: left out of their sequence (0, as SDPA's)
        q_ends = [min(sq, e + left) if left >= 0 else sq for e in ends]
        return _layout("padding_causal", b, sq, skv, starts, q_ends, starts, ends, left, device)
    shift, left = skv - sq, windows["bottom_right"]  # bottom-right: row i sees keys up to i + shift
    if all(s >= shift for s in starts):  # top-left from the first row that sees a key
        q_ends = [min(sq, e + left - shift) if left >= 0 else sq for e in ends]
        return _layout("padding_causal", b, sq, skv, [s - shift for s in starts], q_ends, starts, ends, left, device)
    if all(e == skv for e in ends):
        return _layout("padding_causal_bottom_right", b, sq, skv, [max(0, s - shift) for s in starts], [sq] * b,
                       starts, ends, left, device)
    return NotRecognised(f"a bottom-right causal mask (sq={sq} < skv={skv}) with keys cut at the end (right "
                         "padding): no Transformer Engine mask type aligns that diagonal")


def _row_stats(m: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """int64 [B, 7] per batch element: start, end of the keys any row sees; whether the mask is exactly key padding
    over that range; whether it is the top-left causal pattern over it and its window (-1: none); the same for
    bottom-right. A window's size is read from the rows it cuts, the largest over the batch, then checked."""
    u = m.view(torch.uint8) if m.dtype == torch.bool else m.to(torch.uint8)
    count = m.sum(-1)                                          # [B, sq]
    has = count > 0
    first = u.argmax(-1)                                       # first key each row sees (0 for an empty row)
    last = (skv - 1) - u.flip(-1).argmax(-1)                   # last key each row sees
    interval = ~has | (count == last - first + 1)              # the row's keys are one range
    start = torch.where(has, first, skv).amin(-1, keepdim=True)  # [B, 1]
    end = torch.where(has, last + 1, 0).amax(-1, keepdim=True)
    row = torch.arange(sq, device=m.device).view(1, sq)
    ok = interval.all(-1)

    def matches(diagonal: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if diagonal is None:
            want_first, want_last, left = start, end - 1, torch.full_like(start[:, 0], -1)
        else:
            cut = has & (first > start)  # rows a window cuts: the window reaches diagonal - first keys back
            left = torch.where(cut, diagonal - first, -1).amax().expand(start.shape[0])
            want_first = torch.where(left[:, None] >= 0, torch.maximum(start, diagonal - left[:, None]), start)
            want_last = torch.minimum(end - 1, diagonal)
        want_has = want_last >= want_first
        row_ok = (has == want_has) & (~has | ((first == want_first) & (last == want_last)))
        return ok & row_ok.all(-1), left

    keys, _ = matches(None)
    top_left, left_tl = matches(row)
    bottom_right, left_br = matches(row + (skv - sq))
    return torch.stack([start[:, 0], end[:, 0], keys, top_left, left_tl, bottom_right, left_br], dim=1).long()


def _layout(mask_type: str, b: int, sq: int, skv: int, q_starts: list[int], q_ends: list[int],
            kv_starts: list[int], kv_ends: list[int], window_left: int | None, device: torch.device
            ) -> PaddingLayout:
    """Queries are the rows [q_start, q_end), keys [kv_start, kv_end) of each batch element; a causal mask's
    sliding window keeps window_left keys before the diagonal (None or -1: unbounded)."""
    window = (window_left, 0) if window_left is not None and window_left >= 0 else None
    if not any(q_starts) and all(e == sq for e in q_ends) and not any(kv_starts) and all(e == skv for e in kv_ends):
        return PaddingLayout(_UNPADDED[mask_type], window=window)  # every row and key: no lengths needed
    q_lens = [e - s for s, e in zip(q_starts, q_ends)]
    kv_lens = [e - s for s, e in zip(kv_starts, kv_ends)]
    cu_q, cu_kv = _running(q_lens), _running(kv_lens)
    if not any(q_starts) and not any(kv_starts):
        return PaddingLayout(mask_type, *_tensors(device, cu_q, cu_kv), window=window)
    q_skip, kv_skip = q_starts[0], kv_starts[0]
    q_offsets = [i * sq + s - q_skip for i, s in enumerate(q_starts)] + [b * sq - q_skip]
    kv_offsets = [i * skv + s - kv_skip for i, s in enumerate(kv_starts)] + [b * skv - kv_skip]
    if q_offsets == cu_q and kv_offsets == cu_kv:
        # back to back once the first rows are dropped (only the first sequence padded): plain thd, no gaps
        return PaddingLayout(mask_type, *_tensors(device, cu_q, cu_kv), None, None, q_skip, kv_skip, thd_view=True,
                             window=window)
    return PaddingLayout(mask_type, *_tensors(device, cu_q, cu_kv, q_offsets, kv_offsets), q_skip, kv_skip,
                         thd_view=True, window=window)


_UNPADDED = {"padding": "no_mask", "padding_causal": "causal", "padding_causal_bottom_right": "causal_bottom_right"}


def _running(lengths: list[int]) -> list[int]:
    total, out = 0, [0]
    for n in lengths:
        total += n
        out.append(total)
    return out


def _tensors(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """int32 tensors on the device, one copy for all of them (views of one buffer)."""
    flat = torch.tensor([x for values in lists for x in values], dtype=torch.int32).to(device)
    views = list(flat.split([len(values) for values in lists]))
    for view, values in zip(views, lists):  # their values are known here: validation need not read them back
        remember_values(view, values)
    return views
