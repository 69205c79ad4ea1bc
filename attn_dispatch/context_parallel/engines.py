"""The per-block engine: each block call goes to the provider selection.select picks for that block's own
AttentionParams, the same selection and default policy as a single-GPU call of that shape."""
from __future__ import annotations

from typing import Any

import torch

from .. import selection
from ..backends import get_engine
from ..backends.base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult
from ..params import AttentionParams


class SelectedPerBlock(Engine):
    """An Engine that dispatches every call through selection (cached per block signature). `choices` maps each
    block description to the provider that ran it, for explanations and benchmarks."""

    family, provider = "per_block", "selection"

    def __init__(self, *, force: str | None = None, is_training: bool = True, platform=None, env=None,
                 fp8_recipe: str | None = None):
        self.force, self.is_training, self.platform, self.env = force, is_training, platform, env
        self.fp8_recipe = fp8_recipe  # FP8 calls: the recipe kind ('delayed' / 'current'), as selection sees it
        self._engines: dict[tuple, Engine] = {}
        self.choices: dict[str, str] = {}

    def block_params(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                     cfg: AttnConfig, dtype: torch.dtype | None = None) -> AttentionParams:
        """dtype: the call's dtype where q, k, v are its FP8 data (FP8 a2a quantizes before the exchange)."""
        fmt = cfg.qkv_format
        if fmt == "thd":
            batch = aux.cu_seqlens_q.numel() - 1
            sq, skv = aux.max_seqlen_q, aux.max_seqlen_kv
        else:
            seq = 1 if fmt == "bshd" else 0
            batch, sq, skv = q.shape[1 - seq], q.shape[seq], k.shape[seq]
        fp8 = dict(fp8=True, fp8_recipe=self.fp8_recipe) if self.fp8_recipe is not None else {}
        return AttentionParams(
            dtype=dtype or q.dtype, qkv_format=fmt, batch_size=batch, num_heads=q.shape[-2],
            num_gqa_groups=k.shape[-2], head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=max(sq, 1),
            max_seqlen_kv=max(skv, 1),
            attn_mask_type=cfg.attn_mask_type, window_size=tuple(cfg.window_size), softmax_type=cfg.softmax_type,
            is_training=self.is_training, deterministic=cfg.deterministic,
            device_type="cuda" if q.device.type == "cuda" else q.device.type, cp_block=True, **fp8)

    def engine_for(self, q, k, v, aux: AttnAux, cfg: AttnConfig, dtype: torch.dtype | None = None) -> Engine:
        key = (q.shape, k.shape, v.shape, dtype or q.dtype, q.device.type, aux.max_seqlen_q, aux.max_seqlen_kv,
               None if aux.cu_seqlens_q is None else aux.cu_seqlens_q.numel(), cfg)
        engine = self._engines.get(key)
        if engine is None:
            params = self.block_params(q, k, v, aux, cfg, dtype)
            decision = selection.select(params, self.platform, self.env, force=self.force)
            engine = self._engines[key] = get_engine(decision.chosen)
            self.choices[params.describe()] = decision.chosen
        return engine

    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        engine = self.engine_for(q, k, v, aux, cfg)
        res = engine.forward(q, k, v, aux, cfg)
        return res._replace(state=(engine, res.state))

    def backward(self, dout, q, k, v, out, lse, state: Any, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        engine, inner = state
        return engine.backward(dout, q, k, v, out, lse, inner, aux, cfg)
