"""DotProductAttention.forward's arguments after q, k, v, as one value.

forward builds a CallArgs once from its keywords (a call passing only q, k, v shares QKV_ONLY) and hands it on:
to selection's slow path (the module's _prepare/_describe), explain(), the KV cache and context parallelism.
The plan cache's key is derived from it here, in one place.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .inputs import arg_signature


class CallArgs(NamedTuple):
    """forward's keywords (fast_zero_fill aside: it changes nothing here), with forward's defaults; read by name.

    Immutable. A NamedTuple rather than a frozen dataclass because every call with keywords builds one: a frozen
    dataclass's __init__ sets its 17 fields one object.__setattr__ at a time, 1.4 us more per call (measured with
    benchmarks/bench_hotpath_cpu.py, "module(kw)"); a NamedTuple is built in one tuple.__new__."""

    attention_mask: Any = None
    qkv_format: str | None = None
    cu_seqlens_q: Any = None
    cu_seqlens_kv: Any = None
    cu_seqlens_q_padded: Any = None
    cu_seqlens_kv_padded: Any = None
    max_seqlen_q: Any = None
    max_seqlen_kv: Any = None
    attn_mask_type: str | None = None
    window_size: Any = None
    checkpoint_core_attention: bool = False
    core_attention_bias_type: str = "no_bias"
    core_attention_bias: Any = None
    alibi_slopes: Any = None
    inference_params: Any = None
    pad_between_seqs: bool | None = None
    fp8_output: bool = False

    def plan_key(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
                 deterministic: bool) -> tuple:
        """The static facts a plan depends on (tensor contents aside: those are re-checked per call). Only for
        calls that plan through selection: inference_params and fp8_output have been routed away by then."""
        window = tuple(self.window_size) if isinstance(self.window_size, list) else self.window_size
        bias = self.core_attention_bias
        return (self.qkv_format, self.attn_mask_type, window, q.shape, k.shape, v.shape, q.dtype, k.dtype,
                v.dtype, q.device, k.device, v.device, self.max_seqlen_q, self.max_seqlen_kv,
                self.cu_seqlens_q is None, self.cu_seqlens_kv is None, self.cu_seqlens_q_padded is None,
                self.cu_seqlens_kv_padded is None, self.pad_between_seqs, arg_signature(self.attention_mask),
                self.core_attention_bias_type, None if bias is None else arg_signature(bias, grad=True),
                arg_signature(self.alibi_slopes), training, deterministic)

    def replace(self, **changes: Any) -> "CallArgs":
        return self._replace(**changes)


# The q, k, v-only call (every keyword at forward's default): forward passes this one instance, which is how
# the module knows a call may later take the cached fast path.
QKV_ONLY = CallArgs()

KEYWORDS = frozenset(CallArgs._fields) | {"fast_zero_fill"}
