"""FlashAttention-3 (hopper/, module `flash_attn_interface`, package flash-attn-3): Hopper sm90 kernels.

UNTESTED: FlashAttention-3 cannot be installed on our machines (no wheel; a source build takes longer than a
GPU lease), so this engine is written against the documented interface and has never run. Its constraint
table says so in every verdict.

Written against hopper/flash_attn_interface.py (Dao-AILab/flash-attention, 2025-26): the custom ops
`_flash_attn_forward(q, k, v, ..., cu_seqlens_q, cu_seqlens_k, ..., max_seqlen_q, max_seqlen_k, ...,
softmax_scale, causal, window_size_left, window_size_right, attention_chunk, softcap, ..., num_splits, pack_gqa,
sm_margin) -> (out, softmax_lse, out_accum, softmax_lse_accum)` and `_flash_attn_backward(dout, q, k, v, out,
softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv,
softmax_scale, is_causal, window_size_left, window_size_right, softcap, deterministic, sm_margin)` (fills dq, dk,
dv). Earlier betas took `window_size=(l, r)` and `causal`; arguments are bound by name with aliases. No dropout,
no ALiBi (hopper/flash_api.cpp hardcodes p_dropout = 0). lse: [b, h, sq] dense, [h, t] varlen.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from ._flash_io import FlashEngineBase, KernelCall, Varlen, bind_supported, parameters_of

_ALIASES = {
    "seqused_q": ("seqused_q", "sequed_q"),
    "seqused_k": ("seqused_k", "sequed_k"),
    "is_causal": ("is_causal", "causal"),
}


class FlashAttn3Engine(FlashEngineBase):
    family = "flash_attn_3"
    provider = "interface"
    empty_rows_lse_positive_inf = True  # unverified for FA3; harmless where it already writes -inf

    def __init__(self) -> None:
        errors = []
        for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface"):
            try:
                self._fi = importlib.import_module(name)
                break
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise ImportError("FlashAttention-3 is not importable (" + "; ".join(errors) + ")")

    def _window(self, fn, call: KernelCall) -> dict[str, Any]:
        if "window_size" in (parameters_of(fn) or set()):
            return {"window_size": call.window}
        return {"window_size_left": call.window[0], "window_size_right": call.window[1]}

    def _kernel_fwd(self, q, k, v, varlen: Varlen | None, call: KernelCall, out):
        fn = self._fi._flash_attn_forward
        values: dict[str, Any] = dict(q=q, k=k, v=v, softmax_scale=call.scale, causal=call.causal,
                                      **self._window(fn, call))
        if varlen is not None:
            values.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)
        result = fn(**bind_supported(fn, values, _ALIASES))
        return result[0], result[1], None

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen: Varlen | None, call: KernelCall):
        fn = self._fi._flash_attn_backward
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        values: dict[str, Any] = dict(dout=dout if dout.stride(-1) == 1 else dout.contiguous(), q=q, k=k, v=v,
                                      out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=call.scale,
                                      is_causal=call.causal, deterministic=call.deterministic,
                                      **self._window(fn, call))
        if varlen is not None:
            values.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)
        fn(**bind_supported(fn, values, _ALIASES))
        return dq, dk, dv, None
