"""FlashAttention 2, two providers: the flash-attn 2.x package, and the FA2 kernels vendored in torch.

Both are bottom-right aligned (flash-attn >= 2.1), take windows as (left, right) with -1 unbounded, write
+inf as the lse of a row that sees no key (normalised to -inf by the shared plumbing, _flash_io), draw
dropout from torch's default CUDA generator and return an rng state that backward replays.
"""
from __future__ import annotations

from typing import Any

import torch

from . import _torch_native
from ._flash_io import UNBOUNDED, FlashEngineBase, KernelCall, Varlen, bind_supported, parameters_of


class TorchFlashEngine(_torch_native.NativeOpPath, FlashEngineBase):
    """torch.ops.aten._flash_attention_forward/_backward: torch's vendored FA2 (flash_api.cpp mha_fwd/mha_varlen_fwd).

    Dense calls take bshd (last dim contiguous; the op reads the other strides, so sbhd views need no copy; its
    backward makes grad_out and out contiguous). Varlen calls pass cum_seq_q/k. No ALiBi: the forward's schema has
    alibi_slopes, but torch builds these kernels with FLASHATTENTION_DISABLE_ALIBI ("This flash attention build
    does not support alibi.", torch 2.11), and the backward op has no slopes argument at all.
    """

    family = "flash_attn_2"
    provider = "torch"
    supports_dropout = True
    supports_alibi = False
    no_alibi_why = ("torch builds its FA2 kernels without ALiBi ('This flash attention build does not support "
                    "alibi.'); use flash_attn_2:package, cudnn_fused or the unfused engine")
    same_head_dims = True
    empty_rows_lse_positive_inf = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device: its FlashAttention kernels cannot run")
        self._fwd = torch.ops.aten._flash_attention_forward.default
        self._bwd = torch.ops.aten._flash_attention_backward.default
        names = {a.name for a in self._fwd._schema.arguments}
        self._has_window = {"window_size_left", "window_size_right"} <= names
        self._has_block_table = "block_table" in names
        self._row_starts_cache: dict[tuple, torch.Tensor] = {}

    native_call = staticmethod(_torch_native.flash_call)  # SDPA's own op and autograd where it fits

    def _window_kwargs(self, call: KernelCall) -> dict[str, Any]:
        if call.window in ((UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0)):
            return {}  # plain or causal: is_causal says it, which every torch with FA2 takes
        if not self._has_window:
            raise RuntimeError(f"this torch ({torch.__version__}) has no window_size arguments on "
                               "aten::_flash_attention_forward (added in torch 2.4); sliding windows need it")
        left, right = call.window
        return {"window_size_left": left, "window_size_right": right}

    def _kernel_fwd(self, q, k, v, varlen: Varlen | None, call: KernelCall, out):
        kwargs = dict(scale=call.scale, **self._window_kwargs(call))
        cum_q, cum_k, max_q, max_k = _cum_and_max(q, k, varlen)
        out, lse, rng_state, unused, _ = self._fwd(q, k, v, cum_q, cum_k, max_q, max_k, call.dropout_p,
                                                   call.causal, False, **kwargs)
        expected = (q.shape[-2], q.shape[0]) if varlen is not None else (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != expected:
            raise RuntimeError(f"aten::_flash_attention_forward returned lse of shape {list(lse.shape)}, expected "
                               f"{list(expected)}; this torch ({torch.__version__}) predates the FA2 2.5 API (2.4+)")
        return out, lse, (rng_state, unused, max_q, max_k)

    def forward_kv_cache(self, q, cache, cu_seqlens_q, max_seqlen_q, cfg):
        """The varlen kernel reads the cache in place: a contiguous cache as rows of page_size tokens of which
        seqused_k are live, a paged one through block_table (flash_api.cpp mha_varlen_fwd). With q_len 1 and GQA
        the kernel folds the query heads of a group into rows and splits the keys across blocks (split-KV)."""
        window = cfg.window_size
        kwargs: dict[str, Any] = {"scale": cfg.softmax_scale}
        if window not in ((UNBOUNDED, UNBOUNDED), (UNBOUNDED, 0)):
            kwargs.update(window_size_left=window[0], window_size_right=window[1])
        if cache.page_table is None:
            k, v = cache.k.flatten(0, 1), cache.v.flatten(0, 1)
            cu_k = self._row_starts(cache.batch, cache.page_size, q.device)
            kwargs["seqused_k"] = cache.seqlens_kv
        else:
            if not self._has_block_table:
                raise RuntimeError(f"this torch ({torch.__version__}) has no block_table argument on "
                                   "aten::_flash_attention_forward: a paged cache needs it")
            k, v, cu_k = cache.k, cache.v, cache.cu_seqlens_kv
            kwargs["block_table"] = cache.page_table
        causal = "causal" in cfg.attn_mask_type
        return self._fwd(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cache.max_seqlen_kv, 0.0, causal, False,
                         **kwargs)[0]

    def _row_starts(self, batch: int, row_len: int, device: torch.device) -> torch.Tensor:
        key = (batch, row_len, device)
        starts = self._row_starts_cache.get(key)
        if starts is None:
            if len(self._row_starts_cache) > 64:
                self._row_starts_cache.clear()
            starts = self._row_starts_cache[key] = torch.arange(0, (batch + 1) * row_len, row_len,
                                                                dtype=torch.int32, device=device)
        return starts

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen: Varlen | None, call: KernelCall):
        if kernel_state is None:
            if call.dropout_p > 0:
                raise ValueError("backward with dropout needs the forward's rng state (FwdResult.state)")
            empty = torch.empty(0, dtype=torch.uint64, device=q.device)
            kernel_state = (empty, empty, None, None)
        rng_state, unused, _, _ = kernel_state
        cum_q, cum_k, max_q, max_k = _cum_and_max(q, k, varlen)
        with _torch_native.torch_deterministic(call.deterministic):
            dq, dk, dv = self._bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, call.dropout_p,
                                   call.causal, rng_state, unused, scale=call.scale, **self._window_kwargs(call))
        return dq, dk, dv, None


