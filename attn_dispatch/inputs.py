"""From DotProductAttention's arguments to what selection and the engines take: AttentionParams (the
question), AttnConfig (static engine config) and AttnAux (per-call tensors), with every bad input
reported as a ValueError that names the argument, its value and what is allowed.

The hot path (module.py): a call's raw static facts (shapes, dtypes, flags) key an Entry; the first call
with a signature validates everything, builds AttentionParams, selects and caches a Plan. Later calls only
re-check tensor *contents* (cu_seqlens, padding masks), and those checks are cached on the tensor itself
(weak reference + version counter), so a cu_seqlens tensor shared by every layer is read back once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .backends import ENGINE_CLASSES, EngineUnavailableError, get_engine
from .backends.base import AttnAux, AttnConfig, Engine, PackedFacts
from .decision import Decision
from .env import PRIVATE_TORCH
from .freshness import current_stamp
from . import selection
from .params import (BIAS_TYPES, MASK_TYPES, AttentionParams, SeqLengths, has_padding,
                     keyless_rows, normalize_window)
from .tensor_cache import cached_on, same_values

if TYPE_CHECKING:
    from .call_args import CallArgs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHOW = 8  # list elements shown in error messages


def _show(values: list[int]) -> str:
    if len(values) <= _SHOW:
        return str(values)
    return f"[{', '.join(map(str, values[:_SHOW]))}, ...] ({len(values)} values)"


def normalize_mask_type(value: Any, name: str = "attn_mask_type") -> str:
    """Transformer Engine spellings: 'padding,causal' and 'causal_padding' mean 'padding_causal'."""
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} must be a string; expected one of {', '.join(MASK_TYPES)}")
    mask_type = value.replace(",", "_")
    if mask_type == "causal_padding":
        mask_type = "padding_causal"
    if mask_type not in MASK_TYPES:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {', '.join(MASK_TYPES)}")
    return mask_type


def check_window(window: Any, mask_type: str, name: str = "window_size") -> tuple[int, int]:
    """(left, right) with -1 unbounded; causal masks need right in (0, -1) and get right = 0."""
    if window is not None and not isinstance(window, (tuple, list)):
        raise ValueError(f"{name}={window!r} must be None or a pair (left, right) of ints >= -1")
    try:
        return normalize_window(None if window is None else tuple(window), mask_type)
    except ValueError as exc:
        raise ValueError(str(exc).replace("window_size=", f"{name}=", 1)) from None


@dataclass(frozen=True)
class ModuleSpec:
    """What the module's constructor fixed: the per-partition heads and dims, softmax, dropout."""

    num_heads: int
    num_gqa_groups: int
    head_dim_qk: int
    head_dim_v: int
    softmax_scale: float
    attention_dropout: float
    softmax_type: str
    return_max_logit: bool
    attention_type: str
    deterministic: bool
    cp_comm_type: str
    backend: str | None  # forced provider ('family' or 'family:provider'), our extension
    softcap: float = 0.0  # logit soft-capping, our extension
    policy: str | None = None  # the selection policy's name; None: ATTN_DISPATCH_POLICY's


@dataclass
class Plan:
    """Everything fixed for one call signature."""

    params: AttentionParams
    decision: Decision
    engine: Engine
    cfg: AttnConfig
    stamp: tuple = ()  # freshness.current_stamp() when made: the plan stands while the current stamp equals it


# Plans one call signature keeps for thd/padding calls (one per sequence count and longest-sequence pair seen);
# beyond it the least recently used is dropped, so that a stream of packed batches cannot grow them without bound.
MAX_DYNAMIC_PLANS = 64


@dataclass
class Entry:
    """What one raw call signature resolved to. Sequence facts that depend on tensor contents (thd, padding
    masks) are 'dynamic': re-derived per call, with one Plan per SeqInfo.plan_key (every sequence fact that
    AttentionParams holds: the number of sequences, the longest on each side, gaps, differing lengths)."""

    fmt: str
    mask_type: str
    window: tuple[int, int]
    dynamic: bool
    seq: "SeqInfo | None" = None
    plans: dict = field(default_factory=dict)


@dataclass
class FastHit:
    """A validated plan for calls passing only q, k, v; aux is shared by those calls (None: built per call)."""

    plan: Plan
    aux: AttnAux | None
    max_q: int
    max_kv: int
    guard: Callable[..., bool] | None = None  # tensor_guard of the q, k, v that were validated
    call: Callable[..., Any] | None = None  # the engine's bind_fast for them: (q, k, v) -> out, under the guard
    # For the SDPA function: (guard, call) on its [b, h, s, d] tensors (bind_fast(layout="bhsd")), bound on the
    # plan's second use; None: not yet asked; False: the engine binds none.
    bhsd: Any = None


