"""Validation of a module's construction and of each call's static arguments: every bad input is a ValueError that
names the argument, its value and what is allowed. Nothing here reads a tensor's contents (sequences.py does)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .params import BIAS_TYPES, MASK_TYPES, QKV_FORMATS, has_padding, normalize_window

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_SHOW = 8  # list elements shown in error messages


def show_values(values: list[int]) -> str:
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
    mask_mod: bool = False  # the module holds a user's FlexAttention mask_mod / score_mod (our extension)
    score_mod: bool = False
    policy: str | None = None  # the selection policy's name; None: ATTN_DISPATCH_POLICY's


# ------------------------------------------------------------------------------------------------
# Sequences
# ------------------------------------------------------------------------------------------------
def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


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


_FORMAT_RANK = {"bshd": 4, "sbhd": 4, "thd": 3}


def check_ranks(fmt: str, q: Any, k: Any, v: Any) -> None:
    """q, k and v are tensors of the format's rank."""
    rank = _FORMAT_RANK[fmt]
    for name, x in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} is {shape}; qkv_format={fmt!r} needs a {rank}-D tensor")


def resolve_call(module: Any, args: Any) -> tuple[str, str, tuple[int, int]]:
    """(qkv_format, mask type, window) of a call to a DotProductAttention `module`: the call's own (CallArgs
    `args`), else the module's."""
    qkv_format, attn_mask_type, window_size = args.qkv_format, args.attn_mask_type, args.window_size
    fmt = module.qkv_format if qkv_format is None else qkv_format
    if fmt not in _FORMAT_RANK:
        raise ValueError(f"qkv_format={fmt!r} is not supported; expected one of {', '.join(QKV_FORMATS)}")
    mask_type = module.attn_mask_type if attn_mask_type is None else normalize_mask_type(attn_mask_type)
    if window_size is None and mask_type == module.attn_mask_type:
        window = module.window_size
    else:
        window = check_window(module._window_arg if window_size is None else window_size, mask_type)
    return fmt, mask_type, window
