"""The torch providers' differentiable call through the aten ops F.scaled_dot_product_attention itself ends in.

`F.scaled_dot_product_attention` picks a kernel and calls `aten::_scaled_dot_product_flash_attention` or
`aten::_scaled_dot_product_cudnn_attention`, whose backward torch registers in C++ (derivatives.yaml). Calling
the same op directly gives a module call SDPA's own forward and backward: no Python autograd Function, no
Python backward, no extra copies of the output gradient. Measured on the H100, the Python path lost
up to 1.26x to SDPA on the same kernels; this path is what closes it.

The module's repeat calls go through bind(): the op specialised to one tensor signature. FA2 on bshd tensors
without dropout (there, and in flash_call: the SDPA function's and the transformers integration's calls) calls the
op that `_scaled_dot_product_flash_attention` itself ends in, `_flash_attention_forward`, which takes [b, s, h, d]
as it is (no views; gated by a one-time self-check per device, fa2_bshd_ok).

Only calls the op expresses exactly take it (dense bshd/sbhd, no window beyond causal, no bias, sink, ALiBi or
max-logit output, torch's default dropout generator); everything else, and context parallelism (which needs
the functional forward/backward pair), keeps the engine's general path.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .base import AttnAux, AttnConfig


@contextlib.contextmanager
def torch_deterministic(enabled: bool) -> Iterator[None]:
    """torch's flash and memory-efficient backwards read determinism from the global flag (attention_backward.cu):
    set it for one call."""
    if not enabled or (torch.are_deterministic_algorithms_enabled()
                       and not torch.is_deterministic_algorithms_warn_only_enabled()):
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


_NO_WINDOW = ((-1, -1), (-1, 0))
# torch's generated bindings of the ops (the same schema as torch.ops.aten.*): their argument parsing costs ~7 us
# less per call than going through torch.ops, which matters where a small call is host-bound.
_FLASH = getattr(torch, "_scaled_dot_product_flash_attention", None) or \
    torch.ops.aten._scaled_dot_product_flash_attention
_CUDNN = getattr(torch, "_scaled_dot_product_cudnn_attention", None) or \
    getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
# The FA2 op that _FLASH itself calls after transposing [b, h, s, d] back to [b, s, h, d] (its backward is the
# same kernel's too): bshd goes in as it is, with no views in and one out. Private and reached through torch.ops
# (no generated binding), yet on two H100 leases' hosts it cost 0.5-12 us less per forward and 42-175 us less per
# training step than _FLASH with its views (benchmarks/results/hotpath/host_overhead_h100*.json); it is used only
# where a one-time self-check on the device finds it equal to _FLASH, forward and backward (fa2_bshd_ok).
_FA2_BSHD = getattr(getattr(torch.ops.aten, "_flash_attention_forward", None), "default", None)
_FA2_BSHD_OK: dict[torch.device, bool] = {}  # device -> the self-check's verdict


def static_ok(cfg: AttnConfig, *, allow_bottom_right: bool) -> bool:
    """What the call's config alone decides (cached per config by the engines)."""
    if cfg.qkv_format not in ("bshd", "sbhd") or tuple(cfg.window_size) not in _NO_WINDOW:
        return False
    if cfg.bias_type != "no_bias" or cfg.softmax_type != "vanilla" or cfg.return_max_logit or cfg.softcap:
        return False
    masks = ("no_mask", "causal", "causal_bottom_right") if allow_bottom_right else ("no_mask", "causal")
    if cfg.attn_mask_type not in masks:
        return False
    # A deterministic backward is enforced by the general path (it sets torch's flag for that call only).
    return not cfg.deterministic


# Each view below is an autograd node when grad is recorded (~1.5 us of host time apiece on a CPU stand-in):
# bshd takes transpose (cheaper to parse than permute), and heads merge by flatten(-2), not reshape(*shape, -1).
def _bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.transpose(1, 2) if fmt == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(out4: torch.Tensor, fmt: str, flatten_heads: bool) -> torch.Tensor:
    out = out4.transpose(1, 2) if fmt == "bshd" else out4.permute(2, 0, 1, 3)
    return out.flatten(-2) if flatten_heads else out


def flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
               flatten_heads: bool):
    """(out, lse, None) through aten::_scaled_dot_product_flash_attention, or None when this call needs the
    general path. FA2 aligns a causal diagonal bottom-right: 'causal' (top-left) only when sq == skv."""
    fmt = cfg.qkv_format
    seq = 1 if fmt == "bshd" else 0
    causal = cfg.attn_mask_type != "no_mask"
    if causal and (q.shape[seq] > k.shape[seq] or (cfg.attn_mask_type == "causal" and q.shape[seq] != k.shape[seq])):
        return None  # top-left needs equal lengths; sq > skv leaves rows with no key (FA2's lse +inf: general path)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or aux.dropout_generator is not None:
        return None
    if fmt == "bshd" and cfg.dropout_p == 0.0 and fa2_bshd_ok(q.device):  # no views (what the self-check covers)
        res = _FA2_BSHD(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=cfg.softmax_scale)
        return (res[0].flatten(-2) if flatten_heads else res[0]), res[1], None
    res = _FLASH(
        _bhsd(q, fmt), _bhsd(k, fmt), _bhsd(v, fmt), float(cfg.dropout_p), causal, False, scale=cfg.softmax_scale)
    return _from_bhsd(res[0], fmt, flatten_heads), res[1], None


def cudnn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
               flatten_heads: bool):
    """(out, lse, None) through aten::_scaled_dot_product_cudnn_attention (top-left causal, as SDPA's), or None.
    bshd and sbhd both go in as [b, h, s, d] views, GQA with fewer key/value heads, as SDPA passes them (torch
    2.11 on the H100 ran SDPA's cuDNN kernel on sbhd views and GQA without copies)."""
    fmt = cfg.qkv_format
    seq = 1 if fmt == "bshd" else 0
    causal = cfg.attn_mask_type != "no_mask"
    if (causal and q.shape[seq] != k.shape[seq]) or aux.dropout_generator is not None:
        return None
    need_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    res = _CUDNN(
        _bhsd(q, fmt), _bhsd(k, fmt), _bhsd(v, fmt), None, need_lse, float(cfg.dropout_p), causal, False,
        scale=cfg.softmax_scale)
    lse = res[1]
    if lse is not None and lse.dim() == 4:
        lse = lse.squeeze(-1)
    return _from_bhsd(res[0], fmt, flatten_heads), lse, None


def bind(native_call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
         layout: str = "merged"):
    """native_call specialised to calls whose q, k, v match these in shape, strides, dtype, device and
    requires_grad (the module's tensor guard checks that before each use): a function (q, k, v) -> out with heads
    merged, or None where such calls take the general path. What flash_call/cudnn_call check per call is settled
    here once; each call then costs the op and the views F.scaled_dot_product_attention's caller pays too (issue
    12: the checks cost the module 10-20 us per call more than SDPA on the H100's host).
    layout="bhsd": q, k, v are [b, h, s, d] (the SDPA function's tensors; cfg describes their bshd views), and the
    function returns the op's [b, h, sq, d_v] output: the op on them as they are, no views either way."""
    if layout == "bhsd":
        if cfg.qkv_format != "bshd":
            return None
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # the checks below read the bshd views
    elif layout != "merged":
        raise ValueError(f"layout={layout!r}; expected 'merged' or 'bhsd'")
    if not static_ok(cfg, allow_bottom_right=True) or aux.dropout_generator is not None:
        return None
    fmt = cfg.qkv_format
    seq = 1 if fmt == "bshd" else 0
    sq, skv = q.shape[seq], k.shape[seq]
    causal = cfg.attn_mask_type != "no_mask"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    if native_call is flash_call:
        if causal and (sq > skv or (cfg.attn_mask_type == "causal" and sq != skv)):
            return None
    elif native_call is cudnn_call:
        if causal and sq != skv:
            return None
    else:
        return None
    dropout, scale = float(cfg.dropout_p), cfg.softmax_scale
    grads = q.requires_grad or k.requires_grad or v.requires_grad
    grad_enabled = torch.is_grad_enabled
    if layout == "bhsd":
        if native_call is flash_call:
            return lambda q, k, v: _FLASH(q, k, v, dropout, causal, False, scale=scale)[0]
        return lambda q, k, v: _CUDNN(q, k, v, None, grads and grad_enabled(), dropout, causal, False, scale=scale)[0]
    into, back = ((0, 2, 1, 3), (0, 2, 1, 3)) if fmt == "bshd" else ((1, 2, 0, 3), (2, 0, 1, 3))
    merged = (*q.shape[:2], q.shape[2] * v.shape[3])
    permute = torch.permute

    def merge(out4: torch.Tensor) -> torch.Tensor:
        out = permute(out4, back)
        try:
            return out.view(merged)  # the ops write the output in the query's memory order: a view
        except RuntimeError:
            return out.reshape(merged)

    if native_call is flash_call:
        if fmt == "bshd" and dropout == 0.0 and fa2_bshd_ok(q.device):
            fa2 = _FA2_BSHD

            def flash_bshd(q, k, v):
                return fa2(q, k, v, None, None, sq, skv, dropout, causal, False, scale=scale)[0].flatten(-2)
            return flash_bshd

        def flash(q, k, v):
            return merge(_FLASH(permute(q, into), permute(k, into), permute(v, into), dropout, causal, False,
                                scale=scale)[0])
        return flash

    def cudnn(q, k, v):
        return merge(_CUDNN(permute(q, into), permute(k, into), permute(v, into), None,
                            grads and grad_enabled(), dropout, causal, False, scale=scale)[0])
    return cudnn