def tensor_guard(*tensors: torch.Tensor) -> Callable[..., bool] | None:
    """A check that later tensors match these in dtype, device, shape, strides and requires_grad, done in C++
    by one call (the tensor guard torch.compile uses; ~0.8 us for q, k, v where reading those attributes from
    Python costs ~2 us). None where this torch lays it out otherwise: callers then compare Python keys."""
    if _TensorGuards is None:
        return None
    try:
        guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return guard.check
    except Exception:  # noqa: BLE001 - a private API: any surprise means "not available"
        return None


def _load_tensor_guards() -> Any:
    """torch._C._dynamo.guards.TensorGuards if it behaves as expected here (checked once on tiny tensors)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        a, b = torch.zeros(2, 3), torch.zeros(3, 2)
        guard = TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [3, 2]], dynamic_dims_strides=[[3, 1], [2, 1]])
        ok = (guard.check(torch.ones(2, 3), torch.ones(3, 2)) and not guard.check(torch.ones(3, 2), b)
              and not guard.check(a, b.double()) and not guard.check(a.t().contiguous().t(), b)
              and not guard.check(a.requires_grad_(), b) and not guard.check("a", b))
        return TensorGuards if ok else None
    except Exception:  # noqa: BLE001
        return None


_TensorGuards = _load_tensor_guards() if PRIVATE_TORCH else None


def arg_signature(x: Any, grad: bool = False) -> Any:
    """A hashable summary of an optional tensor argument (or a pair of them); the type for anything else,
    which validation then rejects."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype, x.device, x.requires_grad) if grad else (x.shape, x.dtype, x.device)
    if isinstance(x, (tuple, list)):
        return tuple(arg_signature(e) for e in x)
    return type(x)


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

    def plan_key(self) -> tuple:
        """The sequence facts a decision reads (build_params puts exactly these into AttentionParams)."""
        return self.batch, self.max_q, self.max_kv, self.pad_between_seqs, self.lengths_differ


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
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}={_show(values)} must start at 0")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{name}={_show(values)} must be non-decreasing (cumulative sequence lengths); "
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
                raise ValueError(f"{name}={_show(values)} ends at {values[-1]} but {tensor_name} has only "
                                 f"t={total} tokens")
        else:
            padded = _cu_values(name_p, cu_padded, len(values) - 1, device)
            if padded[-1] > total:
                raise ValueError(f"{name_p}={_show(padded)} ends at {padded[-1]} but {tensor_name} has only "
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
                raise ValueError(f"{name}={_show(values)} gives sequence {i} {n} tokens but the tensor holds only "
                                 f"{seqlen} per sequence")
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
                             f"(True only at the end); sequences {_show(rows)} are not padded that way")
        return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
    return cached_on((mask,), ("padding", batch, seqlen), compute)


# ------------------------------------------------------------------------------------------------
# Sequences
# ------------------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def sequence_info(fmt: str, mask_type: str, q: torch.Tensor, k: torch.Tensor, args: CallArgs) -> SeqInfo:
    """The call's sequence facts from its lengths (cu_seqlens, max_seqlen, a padding attention_mask)."""
    attention_mask, pad_between_seqs = args.attention_mask, args.pad_between_seqs
    cu_q, cu_kv, cu_q_p, cu_kv_p = args.cu_seqlens_q, args.cu_seqlens_kv, args.cu_seqlens_q_padded, \
        args.cu_seqlens_kv_padded
    max_q, max_kv = args.max_seqlen_q, args.max_seqlen_kv
    if fmt == "thd":
        tensors = tuple(t for t in (cu_q, cu_kv, cu_q_p, cu_kv_p) if t is not None)

        def compute() -> SeqInfo:
            return _thd_info(mask_type, q, k, attention_mask, cu_q, cu_kv, cu_q_p, cu_kv_p, max_q, max_kv,
                             pad_between_seqs)
        if attention_mask is not None or not has_padding(mask_type) or \
                not all(isinstance(t, torch.Tensor) for t in tensors):
            return compute()  # raises with the precise reason
        context = ("thd", cu_q is None, cu_kv is None, cu_q_p is None, cu_kv_p is None, q.shape[0], k.shape[0],
                   q.device, max_q, max_kv, pad_between_seqs)
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


