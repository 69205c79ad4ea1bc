"""cp_comm_type='a2a' in FP8 (attention inside fp8_autocast with fp8_dpa=True, on cudnn_fused:fp8).

After the all-to-all each rank holds whole sequences for num_heads / P heads, so its call is one ordinary
whole-sequence FP8 call: the FP8 engine's own forward and backward pair up as on one GPU. As Transformer Engine
does (context_parallel.py AttnFuncWithCPAndQKVOA2A), q, k, v are quantized BEFORE the all-to-all and cross it as
FP8 (half the bytes of bf16); O comes back as FP8 and is dequantized after the return all-to-all; in backward dO
goes over as FP8 and dQ, dK, dV come back as FP8.

That is only correct if every rank quantizes with the same scales: the tensors a rank attends over are made of
every rank's pieces and are descaled with one factor. Hence:
- delayed scaling: scales come from the amax histories, which every rank reduces (max) over fp8.group (the
  module uses fp8_autocast's fp8_group, which must contain the CP group, else the CP group) after each step;
- current scaling: the amaxes of q, k, v (and dO) are reduced over the a2a group before the scales are taken
  (fp8.exchange_group; Transformer Engine sets with_amax_reduction on the CP group for the same reason).
A call that fails part-way (a refused graph, a failed exchange) restores the scaling state it started from.
FP8 data travels as uint8 views: collectives need not know the FP8 dtypes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..backends.base import AttnAux, AttnConfig
from ..backends.cudnn_fused_fp8 import quantize
from ..fp8 import quantize as fp8q
from .a2a import HeadSplit


class FP8A2AAttention:
    """The a2a implementation for FP8 calls; `engine` is the FP8 engine (backends.cudnn_fused_fp8) or a
    SelectedPerBlock that selects it for the whole-sequence call."""

    def __init__(self, engine: Any, cfg: AttnConfig, aux: AttnAux, split: HeadSplit, training: bool):
        fp8 = aux.extra.get("fp8")
        if fp8 is None:
            raise ValueError("FP8 context parallelism needs aux.extra['fp8'] (the module's FP8 call)")
        if cfg.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={cfg.softmax_type!r}: FP8 attention takes the vanilla softmax only")
        self.engine, self.cfg, self.aux, self.split, self.fp8, self.training = engine, cfg, aux, split, fp8, training

    def _fp8_engine(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dtype: torch.dtype):
        pick = getattr(self.engine, "engine_for", None)
        engine = pick(qh, kh, vh, self.aux, self.cfg, dtype=dtype) if pick is not None else self.engine
        if not hasattr(engine, "attend"):
            raise ValueError(f"{type(engine).__name__} is not an FP8 engine; FP8 context parallelism runs on "
                             "cudnn_fused:fp8")
        return engine

    def _heads(self, x8: torch.Tensor) -> torch.Tensor:
        return self.split.to_heads(x8.view(torch.uint8)).view(x8.dtype)

    def _seq(self, y8: torch.Tensor) -> torch.Tensor:
        return self.split.to_seq(y8.view(torch.uint8)).view(y8.dtype)

    def forward(self, q, k, v, sink):
        if sink is not None:
            raise ValueError("FP8 attention takes no softmax sink (softmax_type='vanilla' only)")
        state = self.fp8.state.to(q.device)
        before = state.snapshot()
        try:
            q8, k8, v8 = quantize(("q", "k", "v"), (q, k, v), self.fp8)
            qh, kh, vh = (self._heads(x) for x in (q8, k8, v8))
            engine = self._fp8_engine(qh, kh, vh, q.dtype)
            plan = engine.plan(qh, kh, vh, self.aux, self.cfg, self.fp8, q.dtype, self.training)
            o8, o_descale, saved = engine.attend(plan, qh, kh, vh, self.fp8, q.dtype)
        except BaseException:
            state.restore(before)
            raise
        out = fp8q.dequantize(self._seq(o8), o_descale, q.dtype)
        return out, (), (engine, saved)

    def backward(self, dout, saved_tensors, meta, sink):
        engine, saved = meta
        built = engine.backward_graph(saved, self.cfg)
        do8 = quantize(("do",), (dout.contiguous(),), self.fp8)[0]
        (dq8, dk8, dv8), descales = engine.attend_backward(built, saved, self._heads(do8), self.cfg)
        dtype = saved.dtype
        grads = tuple(fp8q.dequantize(self._seq(g), d, dtype) for g, d in zip((dq8, dk8, dv8), descales))
        return (*grads, None)