class FlashAttn2PackageEngine(FlashEngineBase):
    """The flash-attn 2.x package, through its internal _flash_attn_(varlen_)forward/backward.

    Their signatures changed across 2.x releases (window_size tuple -> window_size_left/right in 2.6.x, softcap in
    2.6, alibi_slopes in 2.4, deterministic in 2.4.1, return tuple shortened in 2.6.x); arguments are bound by
    name to what the installed release accepts, and a feature it lacks raises instead of being dropped.
    """

    family = "flash_attn_2"
    provider = "package"
    supports_dropout = True
    supports_alibi = True
    same_head_dims = True
    empty_rows_lse_positive_inf = True

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fi  # imports the flash_attn_2_cuda extension

        self._fi = fi

    def _common(self, fn, call: KernelCall) -> dict[str, Any]:
        values: dict[str, Any] = dict(dropout_p=call.dropout_p, softmax_scale=call.scale, causal=call.causal,
                                      softcap=0.0, alibi_slopes=call.alibi_slopes)
        params = parameters_of(fn) or set()
        if "window_size" in params:
            values["window_size"] = call.window
        else:
            values["window_size_left"], values["window_size_right"] = call.window
        return values

    def _kernel_fwd(self, q, k, v, varlen: Varlen | None, call: KernelCall, out):
        if varlen is None:
            fn = self._fi._flash_attn_forward
            values = dict(q=q, k=k, v=v, **self._common(fn, call), return_softmax=False)
        else:
            fn = self._fi._flash_attn_varlen_forward
            values = dict(q=q, k=k, v=v, cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv,
                          **self._common(fn, call), return_softmax=False)
        result = fn(**bind_supported(fn, values))
        # 2.6.x+: (out, lse, S_dmask, rng_state); older: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        return result[0], result[-3], result[-1]

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen: Varlen | None, call: KernelCall):
        if kernel_state is None and call.dropout_p > 0:
            raise ValueError("backward with dropout needs the forward's rng state (FwdResult.state)")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        if varlen is None:
            fn = self._fi._flash_attn_backward
            values = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv)
        else:
            fn = self._fi._flash_attn_varlen_backward
            values = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                          cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)
        values.update(self._common(fn, call), deterministic=call.deterministic, rng_state=kernel_state)
        fn(**bind_supported(fn, values))
        return dq, dk, dv, None


def _cum_and_max(q, k, varlen: Varlen | None):
    """(cu_seqlens_q, cu_seqlens_kv, max_q, max_k) as the aten ops take them: None offsets for dense bshd."""
    if varlen is None:
        return None, None, q.shape[1], k.shape[1]
    return varlen.cu_seqlens_q, varlen.cu_seqlens_kv, varlen.max_seqlen_q, varlen.max_seqlen_kv