def _thd_info(mask_type, q, k, attention_mask, cu_q, cu_kv, cu_q_p, cu_kv_p, max_q, max_kv,
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
        _positive_int(name, value)
        if value < longest:
            side = name.rpartition("_")[2]
            raise ValueError(f"{name}={value} is smaller than the longest sequence ({longest} tokens, from "
                             f"cu_seqlens_{side}); pass {name} >= {longest} or leave it None")
        limits.append(value)
    gaps = cu_q_p is not None and not (same_values(cu_q_p, cu_q) and same_values(cu_kv_p, cu_kv))
    if pad_between_seqs is None:
        pad_between_seqs = gaps
    with_queries = [(n_q, n_kv) for n_q, n_kv in zip(lens_q, lens_kv) if n_q > 0]
    return SeqInfo(cu_q, cu_kv, cu_q_p, cu_kv_p, limits[0], limits[1], batch, bool(pad_between_seqs),
                   _lengths_differ(cu_q, cu_kv), end_q=None if gaps else sum(lens_q),
                   end_kv=None if gaps else sum(lens_kv),
                   min_kv_minus_q=min((n_kv - n_q for n_q, n_kv in with_queries), default=0),
                   queries_without_keys=any(n_kv == 0 for _, n_kv in with_queries),
                   lengths=(tuple(lens_q), tuple(lens_kv)))


def _lengths_differ(cu_q: torch.Tensor, cu_kv: torch.Tensor) -> bool:
    """Validated cu_seqlens (both start at 0) give some sequence different query and key lengths; cached."""
    return not same_values(cu_q, cu_kv)


# ------------------------------------------------------------------------------------------------
# Static checks (first call of a signature)
# ------------------------------------------------------------------------------------------------
def check_qkv(spec: ModuleSpec, fmt: str, q: Any, k: Any, v: Any) -> None:
    names = ("query_layer", "key_layer", "value_layer")
    rank = 3 if fmt == "thd" else 4
    layout = {"bshd": "[b, s, h, d]", "sbhd": "[s, b, h, d]", "thd": "[t, h, d]"}[fmt]
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name} has shape {list(x.shape)}; qkv_format={fmt!r} needs {rank}-D {layout}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; expected one of float16, bfloat16, float32, float64")
    for name, x in zip(names[1:], (k, v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but query_layer has {q.dtype}; q, k and v must share a dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but query_layer is on {q.device}; put q, k, v on one device")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"key_layer {list(k.shape)} and value_layer {list(v.shape)} must agree in every dim but "
                         "the head dim")
    if fmt != "thd":
        bdim = 0 if fmt == "bshd" else 1
        if q.shape[bdim] != k.shape[bdim]:
            raise ValueError(f"query_layer {list(q.shape)} and key_layer {list(k.shape)} have different batch sizes "
                             f"({q.shape[bdim]} vs {k.shape[bdim]}) in qkv_format={fmt!r}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hq != spec.num_heads:
        raise ValueError(f"query_layer has {hq} heads; this module was built for num_attention_heads / tp_size = "
                         f"{spec.num_heads}")
    if hk != spec.num_gqa_groups:
        raise ValueError(f"key_layer/value_layer have {hk} heads; this module was built for num_gqa_groups / tp_size "
                         f"= {spec.num_gqa_groups}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) are not divisible by key/value heads ({hk})")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query_layer head dim {q.shape[-1]} != key_layer head dim {k.shape[-1]}; they must match")
    if q.shape[-1] != spec.head_dim_qk or v.shape[-1] != spec.head_dim_v:
        raise ValueError(f"head dims (qk={q.shape[-1]}, v={v.shape[-1]}) do not match kv_channels "
                         f"(qk={spec.head_dim_qk}, v={spec.head_dim_v})")


def bias_shape_label(bias: Any, batch: int, heads: int, sq: int, skv: int) -> str:
    """Transformer Engine's bias shape names, detected in its order (bhss before 1hss when b == 1)."""
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"core_attention_bias must be a tensor of shape [1|b, 1|h, sq, skv]; got "
                         f"{type(bias).__name__}")
    expected = f"[1 or {batch}, 1 or {heads}, {sq}, {skv}] (shapes 1hss, b1ss, bhss, 11ss)"
    if bias.dim() != 4 or tuple(bias.shape[2:]) != (sq, skv):
        raise ValueError(f"core_attention_bias has shape {list(bias.shape)}; expected {expected}")
    b, h = bias.shape[0], bias.shape[1]
    for label, ok in (("bhss", b == batch and h == heads), ("1hss", b == 1 and h == heads),
                      ("b1ss", b == batch and h == 1), ("11ss", b == 1 and h == 1)):
        if ok:
            return label
    raise ValueError(f"core_attention_bias has shape {list(bias.shape)}; expected {expected}")


def check_bias(bias_type: str, bias: Any, alibi_slopes: Any, q: torch.Tensor, batch: int, sq: int,
               skv: int) -> tuple[str | None, str | None]:
    """Returns (bias_shape, alibi_slopes_shape) labels."""
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"core_attention_bias_type={bias_type!r} is not supported; expected one of "
                         f"{', '.join(BIAS_TYPES)}")
    heads = q.shape[-2]
    bias_shape = alibi_shape = None
    if bias_type in ("pre_scale_bias", "post_scale_bias"):
        if bias is None:
            raise ValueError(f"core_attention_bias_type={bias_type!r} needs core_attention_bias [1|b, 1|h, sq, skv]")
        bias_shape = bias_shape_label(bias, batch, heads, sq, skv)
        if bias.dtype not in FLOAT_DTYPES:
            raise ValueError(f"core_attention_bias has dtype {bias.dtype}; it must be a float dtype")
        if bias.device != q.device:
            raise ValueError(f"core_attention_bias is on {bias.device} but query_layer is on {q.device}")
    elif bias is not None:
        raise ValueError(f"core_attention_bias is given with core_attention_bias_type={bias_type!r}; set the type to "
                         "'pre_scale_bias' or 'post_scale_bias', or drop the tensor")
    if alibi_slopes is not None:
        if bias_type != "alibi":
            raise ValueError(f"alibi_slopes is given with core_attention_bias_type={bias_type!r}; it needs 'alibi'")
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype not in FLOAT_DTYPES:
            raise ValueError(f"alibi_slopes must be a float32 tensor of shape [{heads}] or [{batch}, {heads}]")
        if tuple(alibi_slopes.shape) == (heads,):
            alibi_shape = "h"
        elif tuple(alibi_slopes.shape) == (batch, heads):
            alibi_shape = "bh"
        else:
            raise ValueError(f"alibi_slopes has shape {list(alibi_slopes.shape)}; expected [{heads}] or "
                             f"[{batch}, {heads}]")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but query_layer is on {q.device}")
    elif bias_type == "alibi":
        alibi_shape = "h"
    return bias_shape, alibi_shape


