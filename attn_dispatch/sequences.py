"""Sequence facts of a call (SeqInfo): lengths from cu_seqlens or a padding mask, validated and read back to the
host once per tensor and version (tensor_cache), so a cu_seqlens tensor shared by every layer is read once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .backends.base import PackedFacts
from .call_args import CallArgs
from .params import SeqLengths, has_padding, keyless_rows, packed_fields
from .tensor_cache import cached_on, known_values, same_values
from .validation import positive_int, show_values


@dataclass
class SeqInfo:
    """Sequence facts of one call, after validation."""

    cu_q: torch.Tensor | None
    cu_kv: torch.Tensor | None
    cu_q_padded: torch.Tensor | None
    cu_kv_padded: torch.Tensor | None
    max_q: int
    max_kv: int
    batch: int
    pad_between_seqs: bool
    lengths_differ: bool = False  # some sequence has a different number of query and key tokens
    # thd, from the validated values: each sequence's (query, key) tokens, for a policy that times the call
    lengths: SeqLengths | None = None
    # thd only, from the validated values: where each side's sequences end (cu_seqlens[-1]; None where not known
    # on the host, or where padded offsets put gaps between them), the smallest (keys - queries) of a sequence
    # with queries, and whether one has no keys
    end_q: int | None = None
    end_kv: int | None = None
    min_kv_minus_q: int = 0
    queries_without_keys: bool = False
    facts: dict = field(default_factory=dict)  # (mask type, window) -> PackedFacts, made once (packed_facts)
    # thd: AttentionParams.packed_fill, packed_token_fill and packed_window_fill (bucketed), from the lengths read
    # above; None elsewhere
    fill: float | None = None
    token_fill: float | None = None
    window_fill: float | None = None

    def plan_key(self) -> tuple:
        """The sequence facts a decision reads (build_params puts exactly these into AttentionParams)."""
        return self.batch, self.max_q, self.max_kv, self.pad_between_seqs, self.lengths_differ, self.fill, \
            self.token_fill, self.window_fill


# ------------------------------------------------------------------------------------------------
# Content checks, cached on the tensor
# ------------------------------------------------------------------------------------------------
def _cu_values(name: str, cu: Any, batch: int | None, device: torch.device) -> list[int]:
    """Type, dtype, shape, device and the cumulative-sum shape of a cu_seqlens tensor; its values."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch.int32 tensor of shape [batch_size + 1]; got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} has dtype {cu.dtype}; it must be torch.int32")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} has shape {list(cu.shape)}; it must be 1-D with batch_size + 1 >= 2 entries")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries but the batch has {batch} sequences; "
                         f"it needs batch_size + 1 = {batch + 1}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but query_layer is on {device}; put it on the same device")
    values = known_values(cu)  # offsets built from host lists (a recognised mask's) are not read back
    if values is None:
        values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}={show_values(values)} must start at 0")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{name}={show_values(values)} must be non-decreasing (cumulative sequence lengths); "
                             f"it decreases at index {i} ({values[i - 1]} -> {values[i]})")
    return values


def _lengths(values: list[int]) -> list[int]:
    return [b - a for a, b in zip(values, values[1:])]


def _check_thd_side(side: str, tensor_name: str, cu: Any, cu_padded: Any, total: int, device: torch.device,
                    batch: int | None) -> list[int]:
    """Validates one side's cu_seqlens (and padded offsets) against a thd tensor; returns the sequence lengths."""
    name, name_p = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"

    def compute() -> list[int]:
        values = _cu_values(name, cu, batch, device)
        lens = _lengths(values)
        if cu_padded is None:
            if values[-1] > total:
                raise ValueError(f"{name}={show_values(values)} ends at {values[-1]} but {tensor_name} has only "
                                 f"t={total} tokens")
        else:
            padded = _cu_values(name_p, cu_padded, len(values) - 1, device)
            if padded[-1] > total:
                raise ValueError(f"{name_p}={show_values(padded)} ends at {padded[-1]} but {tensor_name} has only "
                                 f"t={total} tokens")
            for i, (n, slots) in enumerate(zip(lens, _lengths(padded))):
                if n > slots:
                    raise ValueError(f"sequence {i} has {n} tokens ({name}) but only {slots} slots in {name_p}; "
                                     f"{name_p} must leave room for each sequence")
        return lens
    return compute()


def _check_dense_cu(side: str, cu: Any, batch: int, seqlen: int, device: torch.device) -> None:
    name = f"cu_seqlens_{side}"

    def compute() -> None:
        values = _cu_values(name, cu, batch, device)
        for i, n in enumerate(_lengths(values)):
            if n > seqlen:
                raise ValueError(f"{name}={show_values(values)} gives sequence {i} {n} tokens but the tensor holds "
                                 f"only {seqlen} per sequence")
    if isinstance(cu, torch.Tensor):
        cached_on((cu,), ("dense", side, batch, seqlen), compute)
    else:
        compute()


