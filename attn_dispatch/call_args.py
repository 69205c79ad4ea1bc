"""DotProductAttention.forward's arguments after q, k, v, as one value.

forward builds a CallArgs once from its keywords (a call passing only q, k, v shares QKV_ONLY) and hands it on:
to selection's slow path (module._prepare, question.describe_plain), explain(), the KV cache and context parallelism.
The plan cache's key is derived from it here, in one place.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


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
                 deterministic: bool, kv_cut: tuple[int, int] | None = None) -> tuple:
        """The static facts a plan depends on (tensor contents aside: those are re-checked per call). Only for
        calls that plan through selection: inference_params and fp8_output have been routed away by then.
        kv_cut (dim, length): the key of the same call with its keys and values cut to `length` keys along their
        dim `dim`, and so the last dim of a mask or bias of the keys' length (inputs.decode_bucket_cut), without
        making the cut tensors."""
        window = tuple(self.window_size) if isinstance(self.window_size, list) else self.window_size
        bias = self.core_attention_bias
        k_shape, v_shape = k.shape, v.shape
        mask_sig, bias_sig = arg_signature(self.attention_mask), None if bias is None else arg_signature(bias, True)
        if kv_cut is not None:
            dim, length = kv_cut
            skv = k_shape[dim]
            k_shape, v_shape = (s[:dim] + (length,) + s[dim + 1:] for s in (k_shape, v_shape))
            mask_sig, bias_sig = (sig if sig is None or sig[0][-1] != skv else (sig[0][:-1] + (length,),) + sig[1:]
                                  for sig in (mask_sig, bias_sig))
        return (self.qkv_format, self.attn_mask_type, window, q.shape, k_shape, v_shape, q.dtype, k.dtype,
                v.dtype, q.device, k.device, v.device, self.max_seqlen_q, self.max_seqlen_kv,
                self.cu_seqlens_q is None, self.cu_seqlens_kv is None, self.cu_seqlens_q_padded is None,
                self.cu_seqlens_kv_padded is None, self.pad_between_seqs, mask_sig,
                self.core_attention_bias_type, bias_sig, arg_signature(self.alibi_slopes), training, deterministic)

    def replace(self, **changes: Any) -> "CallArgs":
        return self._replace(**changes)


# The q, k, v-only call (every keyword at forward's default): forward passes this one instance, which is how
# the module knows a call may later take the cached fast path.
QKV_ONLY = CallArgs()

KEYWORDS = frozenset(CallArgs._fields) | {"fast_zero_fill"}

# Fields holding per-call data (tensors, a KV cache): a call that sets any of them plans every time.
_PER_CALL = tuple(CallArgs._fields.index(name) for name in (
    "attention_mask", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
    "core_attention_bias", "alibi_slopes", "inference_params"))
_SETTINGS = tuple(i for i in range(len(CallArgs._fields)) if i not in _PER_CALL)
_POSITIONAL = CallArgs._fields.index("alibi_slopes") + 1  # forward's positional order matches CallArgs up to here


def is_cacheable(call: CallArgs) -> bool:
    """Whether repeat calls with these arguments may take the module's cached path, keyed by them: no per-call data
    among them, no recomputation (checkpoint_core_attention) or FP8 output, and every setting a plain immutable
    value (str, int, bool, None, a tuple of ints), so that equal arguments mean an equal plan."""
    if call.checkpoint_core_attention is not False or call.fp8_output is not False:
        return False
    for i in _PER_CALL:
        if call[i] is not None:
            return False
    for i in _SETTINGS:
        value = call[i]
        if value is not None and type(value) not in (str, int, bool) and not (
                type(value) is tuple and all(type(x) is int for x in value)):
            return False
    return True


def cached_call_args(args: tuple, kwargs: dict) -> CallArgs | None:
    """forward's arguments after q, k, v (as passed to the module) as the CallArgs keying the cached path; None
    where that path cannot serve the call (see is_cacheable; unknown keywords too: forward then says what is
    wrong). fast_zero_fill changes nothing and is dropped, as forward does."""
    if len(args) > _POSITIONAL:
        return None
    if "fast_zero_fill" in kwargs:
        kwargs = {name: value for name, value in kwargs.items() if name != "fast_zero_fill"}
    try:
        call = CallArgs(*args, **kwargs)
    except TypeError:
        return None
    return call if is_cacheable(call) else None