def check_attention_mask(mask_type: str, mask: Any, q: torch.Tensor, batch: int, sq: int, skv: int) -> None:
    """'arbitrary' needs a bool mask broadcastable to [b, h, sq, skv]; no_mask/causal take none."""
    if mask_type == "arbitrary":
        heads = q.shape[-2]
        expected = f"[1 or {batch}, 1 or {heads}, {sq}, {skv}]"
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"attn_mask_type='arbitrary' needs attention_mask, a bool tensor {expected} "
                             "(True = masked out)")
        if mask.dtype != torch.bool:
            raise ValueError(f"attention_mask has dtype {mask.dtype}; it must be torch.bool (True = masked out)")
        if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads) or \
                tuple(mask.shape[2:]) != (sq, skv):
            raise ValueError(f"attention_mask has shape {list(mask.shape)}; 'arbitrary' needs {expected}")
        if mask.device != q.device:
            raise ValueError(f"attention_mask is on {mask.device} but query_layer is on {q.device}")
    elif not has_padding(mask_type) and mask is not None:
        raise ValueError(f"attention_mask is given with attn_mask_type={mask_type!r}, which takes none; use "
                         "'arbitrary' for a custom mask or a padding type for padding masks")


# ------------------------------------------------------------------------------------------------
# The builder the module uses
# ------------------------------------------------------------------------------------------------
def default_alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's geometric slopes, as Transformer Engine's get_alibi computes them when none are given."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (num_heads - n), 2))
        slopes = torch.cat([slopes, extra])
    return slopes.to(torch.float32)


