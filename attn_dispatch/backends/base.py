"""The engine interface every backend implements, and the autograd glue shared by all of them.

Conventions (all engines):
- q, k, v arrive in the call's qkv_format with a separate heads dim: bshd [b, s, h, d], sbhd [s, b, h, d],
  thd [t, h, d]. The output has the same format with head dim d_v (the module flattens heads).
- lse is the natural-log log-sum-exp of the scaled (and biased) scores over the keys a row attends to,
  float32: [b, h, sq] for bshd/sbhd, [h, t_q] for thd. With softmax_type 'off-by-one'/'learnable' the sink
  term is included. A fully masked row has lse = -inf and output 0 (never NaN).
- Engines expose a functional forward/backward pair so that context parallelism can call them per block,
  and backward accepts a global (merged) out/lse, as FlashAttention's backward does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ..env import PRIVATE_TORCH


@dataclass(frozen=True)
class AttnConfig:
    """Static description of a call; hashable, so engines may key compiled graphs/kernels on it."""

    qkv_format: str = "bshd"
    attn_mask_type: str = "no_mask"
    window_size: tuple[int, int] = (-1, -1)  # already normalised (causal => right == 0)
    softmax_scale: float = 1.0
    dropout_p: float = 0.0
    bias_type: str = "no_bias"       # no_bias | pre_scale_bias | post_scale_bias | alibi
    softmax_type: str = "vanilla"    # vanilla | off-by-one | learnable
    deterministic: bool = False
    return_max_logit: bool = False
    softcap: float = 0.0             # scores -> softcap * tanh(scores / softcap) after scaling; 0 is off


@dataclass(frozen=True)
class PackedFacts:
    """What validation (inputs.py) read on the host from a thd call's cu_seqlens, so that engines can skip the
    clean-up kernels it shows to be no-ops. Given only where the sequences are packed back to back (no padded
    offsets with gaps between them; padded offsets equal to cu_seqlens may be given). Callers that did not check
    leave AttnAux.packed None: every engine then cleans up as if rows outside the sequences and rows without keys
    existed."""

    end_q: int          # cu_seqlens_q[-1]: q rows from here on belong to no sequence (the kernels leave them)
    end_kv: int         # cu_seqlens_kv[-1]
    keyless_rows: bool  # some query row of a sequence sees no key under the call's mask and window


@dataclass
class AttnAux:
    """Per-call tensors and sizes besides q, k, v."""

    cu_seqlens_q: torch.Tensor | None = None         # int32 [b+1], real tokens (thd / padding masks)
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None  # int32 [b+1], where each sequence starts in a thd tensor
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_kv: int = 0
    attention_mask: torch.Tensor | None = None  # bool, True = masked out (Transformer Engine's convention)
    bias: torch.Tensor | None = None            # [1|b, 1|h, sq, skv]
    alibi_slopes: torch.Tensor | None = None     # fp32 [h] or [b, h]
    softmax_offset: torch.Tensor | None = None   # fp32 [h]: the learnable sink logit
    dropout_generator: torch.Generator | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    packed: PackedFacts | None = None            # thd host facts; None: unknown (clean up everything)


class FwdResult(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    state: Any = None  # what the engine keeps for backward (e.g. a dropout seed/offset)
    max_logit: torch.Tensor | None = None  # [h] when cfg.return_max_logit


class BwdResult(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None = None
    dsoftmax_offset: torch.Tensor | None = None


class KVCacheView(NamedTuple):
    """The keys/values a KV-cache inference step attends to (see attn_dispatch.kv_cache). Rows are the step's
    sequences in batch order; every length already counts this step's new tokens.

    contiguous: k, v are [capacity, page_size, hkv, d] and sequence i lives in row i (page_size = the cache's
    max_sequence_length); paged: k, v are page pools [pages, page_size, hkv, d] and page_table[i] lists sequence
    i's pages in order."""

    k: torch.Tensor
    v: torch.Tensor
    seqlens_kv: torch.Tensor      # int32 [b], cached tokens per sequence
    cu_seqlens_kv: torch.Tensor   # int32 [b + 1], their running sum
    max_seqlen_kv: int            # max(seqlens_kv), known on the host
    page_size: int
    page_table: torch.Tensor | None = None  # int32 [b, pages per sequence]; None for a contiguous cache

    @property
    def batch(self) -> int:
        return self.seqlens_kv.shape[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as [b, max_seqlen_kv, hkv, d]: views of a contiguous cache, a gather of a paged one."""
        b, length = self.batch, self.max_seqlen_kv
        if self.page_table is None:
            return self.k[:b, :length], self.v[:b, :length]
        pages = -(-length // self.page_size)
        table = self.page_table[:b, :pages]
        return tuple(x[table].flatten(1, 2)[:, :length] for x in (self.k, self.v))


class Engine:
    """Base class. Subclasses set family/provider and implement forward/backward."""

    family: str = ""
    provider: str = ""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        raise NotImplementedError

    def forward_flat(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                     cfg: AttnConfig) -> FwdResult:
        """forward, with out's last two dims merged ([..., h * d_v], what DotProductAttention returns). Engines
        that allocate their own output override this to allocate that shape directly: the view costs host time
        on every call."""
        out, lse, state, max_logit = self.forward(q, k, v, aux, cfg)
        return FwdResult(out.flatten(-2), lse, state, max_logit)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, state: Any, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        raise NotImplementedError

    def forward_kv_cache(self, q: torch.Tensor, cache: KVCacheView, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                         cfg: AttnConfig) -> torch.Tensor:
        """One KV-cache inference step: q is thd [t, h, d] (cu_seqlens_q: the step's new tokens per sequence),
        attending bottom-right to the cache; returns thd [t, h, d_v]. This default runs the engine's own padded
        bshd path on cache.dense() (no copy for a contiguous cache); engines with a native cache kernel override
        it. cfg.qkv_format is 'thd' and cfg.attn_mask_type a padding mask."""
        k4, v4 = cache.dense()
        b, t = cache.batch, q.shape[0]
        rows, cols = _thd_positions(cu_seqlens_q, b, max_seqlen_q, t)
        q4 = q.new_zeros(b, max_seqlen_q, *q.shape[1:])
        q4[rows, cols] = q
        aux = AttnAux(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cache.cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                      max_seqlen_kv=cache.max_seqlen_kv)
        out4 = self.forward(q4, k4, v4, aux, dataclasses.replace(cfg, qkv_format="bshd")).out
        return out4[rows, cols]

    def bind_fast(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
                  layout: str = "merged") -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A function (q, k, v) -> out (heads merged) specialised to calls whose tensors match these in shape,
        strides, dtype, device and requires_grad, for the module's cached path; layout="bhsd": [b, h, s, d] tensors
        in and out (the SDPA function's); None (here): call the engine."""
        return None

    def bind_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                    cfg: AttnConfig) -> Callable[..., torch.Tensor] | None:
        """For the SDPA function's [b, h, s, d] tensors (cfg describing their bshd views): an inference call whose
        one per-call tensor is an 'arbitrary' bool mask (aux.attention_mask, True = masked out). A function
        (q, k, v, mask) -> [b, h, sq, d_v] that serves every call whose q matches this one (shape, strides, dtype,
        device), whose k and v match these but for the keys' length (and the strides that follow from it), and
        whose mask is a bool tensor of this one's shape but for its last dim, the keys' length: what it derives
        from a mask it derives per mask tensor and version (a decode step's new mask, read by nothing on the host).
        The caller keeps the length within the range its plan was decided for. None (here): no such call."""
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig, *,
                 flatten_heads: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Differentiable attention: (out, lse, max_logit). Gradients flow to q, k, v, bias and the sink.
        flatten_heads=True returns out with its last two dims merged ([..., h * d_v], what DotProductAttention
        returns), taken inside the autograd wrapper so that no separate view node is recorded."""
        bias, offset = aux.bias, aux.softmax_offset
        if not torch.is_grad_enabled():
            # Nothing to record: the autograd wrapper would only cost host time (its forward runs without grad too).
            out, lse, _, max_logit = (self.forward_flat if flatten_heads else self.forward)(q, k, v, aux, cfg)
            return out, lse, max_logit
        if not (q.requires_grad or k.requires_grad or v.requires_grad or (bias is not None and bias.requires_grad)
                or (offset is not None and offset.requires_grad)):
            with torch.no_grad():  # as inside the wrapper: no graph through any other aux tensor either
                out, lse, _, max_logit = (self.forward_flat if flatten_heads else self.forward)(q, k, v, aux, cfg)
            return out, lse, max_logit
        if _RAW_APPLY is None or torch._C._are_functorch_transforms_active():
            return _EngineFunction.apply(self, aux, cfg, flatten_heads, q, k, v, bias, offset)
        # Function.apply's Python layer binds no defaults here (no setup_context) and only unwraps dead functorch
        # wrappers: done for the tensors directly, it saves a few microseconds per call.
        return _RAW_APPLY(self, aux, cfg, flatten_heads, _unwrap(q), _unwrap(k), _unwrap(v),
                          None if bias is None else _unwrap(bias), None if offset is None else _unwrap(offset))


def takes_cached_path(aux: AttnAux, cfg: AttnConfig, mask_kept: bool = False) -> bool:
    """Whether DotProductAttention's cached path serves repeat q, k, v-only calls of this aux and config (calling
    the engine's bind_fast where it gives a function): only where aux holds nothing drawn or read per call (no
    dropout seed, cu_seqlens, mask, bias or extras). The measured policy's timed step asks too, so that tuning runs
    what the module's repeat calls run. mask_kept: the caller keys the cached call by its mask tensor (identity and
    version), so a mask is allowed."""
    return (cfg.dropout_p == 0.0 and cfg.bias_type == "no_bias" and aux.cu_seqlens_q is None
            and (mask_kept or aux.attention_mask is None) and not aux.extra)


def _thd_positions(cu: torch.Tensor, batch: int, max_len: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in a padded [batch, max_len] layout of each of the total tokens of a thd tensor."""
    lengths = (cu[1:] - cu[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(batch, device=cu.device), lengths, output_size=total)
    cols = torch.arange(total, device=cu.device) - cu[:-1].long()[rows]
    return rows, cols


class _EngineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine: Engine, aux: AttnAux, cfg: AttnConfig, flatten_heads: bool, q, k, v, bias,
                softmax_offset):  # noqa: D401
        out, lse, state, max_logit = (engine.forward_flat if flatten_heads else engine.forward)(q, k, v, aux, cfg)
        ctx.engine, ctx.aux, ctx.cfg, ctx.state = engine, aux, cfg, state
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # lse and max_logit take no gradient: no zero tensors for them
        if max_logit is not None:
            ctx.mark_non_differentiable(lse, max_logit)
        else:
            ctx.mark_non_differentiable(lse)
        return out, lse, max_logit

    @staticmethod
    def backward(ctx, dout, _dlse, _dmax_logit):
        if dout is None:  # out took no gradient (only possible with materialisation off)
            return (None,) * 9
        q, k, v, out, lse = ctx.saved_tensors
        if out.dim() != q.dim():  # flatten_heads: out and its gradient are [..., h * d_v]
            out = out.unflatten(-1, (q.shape[-2], -1))
            dout = dout.reshape(out.shape)
        grads = ctx.engine.backward(dout.contiguous() if not dout.is_contiguous() else dout,
                                    q, k, v, out, lse, ctx.state, ctx.aux, ctx.cfg)
        aux = ctx.aux
        dbias = grads.dbias if aux.bias is not None and aux.bias.requires_grad else None
        dsink = grads.dsoftmax_offset if aux.softmax_offset is not None and aux.softmax_offset.requires_grad else None
        return None, None, None, None, grads.dq, grads.dk, grads.dv, dbias, dsink


def _raw_apply():
    """torch's C-level Function.apply bound to _EngineFunction, or None where this torch lays it out otherwise."""
    try:
        if torch.autograd.function._is_setup_context_defined(_EngineFunction.setup_context):
            return None
        raw = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EngineFunction)
        from torch._C._functorch import unwrap_if_dead
    except (AttributeError, KeyError, ImportError):
        return None
    global _unwrap
    _unwrap = unwrap_if_dead
    return raw


_unwrap = None
_RAW_APPLY = _raw_apply() if PRIVATE_TORCH else None


class EngineRefused(RuntimeError):
    """The engine's own build step (a cuDNN graph, a FlexAttention compile) refused a call its table let through.
    The engine records the refusal as a runtime fact before raising, so selecting again moves on to another."""


class EngineUnavailableError(RuntimeError):
    """An engine's package failed to load at run time (the platform probe saw it, but the import broke)."""
