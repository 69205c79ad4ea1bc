"""torch's memory-efficient SDPA kernels (mem_efficient:torch): aten::_scaled_dot_product_efficient_attention, the op
F.scaled_dot_product_attention itself calls for a masked call, with its C++ autograd (the same kernels, backward and
host path as SDPA's own call).

Everything that is not the op's own is_causal (top-left) becomes one additive bias [B', H', sq, skv] (B', H' 1 where
it broadcasts), as SDPA's convert_boolean_attn_mask does for a bool mask: an 'arbitrary' mask (0 / -inf), padding
masks from cu_seqlens (with their per-sequence diagonal), a bottom-right diagonal where sq != skv, ALiBi. That part is
built once per tensor and version (and dropped with the tensor); a call's own bias tensor is added per call, so its
gradient flows through autograd. Rows that see no key get a zero bias row for the kernel, then output 0 and lse -inf
(the engine convention; the kernel alone would divide by zero there).

GQA: the op takes as many key/value heads as query heads. A one-query call (a decode step) without the op's own
causal diagonal folds each group's query heads into query rows of its key/value head ([b, h, 1, d] -> [b, h_kv,
h / h_kv, d], a view; the bias's rows broadcast), as transformers' SDPA path does for decode steps: no copy of the
keys and values, and the output goes back to head order in the one pass that also zeroes rows without keys. Other
GQA calls repeat the keys and values per group (the copy SDPA's math path makes too). Without gradients the lse is
not computed (no caller reads it then), and rows without keys are cleared in place. Under a deterministic backward
the engine's own Function runs the backward op with torch's deterministic flag set (one key split).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch

from ..params import TOP_LEFT_MASKS
from ._torch_native import torch_deterministic
from .base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult

ALIGN = 16  # bias row stride (elements) the kernels read in aligned vectors; SDPA pads rows the same way
NEG_INF = float("-inf")


def _bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.transpose(1, 2) if fmt == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(x4: torch.Tensor, fmt: str) -> torch.Tensor:
    return x4.transpose(1, 2) if fmt == "bshd" else x4.permute(2, 0, 1, 3)


class _Static(NamedTuple):
    """The call's fixed additive bias (aligned rows, None: nothing to add), whether it carries the diagonal, its
    keyless rows ([B', H', sq] bool, None: every row sees a key), a 0-d zero of the call's dtype on its device (what
    those rows' outputs become), and the views of bias and rows that calls with h_kv key/value heads hand the op
    (by h_kv, made on first use: a model's layers share one mask, so the views are made once per mask)."""

    bias: torch.Tensor | None
    is_causal: bool
    keyless: torch.Tensor | None
    zero: torch.Tensor | None = None
    views: dict | None = None


class _Views(NamedTuple):
    """What the op and the clean-up of one call read of its _Static: the bias as the op takes it (None: none), the
    keyless rows shaped for the output ([b, h, sq] or, folded, [b, h_kv, g, 1]; None: none), and whether the query
    heads fold into query rows."""

    bias: torch.Tensor | None
    rows: torch.Tensor | None
    folded: bool


def _views(static: _Static, b: int, h: int, hk: int, sq: int, skv: int, own_bias: torch.Tensor | None) -> _Views:
    """The op's view of the bias (own_bias: the call's own, added to the static part) and of the keyless rows. A
    one-query GQA call without the op's diagonal folds each group's query heads into query rows of its key/value
    head: bias [b, h, 1, skv] -> [b, h_kv, g, skv], a view (rows broadcast), so keys and values need no copy."""
    if own_bias is None and static.views is not None:
        cached = static.views.get(hk)
        if cached is not None:
            return cached
    folded = hk != h and sq == 1 and not static.is_causal
    bias = own_bias if own_bias is not None else static.bias
    if bias is not None:
        bias = bias.expand(b, h, sq, skv)
        if folded:
            bias = bias.view(b, hk, h // hk, skv)
    rows = None if static.keyless is None else static.keyless.expand(b, h, sq)
    if rows is not None and folded:
        rows = rows.reshape(b, hk, h // hk, 1)
    views = _Views(bias, rows, folded)
    if own_bias is None and static.views is not None:
        static.views[hk] = views
    return views


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """bias with rows starting on ALIGN-element boundaries (a padded copy sliced back, as SDPA's pad_bias)."""
    if bias.stride(-1) == 1 and all(s % ALIGN == 0 for s in bias.stride()[:-1]):
        return bias
    skv = bias.shape[-1]
    return torch.nn.functional.pad(bias, (0, (-skv) % ALIGN or ALIGN))[..., :skv]


def _aligned_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape` whose rows start on ALIGN-element boundaries (written in place, so never padded after)."""
    skv = shape[-1]
    return torch.zeros(*shape[:-1], skv + (-skv) % ALIGN, dtype=dtype, device=device)[..., :skv]


def _mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = masked out) -> 0 / -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, NEG_INF)


def _diagonal_bias(rel: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Causal about a diagonal: key j is kept iff rel = i + off - j >= 0."""
    return _mask_bias(rel < 0, dtype)


def _static(aux: AttnAux, cfg: AttnConfig, b: int, h: int, sq: int, skv: int, dtype: torch.dtype,
            device: torch.device) -> _Static:
    mask_type = cfg.attn_mask_type
    if mask_type == "arbitrary" and cfg.bias_type != "alibi":
        return _mask_static(aux.attention_mask, b, h, sq, skv, dtype, device)
    causal = "causal" in mask_type
    padded = mask_type.startswith("padding") and aux.cu_seqlens_q is not None
    top_left = mask_type in TOP_LEFT_MASKS
    native_causal = causal and not padded and (top_left or sq == skv)
    tensors: list[torch.Tensor] = []
    if mask_type == "arbitrary":
        if aux.attention_mask is None or aux.attention_mask.dtype != torch.bool:
            raise ValueError("attn_mask_type='arbitrary' needs aux.attention_mask, a bool tensor (True = masked out)")
        tensors.append(aux.attention_mask)
    if padded:
        tensors += [aux.cu_seqlens_q, aux.cu_seqlens_kv]
    if cfg.bias_type == "alibi":
        if aux.alibi_slopes is None:
            raise ValueError("bias_type='alibi' needs aux.alibi_slopes (float32 [h] or [b, h])")
        tensors.append(aux.alibi_slopes)
    if not tensors and not (causal and not native_causal):
        return _Static(None, native_causal, None)
    key = ("mem_efficient_bias", mask_type, cfg.bias_type, b, h, sq, skv, dtype, device)

    def build() -> _Static:
        zero = _zero(dtype, device)
        parts = []
        if mask_type == "arbitrary":
            parts.append(_mask_bias(_as_4d(aux.attention_mask, b, h, sq, skv), dtype))
        rows = torch.arange(sq, device=device).view(1, 1, sq, 1)
        cols = torch.arange(skv, device=device).view(1, 1, 1, skv)
        if padded:
            cq, ckv = aux.cu_seqlens_q.long(), aux.cu_seqlens_kv.long()
            lens_q, lens_kv = (cq[1:] - cq[:-1]).view(b, 1, 1, 1), (ckv[1:] - ckv[:-1]).view(b, 1, 1, 1)
            off = 0 if top_left else lens_kv - lens_q
            outside = (rows >= lens_q) | (cols >= lens_kv)
            if causal:
                outside = outside | (rows + off - cols < 0)
            parts.append(_mask_bias(outside, dtype))
        else:
            off = 0 if top_left else skv - sq
            if causal and not native_causal:
                parts.append(_diagonal_bias(rows + off - cols, dtype))
        if cfg.bias_type == "alibi":
            s = aux.alibi_slopes.to(device=device, dtype=torch.promote_types(dtype, torch.float32))
            slopes = s.view(1, h, 1, 1) if s.dim() == 1 else s.view(b, h, 1, 1)
            parts.append((-slopes * (rows + off - cols).abs()).to(dtype))
        bias = parts[0]
        for part in parts[1:]:
            bias = bias + part
        # rows the kernel must not see as all -inf; whether there are any is not asked (a host sync, and a mask may
        # change every step): their clearing is one elementwise pass per call
        keyless = (bias == NEG_INF).all(-1)
        bias = bias.masked_fill(keyless.unsqueeze(-1), 0.0)
        return _Static(_aligned(bias.contiguous()), native_causal, keyless, zero, {})
    return _CACHE.get(tuple(tensors), key, build)


def _mask_static(mask, b: int, h: int, sq: int, skv: int, dtype: torch.dtype, device: torch.device) -> _Static:
    """The bias of an 'arbitrary' mask alone (a decode step's), kept on the mask tensor itself per version and call
    sizes (_kept_on): every layer of a step hands the engine one mask, and one attribute read finds it (the bias
    cache's lookup by identity costs several calls), and it goes with the mask as a bias cache entry does."""
    if mask is None or mask.dtype != torch.bool:
        raise ValueError("attn_mask_type='arbitrary' needs aux.attention_mask, a bool tensor (True = masked out)")
    key = (b, h, sq, skv, dtype, device)
    kept = _kept_on(mask)
    if kept is not None:
        static = kept.get(key)
        if static is not None:
            return static
    # four kernels, written straight into aligned rows
    masked = _as_4d(mask, b, h, sq, skv)
    keyless = masked.all(-1)
    bias = _aligned_zeros(tuple(masked.shape), dtype, device).masked_fill_(masked, NEG_INF)
    static = _Static(bias.masked_fill_(keyless.unsqueeze(-1), 0.0), False, keyless, _zero(dtype, device), {})
    if kept is not None:
        kept[key] = static
    return static


def _kept_on(mask: torch.Tensor) -> dict | None:
    """What is kept on a mask tensor for its current version (emptied when it was written since): a dict on the
    tensor itself, which goes with it; None for an inference tensor (no version counter to tell a write)."""
    try:
        version = mask._version
    except RuntimeError:
        return None
    kept = getattr(mask, "_attn_dispatch_mem_efficient", None)  # (version, {what: value})
    if kept is None or kept[0] != version:
        kept = mask._attn_dispatch_mem_efficient = (version, {})
    return kept[1]


def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d zero of dtype on device (what keyless rows' outputs become), made once (not while a CUDA graph is
    captured): a decode step's new mask would otherwise make one more tensor each step. Read only."""
    zero = _ZEROS.get((dtype, device))
    if zero is None:
        zero = torch.zeros((), dtype=dtype, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # a capture's fill runs on replay
            _ZEROS[(dtype, device)] = zero
    return zero


_ZEROS: dict[tuple, torch.Tensor] = {}


class _BiasCache:
    """Built biases, keyed by the tensors they derive from (identity and version) and the call's sizes. Unlike
    tensor_cache, an entry goes when one of its tensors dies: a mask that changes every step must not keep every
    step's [b|1, h|1, sq, skv] bias alive. Size-only entries (a bottom-right diagonal) are kept LRU."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.entries: OrderedDict = OrderedDict()

    def get(self, tensors: tuple, context: tuple, build: Callable[[], _Static]) -> _Static:
        try:
            if len(tensors) == 1:  # a mask alone (every layer of a decode step asks): no generator frames
                versions, key = (tensors[0]._version,), (id(tensors[0]),) + context
            else:
                versions, key = tuple(t._version for t in tensors), tuple(map(id, tensors)) + context
        except RuntimeError:  # inference tensors carry no version: nothing can be cached safely
            return build()
        hit = self.entries.get(key)
        if hit is not None and hit[1] == versions and (hit[0][0]() is tensors[0] if len(tensors) == 1 else
                                                       all(r() is t for r, t in zip(hit[0], tensors))):
            self.entries.move_to_end(key)
            return hit[2]
        value = build()
        refs = tuple(weakref.ref(t, lambda _, key=key: self.entries.pop(key, None)) for t in tensors)
        self.entries[key] = (refs, versions, value)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)
        return value


_CACHE = _BiasCache()


def _as_4d(x: torch.Tensor, b: int, h: int, sq: int, skv: int) -> torch.Tensor:
    """A [1|b, 1|h, sq, skv] view of a mask/bias that broadcasts to the call (fewer leading dims allowed), or a
    ValueError naming its shape and what is allowed."""
    shape = x.shape
    if len(shape) == 4 and shape[2] == sq and shape[3] == skv and shape[0] in (1, b) and shape[1] in (1, h):
        return x  # what the SDPA function hands on: reshape and expand would return equal views
    expected = f"[1 or {b}, 1 or {h}, 1 or {sq}, 1 or {skv}]"
    if x.dim() > 4:
        raise ValueError(f"attention_mask has shape {list(x.shape)}; it must broadcast to {expected}")
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    if any(n not in (1, full) for n, full in zip(x4.shape, (b, h, sq, skv))):
        raise ValueError(f"attention_mask has shape {list(x.shape)}; it must broadcast to {expected}")
    return x4.expand(x4.shape[0], x4.shape[1], sq, skv)


def _own_bias(static: _Static, aux: AttnAux, cfg: AttnConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """The call's own bias tensor (autograd-tracked) plus the static part, aligned; None where the call has none."""
    if cfg.bias_type not in ("pre_scale_bias", "post_scale_bias"):
        return None
    if aux.bias is None:
        raise ValueError(f"bias_type={cfg.bias_type!r} but aux.bias is None")
    own = aux.bias.to(dtype)
    if cfg.bias_type == "pre_scale_bias":
        own = own * cfg.softmax_scale
    return _aligned(own if static.bias is None else own + static.bias)


class _State(NamedTuple):
    fmt: str
    q4: torch.Tensor
    k4: torch.Tensor      # keys/values as the op saw them (GQA: repeated, or as they are where query heads fold)
    v4: torch.Tensor
    bias: torch.Tensor | None
    out4: torch.Tensor
    lse4: torch.Tensor    # the op's lse, rows padded to 32
    seed: torch.Tensor
    offset: torch.Tensor
    is_causal: bool
    keyless: torch.Tensor | None
    folded: bool = False  # a one-query GQA call whose query heads became query rows: q4/out4 are [b, h_kv, g, d]


class MemEfficientEngine(Engine):
    family = "mem_efficient"
    provider = "torch"

    def __init__(self) -> None:
        aten = torch.ops.aten  # CUDA kernels only: the table keeps CPU calls away
        if not (hasattr(aten, "_scaled_dot_product_efficient_attention")
                and hasattr(aten, "_scaled_dot_product_efficient_attention_backward")):
            raise ImportError(f"torch {torch.__version__} has no aten::_scaled_dot_product_efficient_attention")
        # torch's generated binding where there is one: the same op, parsed ~7 us faster than through torch.ops
        # (see _torch_native._FLASH)
        self._op = getattr(torch, "_scaled_dot_product_efficient_attention", None) or \
            aten._scaled_dot_product_efficient_attention.default
        self._bwd = aten._scaled_dot_product_efficient_attention_backward.default

    def _attend(self, q, k, v, aux: AttnAux, cfg: AttnConfig, keep_state: bool, need_lse: bool = True):
        """(out in cfg's format, lse [b, h, sq] or None where not need_lse, backward state or None). need_lse=False
        only without gradients: the op's output is then cleared in place."""
        fmt = cfg.qkv_format
        if fmt not in ("bshd", "sbhd"):
            raise ValueError(f"qkv_format={fmt!r}: mem_efficient:torch takes bshd or sbhd")
        if tuple(cfg.window_size) not in ((-1, -1), (-1, 0)):
            raise ValueError(f"window_size={cfg.window_size}: mem_efficient:torch has no sliding window")
        if cfg.dropout_p > 0 and aux.dropout_generator is not None:
            raise ValueError("aux.dropout_generator: torch's memory-efficient op draws from the default CUDA "
                             "generator only")
        if fmt == "bshd":
            q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        else:
            q4, k4, v4 = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        b, h, sq, d = q4.shape
        hk, skv = k4.shape[1], k4.shape[2]
        static = _static(aux, cfg, b, h, sq, skv, q.dtype, q.device)
        bias, rows, folded = _views(static, b, h, hk, sq, skv, _own_bias(static, aux, cfg, q.dtype))
        if folded:  # query heads of a group as query rows of its key/value head: a view, no key/value copy
            q4 = q4.reshape(b, hk, h // hk, d)
        elif hk != h:  # the op takes one key/value head per query head
            k4, v4 = (x.repeat_interleave(h // hk, dim=1) for x in (k4, v4))
        out4, lse4, seed, offset = self._op(q4, k4, v4, bias, need_lse, float(cfg.dropout_p), static.is_causal,
                                            scale=cfg.softmax_scale)
        state = _State(fmt, q4, k4, v4, bias, out4, lse4, seed, offset, static.is_causal, static.keyless, folded) \
            if keep_state else None
        lse = None
        if need_lse:
            lse = lse4[:, :, :sq] if not folded else lse4[:, :, :h // hk].reshape(b, h, 1)
        if folded and not need_lse:  # back to head order and keyless rows cleared: one pass into the output
            out = q.new_empty(q.shape[:-1] + (out4.shape[-1],))  # [b, 1, h, dv] / [1, b, h, dv]: [b, h, dv] memory
            dest = out.view(out4.shape)
            if rows is None:
                dest.copy_(out4)
            else:
                torch.where(rows, static.zero, out4, out=dest)
            return out, None, state
        if folded:
            out4 = out4.reshape(b, h, 1, out4.shape[-1])
            rows = None if rows is None else rows.view(b, h, 1)
        if rows is not None:
            if need_lse:  # autograd may hold the op's outputs: cleared copies
                out4 = out4.masked_fill(rows.unsqueeze(-1), 0.0)
                lse = lse.masked_fill(rows, NEG_INF)
            else:
                out4.masked_fill_(rows.unsqueeze(-1), 0.0)
        return _from_bhsd(out4, fmt), lse, state

    def bind_fast(self, q, k, v, aux: AttnAux, cfg: AttnConfig, layout: str = "merged"):
        """layout="bhsd" (the SDPA function's [b, h, s, d] tensors, cfg describing their bshd views), calls without
        gradients, dropout or a bias tensor: _attend's work for calls matching these tensors (the module's guard)
        and this aux (its mask kept by identity and version by the caller), with the bias, keyless rows and folding
        settled here once; each call then costs the op and the output's clean-up. None for anything else."""
        if layout != "bhsd" or cfg.qkv_format != "bshd" or tuple(cfg.window_size) not in ((-1, -1), (-1, 0)) \
                or cfg.dropout_p > 0 or cfg.bias_type != "no_bias" or cfg.softmax_type != "vanilla" \
                or cfg.return_max_logit or cfg.softcap or aux.softmax_offset is not None \
                or q.requires_grad or k.requires_grad or v.requires_grad:
            return None
        b, h, sq, d = q.shape
        hk, skv, dv = k.shape[1], k.shape[2], v.shape[3]
        static = _static(aux, cfg, b, h, sq, skv, q.dtype, q.device)
        bias, rows, folded = _views(static, b, h, hk, sq, skv, None)
        op, causal, scale = self._op, static.is_causal, cfg.softmax_scale
        if folded:  # one query: the group's query heads as query rows of its key/value head, as _attend does
            g = h // hk
            out_shape, folded_shape = (b, sq, h, dv), (b, hk, g, dv)
            zero = static.zero

            def folded_call(q, k, v):
                out4 = op(q.reshape(b, hk, g, d), k, v, bias, False, 0.0, False, scale=scale)[0]
                out = q.new_empty(out_shape)  # [b, 1, h, dv]: written in head order by the one pass below
                if rows is None:
                    out.view(folded_shape).copy_(out4)
                else:
                    torch.where(rows, zero, out4, out=out.view(folded_shape))
                return out.transpose(1, 2)
            return folded_call
        groups = h // hk
        keyless = None if rows is None else rows.unsqueeze(-1)

        def call(q, k, v):
            if groups != 1:  # the op takes one key/value head per query head
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out4 = op(q, k, v, bias, False, 0.0, causal, scale=scale)[0]
            if keyless is not None:
                out4.masked_fill_(keyless, 0.0)
            return out4
        return call

    def bind_masked(self, q, k, v, aux: AttnAux, cfg: AttnConfig):
        """See Engine.bind_masked: bind_fast's bhsd call with the mask an argument. A mask's bias and keyless rows,
        as this call's op and clean-up read them, are made by the first call given that mask tensor and version and
        kept on the mask (_kept_on), so a decode step's first layer makes its new mask's bias and the other layers
        find it in one lookup; nothing else depends on the keys' length. The outputs of rows without keys are
        replaced by 0 here and no lse is read, so their bias rows are left -inf (the op's output there is not
        read): one kernel fewer than _mask_static's."""
        mask = aux.attention_mask
        if mask is None or mask.dtype != torch.bool or cfg.attn_mask_type != "arbitrary" \
                or cfg.qkv_format != "bshd" or tuple(cfg.window_size) not in ((-1, -1), (-1, 0)) \
                or cfg.dropout_p > 0 or cfg.bias_type != "no_bias" or cfg.softmax_type != "vanilla" \
                or cfg.return_max_logit or cfg.softcap or aux.softmax_offset is not None \
                or q.requires_grad or k.requires_grad or v.requires_grad:
            return None
        b, h, sq, d = q.shape
        hk, dv = k.shape[1], v.shape[3]
        op, scale, dtype, device = self._op, cfg.softmax_scale, q.dtype, q.device
        zero = _zero(dtype, device)
        folded = hk != h and sq == 1  # one query: the group's query heads as query rows of its key/value head
        token = object()  # this binding's entry among what is kept on a mask
        g = h // hk

        def views_of(mask) -> tuple:
            """(the op's bias, the keyless rows as the output's clean-up reads them) for this mask, kept on it for
            its version: three kernels (the bias in aligned rows, masked keys -inf; which rows see no key) and
            views."""
            skv = mask.shape[-1]
            masked = _as_4d(mask, b, h, sq, skv)  # [b|1, h|1, sq, skv]
            bias = _aligned_zeros(masked.shape, dtype, device).masked_fill_(masked, NEG_INF)
            keyless = masked.all(-1, keepdim=True)
            if not folded:
                views = (bias.expand(b, h, sq, skv), keyless.expand(b, h, sq, 1))
            elif masked.shape[1] == 1:  # rows shared by the heads: straight to the folded shape
                views = (bias.expand(b, hk, g, skv), keyless.expand(b, hk, g, 1))
            else:  # a row per query head: the group's rows side by side
                views = (bias.expand(b, h, 1, skv).view(b, hk, g, skv), keyless.expand(b, h, 1, 1).view(b, hk, g, 1))
            kept = _kept_on(mask)
            if kept is not None:
                kept[token] = views
            return views

        def kept_views(mask) -> tuple:
            """views_of(mask), found kept on the mask for its version in one attribute read where it was made."""
            kept = getattr(mask, "_attn_dispatch_mem_efficient", None)
            views = kept[1].get(token) if kept is not None and kept[0] == mask._version else None
            return views or views_of(mask)

        if folded:
            out_shape, folded_shape = (b, sq, h, dv), (b, hk, g, dv)

            def folded_call(q, k, v, mask):
                bias, rows = kept_views(mask)
                out4 = op(q.reshape(b, hk, g, d), k, v, bias, False, 0.0, False, scale=scale)[0]
                out = q.new_empty(out_shape)  # [b, 1, h, dv]: written in head order by the one pass below
                torch.where(rows, zero, out4, out=out.view(folded_shape))
                return out.transpose(1, 2)
            return folded_call

        def call(q, k, v, mask):
            bias, rows = kept_views(mask)
            if g != 1:  # the op takes one key/value head per query head
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            out4 = op(q, k, v, bias, False, 0.0, False, scale=scale)[0]
            out4.masked_fill_(rows, 0.0)
            return out4
        return call

    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        with torch.no_grad():
            out, lse, state = self._attend(q, k, v, aux, cfg, keep_state=True)
        return FwdResult(out, lse, state)

    def backward(self, dout, q, k, v, out, lse, state: _State, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        do4 = _bhsd(dout, state.fmt)
        if state.keyless is not None:
            do4 = do4.masked_fill(state.keyless.expand(do4.shape[:3]).unsqueeze(-1), 0.0)
        if state.folded:
            do4 = do4.reshape(state.out4.shape)
        if do4.stride() != state.out4.stride():  # dO in the output's layout, as torch's own autograd passes it
            do4 = torch.empty_like(state.out4).copy_(do4)
        want_bias = aux.bias is not None and aux.bias.requires_grad and state.bias is not None
        with torch_deterministic(cfg.deterministic):
            dq4, dk4, dv4, dbias = self._bwd(do4, state.q4, state.k4, state.v4, state.bias, state.out4, state.lse4,
                                             state.seed, state.offset, float(cfg.dropout_p),
                                             [True, True, True, want_bias], state.is_causal, scale=cfg.softmax_scale)
        hk = k.shape[-2]
        if state.folded:  # query rows back to query heads
            b, h = q.shape[0] if state.fmt == "bshd" else q.shape[1], q.shape[-2]
            dq4 = dq4.reshape(b, h, 1, dq4.shape[-1])
            if dbias is not None:
                dbias = dbias.reshape(b, h, 1, dbias.shape[-1])
        elif dk4.shape[1] != hk:  # sum the repeated heads back into their key/value head
            dk4, dv4 = (x.unflatten(1, (hk, -1)).sum(2) for x in (dk4, dv4))
        grads = [_from_bhsd(x, state.fmt) for x in (dq4, dk4, dv4)]
        return BwdResult(*grads, _bias_grad(dbias, aux, cfg) if want_bias else None)

    def __call__(self, q, k, v, aux: AttnAux, cfg: AttnConfig, *, flatten_heads: bool = False):
        training = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, aux.bias))
        if cfg.deterministic and training:  # the backward must run under the deterministic flag: our Function
            return super().__call__(q, k, v, aux, cfg, flatten_heads=flatten_heads)
        # the op's own C++ autograd; without gradients no lse (no caller of this path reads one then)
        out, lse, _ = self._attend(q, k, v, aux, cfg, keep_state=False, need_lse=training)
        return (out.flatten(-2) if flatten_heads else out), None if lse is None else lse.detach(), None


def _bias_grad(dbias: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> torch.Tensor:
    """The op's [b, h, sq, skv] bias gradient, summed over the dims aux.bias broadcasts, in its dtype."""
    shape = aux.bias.shape
    dims = tuple(d for d in range(4) if shape[d] == 1 and dbias.shape[d] != 1)
    grad = dbias.sum(dim=dims, keepdim=True) if dims else dbias
    if cfg.bias_type == "pre_scale_bias":
        grad = grad * cfg.softmax_scale
    return grad.to(aux.bias.dtype).reshape(shape)