def build_params(spec: ModuleSpec, fmt: str, mask_type: str, window: tuple[int, int], q, k, v, seq: SeqInfo,
                 args: CallArgs, training: bool) -> AttentionParams:
    """Validates the static facts of a call and describes it."""
    bias_type, bias, alibi_slopes = args.core_attention_bias_type, args.core_attention_bias, args.alibi_slopes
    attention_mask = args.attention_mask
    check_qkv(spec, fmt, q, k, v)
    check_attention_mask(mask_type, attention_mask, q, seq.batch, seq.max_q, seq.max_kv)
    bias_shape, alibi_shape = check_bias(bias_type, bias, alibi_slopes, q, seq.batch, seq.max_q, seq.max_kv)
    return AttentionParams(
        dtype=q.dtype, qkv_format=fmt, batch_size=seq.batch, num_heads=q.shape[-2], num_gqa_groups=k.shape[-2],
        head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=seq.max_q, max_seqlen_kv=seq.max_kv,
        attn_mask_type=mask_type, window_size=window, bias_type=bias_type, bias_shape=bias_shape,
        bias_requires_grad=bool(bias is not None and bias.requires_grad), alibi_slopes_shape=alibi_shape,
        dropout=spec.attention_dropout if training else 0.0, softmax_type=spec.softmax_type,
        return_max_logit=spec.return_max_logit, is_training=training, deterministic=spec.deterministic,
        cp_size=1, cp_comm_type=spec.cp_comm_type, pad_between_seqs=seq.pad_between_seqs,
        seqlens_differ=seq.lengths_differ,
        device_type="cuda" if q.device.type == "cuda" else q.device.type, softcap=spec.softcap,
    )


def build_config(spec: ModuleSpec, params: AttentionParams) -> AttnConfig:
    return AttnConfig(
        qkv_format=params.qkv_format, attn_mask_type=params.attn_mask_type, window_size=params.window_size,
        softmax_scale=spec.softmax_scale, dropout_p=params.dropout, bias_type=params.bias_type,
        softmax_type=params.softmax_type, deterministic=params.deterministic,
        return_max_logit=params.return_max_logit, softcap=params.softcap,
    )


def plain_params(params: AttentionParams) -> tuple[AttentionParams, tuple[str, ...]]:
    """(the params the engines run, notes on how the call was read): a window side that masks nothing at the
    call's lengths is dropped (AttentionParams.without_idle_window), so every engine of the plain mask qualifies."""
    plain = params.without_idle_window()
    if plain is params:
        return params, ()
    return plain, (f"window_size={params.window_size} masks nothing at max_seqlen_q={params.max_seqlen_q}, "
                   f"max_seqlen_kv={params.max_seqlen_kv}: run as window_size={plain.window_size}",)


def make_plan(spec: ModuleSpec, params: AttentionParams, lengths: SeqLengths | None = None) -> Plan:
    """Select and load the engine. One that fails to load (a flash-attn wheel built for another torch, say) is
    recorded (runtime_facts, which its table then reports as the reason, and which makes decisions anew), and
    selection runs again without it; a forced one raises with that reason. lengths: a packed call's own, for a
    policy that times it (SeqInfo.lengths)."""
    params, notes = plain_params(params)
    for _ in range(len(ENGINE_CLASSES) + 1):
        stamp = current_stamp()
        decision = selection.select(params, force=spec.backend, policy=spec.policy, lengths=lengths)
        try:
            engine = get_engine(decision.chosen)
        except EngineUnavailableError:  # recorded as a runtime fact: selecting again leaves it out
            continue
        selection.warn_unfused_fallback(decision)
        return Plan(params, decision.with_notes(*notes), engine, build_config(spec, params), stamp)
    raise RuntimeError(f"no engine could be loaded for {params.describe()}")


def make_aux(seq: SeqInfo, mask_type: str, attention_mask: Any, bias: Any, alibi_slopes: Any,
             softmax_offset: torch.Tensor | None, window: tuple[int, int] | None = None) -> AttnAux:
    """window: the call's normalised window, for the thd host facts (AttnAux.packed); None leaves them unknown."""
    return AttnAux(
        cu_seqlens_q=seq.cu_q, cu_seqlens_kv=seq.cu_kv, cu_seqlens_q_padded=seq.cu_q_padded,
        cu_seqlens_kv_padded=seq.cu_kv_padded, max_seqlen_q=seq.max_q, max_seqlen_kv=seq.max_kv,
        attention_mask=attention_mask if mask_type == "arbitrary" else None, bias=bias,
        alibi_slopes=alibi_slopes, softmax_offset=softmax_offset,
        packed=None if window is None else packed_facts(seq, mask_type, window),
    )


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



__all__ = ["Entry", "FastHit", "ModuleSpec", "Plan", "SeqInfo", "arg_signature", "bias_shape_label", "build_config",
           "build_params", "check_window", "default_alibi_slopes", "keyless_rows", "make_aux", "make_plan",
           "normalize_mask_type", "packed_facts", "plain_params", "sequence_info"]