def _padding_mask_to_cu(name: str, mask: Any, batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """A [b, 1, 1, s] padding mask (True = padding) -> int32 cu_seqlens. Padding must follow the real tokens,
    as cu_seqlens-based engines assume."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a bool tensor of shape [{batch}, 1, 1, {seqlen}]; got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} has dtype {mask.dtype}; padding masks must be torch.bool (True = padding)")
    if tuple(mask.shape) != (batch, 1, 1, seqlen):
        raise ValueError(f"{name} has shape {list(mask.shape)}; a padding mask must be [batch_size, 1, 1, seqlen] = "
                         f"[{batch}, 1, 1, {seqlen}]")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but query_layer is on {device}")

    def compute() -> torch.Tensor:
        lens = (~mask.view(batch, seqlen)).sum(dim=1)
        expected = torch.arange(seqlen, device=mask.device).view(1, seqlen) >= lens.view(batch, 1)
        if not bool(torch.equal(expected, mask.view(batch, seqlen))):
            rows = (expected != mask.view(batch, seqlen)).any(dim=1).nonzero().flatten().tolist()
            raise ValueError(f"{name}: padding must come after the real tokens of each sequence "
                             f"(True only at the end); sequences {show_values(rows)} are not padded that way")
        return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
    return cached_on((mask,), ("padding", batch, seqlen), compute)


def sequence_info(fmt: str, mask_type: str, q: torch.Tensor, k: torch.Tensor, args: CallArgs,
                  window: tuple[int, int] = (-1, -1)) -> SeqInfo:
    """The call's sequence facts from its lengths (cu_seqlens, max_seqlen, a padding attention_mask); a packed
    call's fills count its tiles under the mask and the window."""
    attention_mask, pad_between_seqs = args.attention_mask, args.pad_between_seqs
    cu_q, cu_kv, cu_q_p, cu_kv_p = args.cu_seqlens_q, args.cu_seqlens_kv, args.cu_seqlens_q_padded, \
        args.cu_seqlens_kv_padded
    max_q, max_kv = args.max_seqlen_q, args.max_seqlen_kv
    if fmt == "thd":
        tensors = tuple(t for t in (cu_q, cu_kv, cu_q_p, cu_kv_p) if t is not None)

        def compute() -> SeqInfo:
            return _thd_info(mask_type, window, q, k, attention_mask, cu_q, cu_kv, cu_q_p, cu_kv_p, max_q, max_kv,
                             pad_between_seqs)
        if attention_mask is not None or not has_padding(mask_type) or \
                not all(isinstance(t, torch.Tensor) for t in tensors):
            return compute()  # raises with the precise reason
        context = ("thd", mask_type, window, cu_q is None, cu_kv is None, cu_q_p is None, cu_kv_p is None,
                   q.shape[0], k.shape[0], q.device, max_q, max_kv, pad_between_seqs)  # the fills: mask and window
        return cached_on(tensors, context, compute)
    batch = q.shape[0] if fmt == "bshd" else q.shape[1]
    sq, skv = (q.shape[1], k.shape[1]) if fmt == "bshd" else (q.shape[0], k.shape[0])
    for name, value, actual in (("max_seqlen_q", max_q, sq), ("max_seqlen_kv", max_kv, skv)):
        if value is not None and value != actual:
            raise ValueError(f"{name}={value!r} but the {fmt} tensor's sequence dimension is {actual}; with "
                             f"qkv_format={fmt!r} leave it None or pass {actual}")
    for name, value in (("cu_seqlens_q_padded", cu_q_p), ("cu_seqlens_kv_padded", cu_kv_p)):
        if value is not None:
            raise ValueError(f"{name} is given with qkv_format={fmt!r}; padded offsets only apply to 'thd'")
    if pad_between_seqs:
        raise ValueError(f"pad_between_seqs={pad_between_seqs!r} with qkv_format={fmt!r}: it only applies to 'thd'")
    if not has_padding(mask_type):
        for name, value in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
            if value is not None:
                raise ValueError(f"{name} is given with attn_mask_type={mask_type!r}, which has no padding; use a "
                                 "padding mask type ('padding', 'padding_causal', 'padding_causal_bottom_right')")
        return SeqInfo(None, None, None, None, sq, skv, batch, False)
    if (cu_q is None) != (cu_kv is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_kv must be given together (or neither, with attention_mask)")
    if cu_q is not None:
        if attention_mask is not None:
            raise ValueError("give either attention_mask or cu_seqlens_q/cu_seqlens_kv for a padding mask, not both")
        _check_dense_cu("q", cu_q, batch, sq, q.device)
        _check_dense_cu("kv", cu_kv, batch, skv, q.device)
    elif attention_mask is None:
        raise ValueError(f"attn_mask_type={mask_type!r} with qkv_format={fmt!r} needs the sequence lengths: pass "
                         "cu_seqlens_q and cu_seqlens_kv, or attention_mask ([b, 1, 1, s] bool, True = padding; "
                         "a pair of them for cross attention)")
    elif isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError(f"attention_mask is a {type(attention_mask).__name__} of {len(attention_mask)} tensors; "
                             "a padding mask is one [b, 1, 1, s] tensor or a pair (query mask, key/value mask)")
        cu_q = _padding_mask_to_cu("attention_mask[0]", attention_mask[0], batch, sq, q.device)
        cu_kv = _padding_mask_to_cu("attention_mask[1]", attention_mask[1], batch, skv, q.device)
    else:
        if sq != skv:
            raise ValueError(f"attention_mask is a single tensor but sq={sq} != skv={skv}; for cross attention pass a "
                             "pair (query mask [b, 1, 1, sq], key/value mask [b, 1, 1, skv])")
        cu_q = cu_kv = _padding_mask_to_cu("attention_mask", attention_mask, batch, sq, q.device)
    return SeqInfo(cu_q, cu_kv, None, None, sq, skv, batch, False, _lengths_differ(cu_q, cu_kv))


def _thd_info(mask_type, window, q, k, attention_mask, cu_q, cu_kv, cu_q_p, cu_kv_p, max_q, max_kv,
              pad_between_seqs) -> SeqInfo:
    if not has_padding(mask_type):
        raise ValueError(f"attn_mask_type={mask_type!r} with qkv_format='thd': packed sequences need a padding "
                         "mask type ('padding', 'padding_causal' or 'padding_causal_bottom_right')")
    if attention_mask is not None:
        raise ValueError("attention_mask is given with qkv_format='thd'; thd takes sequence boundaries from "
                         "cu_seqlens_q/cu_seqlens_kv only")
    if cu_q is None or cu_kv is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (torch.int32, [batch_size + 1])")
    if (cu_q_p is None) != (cu_kv_p is None):
        raise ValueError("cu_seqlens_q_padded and cu_seqlens_kv_padded must be given together")
    lens_q = _check_thd_side("q", "query_layer", cu_q, cu_q_p, q.shape[0], q.device, None)
    batch = cu_q.numel() - 1
    lens_kv = _check_thd_side("kv", "key_layer", cu_kv, cu_kv_p, k.shape[0], q.device, batch)
    longest_q, longest_kv = max(lens_q), max(lens_kv)
    limits = []
    for name, value, longest in (("max_seqlen_q", max_q, longest_q), ("max_seqlen_kv", max_kv, longest_kv)):
        if value is None:
            limits.append(max(longest, 1))
            continue
        positive_int(name, value)
        if value < longest:
            side = name.rpartition("_")[2]
            raise ValueError(f"{name}={value} is smaller than the longest sequence ({longest} tokens, from "
                             f"cu_seqlens_{side}); pass {name} >= {longest} or leave it None")
        limits.append(value)
    gaps = cu_q_p is not None and not (same_values(cu_q_p, cu_q) and same_values(cu_kv_p, cu_kv))
    if pad_between_seqs is None:
        pad_between_seqs = gaps
    with_queries = [(n_q, n_kv) for n_q, n_kv in zip(lens_q, lens_kv) if n_q > 0]
    # what the profile predicts a packed call's work from; computed here, once per cu_seqlens tensor and version
    fills = packed_fields(tuple(lens_q), tuple(lens_kv), limits[0], limits[1], mask_type, window)
    return SeqInfo(cu_q, cu_kv, cu_q_p, cu_kv_p, limits[0], limits[1], batch, bool(pad_between_seqs),
                   _lengths_differ(cu_q, cu_kv), end_q=None if gaps else sum(lens_q),
                   end_kv=None if gaps else sum(lens_kv),
                   min_kv_minus_q=min((n_kv - n_q for n_q, n_kv in with_queries), default=0),
                   queries_without_keys=any(n_kv == 0 for _, n_kv in with_queries),
                   lengths=(tuple(lens_q), tuple(lens_kv)), fill=fills["packed_fill"],
                   token_fill=fills["packed_token_fill"], window_fill=fills["packed_window_fill"])


def _lengths_differ(cu_q: torch.Tensor, cu_kv: torch.Tensor) -> bool:
    """Validated cu_seqlens (both start at 0) give some sequence different query and key lengths; cached."""
    return not same_values(cu_q, cu_kv)


def packed_facts(seq: SeqInfo, mask_type: str, window: tuple[int, int]) -> PackedFacts | None:
    """The thd host facts the engines take (AttnAux.packed); None where the lengths were not read on the host or
    the sequences are not packed back to back."""
    if seq.end_q is None or seq.end_kv is None:
        return None
    facts = seq.facts.get((mask_type, window))
    if facts is None:
        facts = seq.facts[(mask_type, window)] = PackedFacts(
            seq.end_q, seq.end_kv, keyless_rows(mask_type, window, seq.min_kv_minus_q, seq.queries_without_keys))
    return facts
