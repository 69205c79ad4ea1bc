"""DotProductAttention(..., inference_params=...): append the step's k/v to the cache, then attend the step's
queries to everything cached, through the same selection (tables, policy, explanations) as every other call.

Masks: Transformer Engine turns the top-left causal masks into their bottom-right forms under a KV cache (the
new queries are the last positions of their sequences); so do we. 'no_mask'/'padding' attend the whole cache.
"""
from __future__ import annotations

from typing import Any

import torch

from ..call_args import CallArgs
from ..inputs import make_plan
from ..validation import check_window, normalize_mask_type
from ..params import AttentionParams, is_causal
from .inference_params import InferenceParams, KVCacheError

CAUSAL_UNDER_CACHE = "padding_causal_bottom_right"
NON_CAUSAL_UNDER_CACHE = "padding"

# forward keywords the cache path cannot honour: the value each must keep
_UNSUPPORTED = {"attention_mask": None, "cu_seqlens_q_padded": None, "cu_seqlens_kv_padded": None,
                "checkpoint_core_attention": False, "core_attention_bias_type": "no_bias",
                "core_attention_bias": None, "alibi_slopes": None, "pad_between_seqs": None}


def _bucket(n: int) -> int:
    """Powers of two: decisions (and plans) per batch size and step length stay few."""
    return 1 << (n - 1).bit_length()


def _resolve(module: torch.nn.Module, args: CallArgs) -> tuple[str, str, tuple]:
    qkv_format, attn_mask_type, window_size = args.qkv_format, args.attn_mask_type, args.window_size
    fmt = module.qkv_format if qkv_format is None else qkv_format
    if fmt not in ("bshd", "sbhd", "thd"):
        raise ValueError(f"qkv_format={fmt!r} is not supported; expected one of 'bshd', 'sbhd', 'thd'")
    mask = module.attn_mask_type if attn_mask_type is None else normalize_mask_type(attn_mask_type)
    if mask == "arbitrary":
        raise KVCacheError("attn_mask_type='arbitrary' with inference_params: a KV-cache step takes causal or "
                           "padding masks (the cache's lengths are the padding)")
    window = module.window_size if window_size is None and attn_mask_type is None else \
        check_window(window_size, mask)
    causal = is_causal(mask)
    if not causal and window not in ((-1, -1),):
        raise KVCacheError(f"window_size={window} with attn_mask_type={mask!r}: under a KV cache a sliding window "
                           "needs a causal mask (the window trails each new query)")
    return fmt, CAUSAL_UNDER_CACHE if causal else NON_CAUSAL_UNDER_CACHE, window


