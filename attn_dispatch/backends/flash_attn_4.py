"""flash-attn-4 (`flash_attn.cute`, CuTe DSL kernels for Hopper sm90 and Blackwell sm100/sm110), called directly.

We call `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd` (the functions its own autograd Functions
wrap), so that backward accepts a global out/lse for context parallelism. torch 2.11's FA4 registration
(`torch.nn.attention.activate_flash_attention_impl("FA4")`) is not used: with flash-attn-4 4.0.0b36 it fails,
because `_flash_attn_fwd` now returns 5 values where torch unpacks 2.

Written against flash-attn-4 4.0.0b36 (flash_attn/cute/interface.py):
- `_flash_attn_fwd(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, softmax_scale=, causal=,
  window_size_left=, window_size_right=, learnable_sink=, num_splits=, return_lse=, out=)` returns
  (out, lse, p, row_max, o_lo); windows use None for unbounded; causal and windows align bottom-right
  (mask.py: causal_row_offset = seqlen_k - seqlen_q); an empty row gets lse -inf (or the sink) and out 0.
- `_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=, ..., cu_seqlens_q=,
  ..., deterministic=, learnable_sink=)` returns (dq, dk, dv) or (dq, dk, dv, dsink) with a sink.
- `softcap` (both): logit soft-capping, applied after the softmax scale (a score_mod pair, utils.py
  create_softcap_scoremod[_bwd]); forward takes None for off, backward 0.0.
- `learnable_sink`: [h] float16/bfloat16/float32, a logit in natural-log units not multiplied by the softmax
  scale: exp(S_i) / (exp(sink) + sum exp(S)), Transformer Engine's 'learnable' softmax.
Importing flash_attn.cute takes ~10 s (done on the engine's first use); each new kernel configuration is
JIT-compiled on first use (~2-3 s, forward and backward separately) and then cached in-process. The engine
records those compilations in `jit_events`. Repeat dense forwards and backwards of one signature replay the compiled
launches without the interface's Python (_fa4_replay.py: recorded on the first call, checked against the interface
on the second; ATTN_DISPATCH_FA4_REPLAY=0 turns it off).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..constraints import flash_attn_4_sm90 as sm90
from ..constraints.flash_attn_4 import paged_loader_problem
from ._fa4_replay import Replays
from ._flash_io import UNBOUNDED, FlashEngineBase, KernelCall, Varlen


def _fa4_window(window: tuple[int, int]) -> tuple[int | None, int | None]:
    # FA4 takes None for an unbounded side; -1 would turn (-1, 0) into a 'local' window, not causal.
    return tuple(None if w == UNBOUNDED else int(w) for w in window)  # type: ignore[return-value]


class FlashAttn4Engine(FlashEngineBase):
    family = "flash_attn_4"
    provider = "cute"
    supports_sink = True
    supports_softcap = True
    takes_out_buffer = True

    def __init__(self) -> None:
        from flash_attn.cute import interface  # ~10 s: cutlass DSL and the kernel modules

        self._iface = interface
        self.jit_events: list[dict[str, Any]] = []

    # --- JIT bookkeeping: a call that grows a compile cache compiled a kernel ------------------------------
    _JIT_CACHE_OWNERS = ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert",
                         "_flash_attn_fwd_combine")

    def _jit_caches(self) -> list:
        """The interface's compile-cache dicts, looked up once per interface (two calls a step would otherwise pay
        ~15 us each for the attribute walk): JITCache keeps one dict and clears it in place (cache_utils.py)."""
        found = self.__dict__.get("_jit_cache_dicts")
        if found is None or found[0] is not self._iface:
            dicts = []
            for name in self._JIT_CACHE_OWNERS:
                cache = getattr(getattr(self._iface, name, None), "compile_cache", None)
                inner = getattr(cache, "cache", cache)
                if hasattr(inner, "__len__"):
                    dicts.append(inner)
            found = self.__dict__["_jit_cache_dicts"] = (self._iface, dicts)
        return found[1]

    def _compiled_kernels(self) -> int:
        return sum(map(len, self._jit_caches()))

    def _timed(self, phase: str, fn, *args, **kwargs):
        before = self._compiled_kernels()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        added = self._compiled_kernels() - before
        if added > 0:
            self.jit_events.append({"phase": phase, "seconds": time.perf_counter() - start, "kernels": added,
                                    "head_dim": args[0].shape[-1], "head_dim_v": args[2].shape[-1]})
        return result

    # --- sm90: head dims its kernels cannot run (or run wrongly) are refused before launch -------------------
    def _is_sm90(self) -> bool:
        return self._iface._get_device_arch() // 10 == 9  # the arch flash-attn-4 picks its kernels for (cached)

    def _refuse(self, problem: tuple[str, str] | None) -> None:
        if problem is not None:
            raise ValueError(f"{problem[0]}; {problem[1]}")

    def _resolve(self, q, k, v, aux, cfg) -> KernelCall:
        call = super()._resolve(q, k, v, aux, cfg)
        if self._is_sm90():
            d, dv = q.shape[-1], v.shape[-1]
            self._refuse(sm90.forward_problem(d, dv, call.window))
            if q.requires_grad or k.requires_grad or v.requires_grad:  # training: refuse now, not after forward
                self._refuse(sm90.backward_problem(d, dv, call.window, q.shape[-2] // k.shape[-2]))
        return call

    # --- kernels -------------------------------------------------------------------------------------------
    def _kernel_fwd(self, q, k, v, varlen: Varlen | None, call: KernelCall, out: torch.Tensor | None):
        left, right = _fa4_window(call.window)
        kwargs: dict[str, Any] = dict(softmax_scale=call.scale, causal=False, softcap=call.softcap or None,
                                      window_size_left=left, window_size_right=right, learnable_sink=call.sink,
                                      num_splits=1, return_lse=True, out=out)
        if varlen is not None:
            kwargs.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)

        def interface(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return self._timed("fwd", self._iface._flash_attn_fwd, q, k, v,
                               **{**kwargs, "out": tensors.get("out")})[:2]

        inputs = {"q": q, "k": k, "v": v} if out is None else {"q": q, "k": k, "v": v, "out": out}
        replays = self._replays("fwd")
        if not self._replayable(replays, varlen, call):
            return (*interface(inputs), None)
        return (*replays((call.scale, left, right), inputs, interface), None)

    @staticmethod
    def _replayable(replays: Replays, varlen: Varlen | None, call: KernelCall) -> bool:
        """The replay's scope: dense calls (no cu_seqlens) without a sink or softcap."""
        return replays.enabled and varlen is None and call.sink is None and not call.softcap

    def _replays(self, kind: str) -> Replays:
        """The replays of this engine's interface for 'fwd' or 'bwd' calls (made on first use, like _jit_caches)."""
        found = self.__dict__.setdefault("_replays_by_kind", {})
        replays = found.get(kind)
        if replays is None or replays.iface is not self._iface:
            owner, results = {"fwd": ("_flash_attn_fwd", ("out", "lse")),
                              "bwd": ("_flash_attn_bwd", ("dq", "dk", "dv"))}[kind]
            replays = found[kind] = Replays(self._iface, owner, results)
        return replays

    # --- KV-cache inference: the cache is read in place -------------------------------------------------------
    def forward_kv_cache(self, q, cache, cu_seqlens_q, max_seqlen_q, cfg):
        """_flash_attn_fwd reads the cache where it lies: a contiguous cache as k/v [b, rows, h_k, d] with seqused_k
        live tokens per row, a paged one as the page pool with page_table (and seqused_k; it takes no cu_seqlens_k
        with a page table). GQA heads are packed into the query tile (pack_gqa). Split-KV: num_splits=0 lets its
        heuristic split the keys where batch x kv heads leave SMs idle (sm100/sm110); sm90 has no split-KV kernel
        ('SplitKV not supported on SM 9.0'), so there every step runs one CTA per (sequence, kv head)."""
        d, dv, window = q.shape[-1], cache.v.shape[-1], tuple(cfg.window_size)
        sm90_arch = self._is_sm90()
        if sm90_arch:
            self._refuse(sm90.forward_problem(d, dv, window))
        if cache.page_table is not None:
            problem = paged_loader_problem(cache.page_size, d, dv, window, self._iface._get_device_arch() // 10)
            if problem is not None:
                raise ValueError(problem)
        left, right = _fa4_window(window)
        kwargs: dict[str, Any] = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                      seqused_k=cache.seqlens_kv, max_seqlen_k=cache.max_seqlen_kv,
                                      softmax_scale=cfg.softmax_scale, causal=False, window_size_left=left,
                                      window_size_right=right, num_splits=1 if sm90_arch else 0)
        if cache.page_table is None:
            k, v = cache.k[:cache.batch], cache.v[:cache.batch]  # views: sequence i is row i
        else:
            k, v = cache.k, cache.v
            kwargs["page_table"] = cache.page_table
        return self._timed("fwd", self._iface._flash_attn_fwd, q, k, v, **kwargs)[0]

    def _kernel_bwd(self, dout, q, k, v, out, lse, kernel_state, varlen: Varlen | None, call: KernelCall):
        if self._is_sm90():  # the functional path (context parallelism) may run a forward without grad first
            self._refuse(sm90.backward_problem(q.shape[-1], v.shape[-1], call.window, q.shape[-2] // k.shape[-2]))
        left, right = _fa4_window(call.window)
        kwargs: dict[str, Any] = dict(window_size_left=left, window_size_right=right, deterministic=call.deterministic)
        if call.sink is not None:
            kwargs["learnable_sink"] = call.sink
        if varlen is not None:
            kwargs.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_kv,
                          max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_kv)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        lse = lse.contiguous()

        def interface(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return self._timed("bwd", self._iface._flash_attn_bwd, q, k, v, out, dout, lse, call.scale, False,
                               call.softcap, **kwargs)

        replays = self._replays("bwd")
        if not self._replayable(replays, varlen, call):
            result = interface({})
            dsink = result[3] if call.sink is not None and len(result) > 3 else None
            return result[0], result[1], result[2], dsink
        inputs = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}
        dq, dk, dv = replays((call.scale, left, right, call.deterministic), inputs, interface,
                             deterministic=call.deterministic)
        return dq, dk, dv, None