def fa2_bshd_ok(device: torch.device) -> bool:
    """Whether _FA2_BSHD computes what _FLASH computes on this device: checked once per device (a causal GQA call
    of two sequences, forward and gradients, on fresh random inputs; a few ms), never while a CUDA graph is being
    captured or torch's deterministic mode is on (such a call keeps _FLASH and asks again later)."""
    ok = _FA2_BSHD_OK.get(device)
    if ok is None:
        if _FA2_BSHD is None or _FLASH is None or device.type != "cuda":
            return False
        if torch.cuda.is_current_stream_capturing() or torch.are_deterministic_algorithms_enabled():
            return False  # not now (a capture; a flag that may refuse the backward): asked again on a later bind
        ok = _FA2_BSHD_OK[device] = _check_fa2_bshd(device)
    return ok


def _check_fa2_bshd(device: torch.device) -> bool:
    try:
        # the user's RNG untouched; real tensors even under inference_mode (the check needs autograd); the ops
        # themselves compared, whatever autocast region the call came from
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            gen = torch.Generator(device=device).manual_seed(12)
            b, s, h, hkv, d = 2, 40, 4, 2, 64
            q, k, v = (torch.randn(b, s, n, d, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
                       for n in (h, hkv, hkv))
            dout = torch.randn(b, s, h, d, generator=gen, device=device, dtype=torch.bfloat16)
            new = _FA2_BSHD(q, k, v, None, None, s, s, 0.0, True, False, scale=0.125)[0]
            old = _FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, False,
                         scale=0.125)[0].transpose(1, 2)
            new_grads = torch.autograd.grad(new, (q, k, v), dout)
            old_grads = torch.autograd.grad(old, (q, k, v), dout)
        return new.shape == old.shape and torch.equal(new, old) and all(
            torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2) for a, b in zip(new_grads, old_grads))
    except Exception:  # noqa: BLE001 - any failure means: keep _FLASH
        return False


class NativeOpPath:
    """Mixin for the torch providers: their differentiable call goes through `native_call` (flash_call or
    cudnn_call) when the config allows it (cached per AttnConfig) and the call's tensors do, else through the
    engine's general path."""

    native_call = None  # set by each provider: flash_call or cudnn_call

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._native_ok: dict = {}  # AttnConfig -> static_ok(cfg): one per provider class

    def bind_fast(self, q, k, v, aux, cfg, layout: str = "merged"):
        """See bind(): this provider's native call specialised to q, k, v's signature, or None."""
        return bind(type(self).native_call, q, k, v, aux, cfg, layout)

    def __call__(self, q, k, v, aux, cfg, *, flatten_heads: bool = False):
        ok = self._native_ok.get(cfg)
        if ok is None:
            ok = self._native_ok[cfg] = static_ok(cfg, allow_bottom_right=True)
        if ok:
            result = type(self).native_call(q, k, v, aux, cfg, flatten_heads)
            if result is not None:
                return result
        return super().__call__(q, k, v, aux, cfg, flatten_heads=flatten_heads)