def _check_call(module: torch.nn.Module, ip: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fmt: str, args: CallArgs) -> None:
    if not isinstance(ip, InferenceParams):
        raise TypeError(f"inference_params must be an attn_dispatch.InferenceParams; got {type(ip).__name__}")
    for name, allowed in _UNSUPPORTED.items():
        value = getattr(args, name)
        if not (value is allowed or (not isinstance(value, torch.Tensor) and value == allowed)
                or (name == "pad_between_seqs" and value is False)):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise KVCacheError(f"{name}={shown} is not supported with inference_params; leave it at {allowed!r}")
    _check_lengths(ip, args)
    if module.cp_group is not None:
        raise KVCacheError("inference_params under context parallelism is not supported (nor by Transformer "
                           "Engine): call set_context_parallel_group(None, None, None) for generation")
    if module.training and module.attention_dropout > 0:
        raise KVCacheError(f"attention_dropout={module.attention_dropout} with the module in training mode: a "
                           "KV-cache step runs without dropout; call module.eval()")
    if module.softmax_type != "vanilla" or module.return_max_logit:
        raise KVCacheError(f"softmax_type={module.softmax_type!r}, return_max_logit={module.return_max_logit}: a "
                           "KV-cache step supports vanilla softmax without max logits")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise KVCacheError("a KV-cache step is inference only: gradients cannot flow through the cache; run it "
                           "under torch.no_grad() or torch.inference_mode()")
    ranks = 3 if fmt == "thd" else 4
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != ranks:
            raise ValueError(f"{name} must be a {ranks}-D tensor for qkv_format={fmt!r}; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    step = ip.current_step
    if fmt == "thd":
        if q.shape[0] < step.total:
            raise KVCacheError(f"query_layer holds {q.shape[0]} tokens, fewer than the step's {step.total} "
                               f"({dict(ip.step_dict)})")
    else:
        b, s = (q.shape[0], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[0])
        if b != step.batch:
            raise KVCacheError(f"query_layer has batch {b} but pre_step announced {step.batch} sequences "
                               f"({list(ip.step_dict)}); the batch order is pre_step's")
        if s < step.max_q:
            raise KVCacheError(f"query_layer has {s} positions per sequence, fewer than the step's longest "
                               f"({step.max_q} new tokens)")
        for name, t in (("key_layer", k), ("value_layer", v)):
            if t.shape[:2] != q.shape[:2]:
                raise KVCacheError(f"{name} shape {tuple(t.shape)} does not match query_layer's batch and "
                                   f"sequence dims {tuple(q.shape[:2])}")
    if q.shape[-2] != module._heads_local or q.shape[-1] != module.hidden_size_per_attention_head_k:
        raise ValueError(f"query_layer has heads x head_dim {tuple(q.shape[-2:])}; the module was built for "
                         f"({module._heads_local}, {module.hidden_size_per_attention_head_k})")
    if k.shape[-2] != module._groups_local:
        raise ValueError(f"key_layer has {k.shape[-2]} heads; the module was built for num_gqa_groups="
                         f"{module._groups_local} (per tensor-parallel rank)")
    if q.dtype != ip.dtype:
        raise KVCacheError(f"query_layer is {q.dtype}, the cache is {ip.dtype} (InferenceParams dtype)")


def _check_lengths(ip: InferenceParams, args: CallArgs) -> None:
    """cu_seqlens_q/kv and max_seqlen_q/kv come from inference_params (as in Transformer Engine); passed anyway,
    they must agree with the step (cu_seqlens_kv counting the cached tokens after it)."""
    step = ip.current_step
    for name, expected in (("cu_seqlens_q", step.cu_q), ("cu_seqlens_kv", step.cu_kv)):
        given = getattr(args, name)
        if given is None:
            continue
        given = given[:step.batch + 1] if isinstance(given, torch.Tensor) else given
        if not isinstance(given, torch.Tensor) or given.shape != expected.shape or \
                not torch.equal(given.to(expected.device, expected.dtype), expected):
            raise KVCacheError(f"{name}={given!r} disagrees with inference_params' step ({expected.tolist()}); "
                               "leave it out: the step's lengths come from pre_step")
    for name, limit in (("max_seqlen_q", step.max_q), ("max_seqlen_kv", step.max_kv)):
        given = getattr(args, name)
        if given is not None and (not isinstance(given, int) or given < limit):
            raise KVCacheError(f"{name}={given!r} is below the step's {limit}; leave it out")


def params_for(module: torch.nn.Module, ip: InferenceParams, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, mask: str, window: tuple[int, int]) -> AttentionParams:
    spec = module._spec_now()
    step = ip.current_step
    return AttentionParams(
        dtype=q.dtype, qkv_format="thd", batch_size=_bucket(step.batch), num_heads=q.shape[-2],
        num_gqa_groups=k.shape[-2], head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
        max_seqlen_q=_bucket(step.max_q), max_seqlen_kv=min(_bucket(step.max_kv), ip.max_sequence_length),
        attn_mask_type=mask,
        window_size=window, is_training=False, deterministic=spec.deterministic, cp_comm_type=spec.cp_comm_type,
        device_type="cuda" if q.device.type == "cuda" else q.device.type, softcap=spec.softcap,
        mask_mod=spec.mask_mod, score_mod=spec.score_mod, inference_kv_cache=True, kv_cache_paged=ip.is_paged,
        kv_page_size=ip.page_size if ip.is_paged else None)


def describe(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             args: CallArgs) -> AttentionParams:
    """Validate a KV-cache step as forward does (nothing is written) and describe it as selection sees it."""
    ip = args.inference_params
    fmt, mask, window = _resolve(module, args)
    _check_call(module, ip, q, k, v, fmt, args)
    return params_for(module, ip, q, k, v, mask, window)


def forward(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            args: CallArgs) -> torch.Tensor:
    """The step's output, heads merged as forward returns it; args.inference_params is the cache."""
    ip = args.inference_params
    params = describe(module, q, k, v, args)
    fmt = module.qkv_format if args.qkv_format is None else args.qkv_format
    layer = module.layer_number
    ip.check_layer_free(layer)
    step = ip.current_step
    k_new, v_new = ip.gather_new(k, fmt), ip.gather_new(v, fmt)
    ip.check_new_kv(k_new, v_new)
    q_new = ip.gather_new(q, fmt)
    plan = _plan(module, params)  # raises before the cache is written
    cache = ip.append(layer, k_new, v_new)
    module.__dict__["last_decision"] = plan.decision
    out = plan.engine.forward_kv_cache(q_new, cache, step.cu_q, step.max_q, plan.cfg)
    return ip.scatter_out(out.flatten(-2), fmt, q)


def _plan(module: torch.nn.Module, params: AttentionParams):
    plans = module._plans
    return plans.by_params(plans.kv_cache, params, lambda: make_plan(module._spec_now(), params))
