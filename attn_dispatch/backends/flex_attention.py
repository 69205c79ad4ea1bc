"""The FlexAttention engine (flex_attention:torch): torch.nn.attention.flex_attention with a BlockMask and a score_mod
built from the call (see _flex_masks), torch.compile'd on CUDA (a copy per compiled_key), eager on the CPU (inference
only: torch has no CPU backward for it).

Gradients flow through FlexAttention's own autograd (to q, k, v and a bias tensor the score_mod reads), so this
engine is called as a differentiable function (__call__); it has no functional backward, which is why context
parallelism, whose per-block backward passes a merged out/lse, does not use it (its table says so).

A user's own modifiers arrive in AttnAux.extra: "mask_mod" (b, h, q_idx, kv_idx) -> bool, ANDed with the call's
mask, and "score_mod" (score, b, h, q_idx, kv_idx) -> score, applied after the call's bias/ALiBi/softcap. Indices
are those of the [B, H, S, S] call flex sees: for thd, B = 1 and q_idx/kv_idx are token indices of the packed tensor.
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings

import torch

from ..constraints.flex_attention import flash_kind
from ..platform import parse_version
from ..runtime_facts import record_rejection
from . import _flex_masks as masks
from .base import AttnAux, AttnConfig, BwdResult, Engine, EngineRefused, FwdResult

MASK_MOD, SCORE_MOD = masks.MASK_MOD, masks.SCORE_MOD


def _to_bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return x.transpose(1, 2)
    if fmt == "sbhd":
        return x.permute(1, 2, 0, 3)
    return x.transpose(0, 1).unsqueeze(0)  # thd: one sequence of packed tokens


def _to_layout(out4: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return out4.transpose(1, 2)
    if fmt == "sbhd":
        return out4.permute(2, 0, 1, 3)
    return out4[0].transpose(0, 1)


def _from_bhsd(out4: torch.Tensor, lse: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _to_layout(out4, fmt), (lse[0] if fmt == "thd" else lse)


def _call_flex(flex_attention, q4, k4, v4, score_mod, block_mask, scale, enable_gqa, aux_request,
               kernel_options=None, want_lse=True):
    """(out, lse) of one flex call, lse None unless want_lse; what the engine compiles (a copy of this code per
    kind of call)."""
    if not want_lse:
        out = flex_attention(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale,
                             enable_gqa=enable_gqa, kernel_options=kernel_options)
        return out, None
    if aux_request is None:  # torch < 2.9: no AuxRequest
        return flex_attention(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, return_lse=True, kernel_options=kernel_options)
    out, aux = flex_attention(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, return_aux=aux_request, kernel_options=kernel_options)
    return out, aux.lse


class FlexAttentionEngine(Engine):
    family = "flex_attention"
    provider = "torch"
    KERNEL_OPTIONS: dict | None = None  # flex's kernel_options: None lets torch pick its Triton kernels

    def __init__(self) -> None:
        try:
            from torch.nn.attention import flex_attention as flex
        except ImportError as exc:
            raise ImportError(f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5)") \
                from exc
        self.flex = flex
        request = getattr(flex, "AuxRequest", None)  # torch >= 2.9; before: return_lse=True
        self._lse_request = request(lse=True) if request is not None else None
        self._compiled: dict[tuple, object] = {}

    @staticmethod
    def compiled_key(kind: tuple, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> tuple:
        """What one compiled copy of the call serves: the kind of call (mask and score modifiers' structure), the
        grad mode, head counts, head dims and dtype: each of these, changed, costs a recompile, and a copy past
        torch.compile's recompile limit runs eagerly (masks.compiled_copy; 26-44x slower and out of memory on 8k
        packs, seen on the H200). Sequence lengths turn dynamic after one recompile (a copy holds at most 3 graphs
        however its lengths vary)."""
        return kind + (torch.is_grad_enabled(), q4.shape[1], k4.shape[1], q4.shape[-1], v4.shape[-1], q4.dtype)

    def _kernel(self, device: torch.device, key: tuple):
        """Eager flex on the CPU; on CUDA, flex compiled once per process for each compiled_key, each its own copy
        of the call's code."""
        if device.type != "cuda":
            return _call_flex
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = masks.compiled_copy(_call_flex, f"flex_attention_{self.provider}", key)
        return compiled

    def _run(self, q, k, v, aux: AttnAux, cfg: AttnConfig,
             want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        fmt = cfg.qkv_format
        q4, k4, v4 = (_to_bhsd(x, fmt) for x in (q, k, v))
        b, h, sq, _ = q4.shape
        skv = k4.shape[2]
        call = plan(self.flex, aux, cfg, b, h, sq, skv, q.device)
        kind = (cfg.qkv_format == "thd", cfg.attn_mask_type, tuple(cfg.window_size), cfg.bias_type,
                bool(cfg.softcap), MASK_MOD in aux.extra, SCORE_MOD in aux.extra, want_lse)
        kernel = self._kernel(q.device, self.compiled_key(kind, q4, k4, v4))
        aux_request = self._lse_request
        if q.device.type == "cuda":
            out4, lse = self._launch(kernel, q4, k4, v4, call, cfg, aux_request, kind)
        else:
            with warnings.catch_warnings():  # eager on the CPU is the intended path, not a missed compile
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                out4, lse = kernel(self.flex.flex_attention, q4, k4, v4, call.score_mod, call.block_mask,
                                   cfg.softmax_scale, h != k4.shape[1], aux_request, None, want_lse)
        if lse is None:
            return _to_layout(out4, fmt), None
        return _from_bhsd(out4, lse, fmt)

    def _launch(self, kernel, q4, k4, v4, call, cfg: AttnConfig, aux_request, kind: tuple):
        return kernel(self.flex.flex_attention, q4, k4, v4, call.score_mod, call.block_mask, cfg.softmax_scale,
                      q4.shape[1] != k4.shape[1], aux_request, self.KERNEL_OPTIONS, kind[-1])

    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        with torch.no_grad():
            out, lse = self._run(q, k, v, aux, cfg)
        return FwdResult(out, lse)

    def backward(self, dout, q, k, v, out, lse, state, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        raise NotImplementedError("flex_attention:torch computes gradients through FlexAttention's autograd "
                                  "(call the engine); it has no backward that takes a given out/lse")

    @staticmethod
    def _check_call(cfg: AttnConfig) -> None:
        if cfg.dropout_p > 0:
            raise ValueError(f"dropout_p={cfg.dropout_p}: FlexAttention has no dropout")
        if cfg.softmax_type != "vanilla" or cfg.return_max_logit:
            raise ValueError("flex_attention:torch supports softmax_type='vanilla' without return_max_logit")

    def __call__(self, q, k, v, aux: AttnAux, cfg: AttnConfig, *, flatten_heads: bool = False):
        self._check_call(cfg)
        out, lse = self._run(q, k, v, aux, cfg)
        return (out.flatten(-2) if flatten_heads else out), lse.detach(), None


class FlexFlashEngine(FlexAttentionEngine):
    """flex_attention:flash_attn_4: the same call, lowered by torch.compile to flash-attn-4's CuTe kernels
    (kernel_options BACKEND='FLASH'; torch >= 2.11 with flash-attn-4 installed). A kind of call the lowering
    refuses at compile time is recorded (its table's compile_refused check) and raised as EngineRefused, so that
    selection moves on to flex_attention:torch."""

    provider = "flash_attn_4"
    KERNEL_OPTIONS = {"BACKEND": "FLASH"}

    def __init__(self) -> None:
        super().__init__()
        import flash_attn.cute  # noqa: F401, PLC0415 - lazy: the package is optional; a failure is a load failure
        self._lse_scaled_by_ln2 = flash_lse_scaled_by_ln2(self.flex)

    def _run(self, q, k, v, aux: AttnAux, cfg: AttnConfig,
             want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = super()._run(q, k, v, aux, cfg, want_lse)
        return out, (lse / _LN2 if lse is not None and self._lse_scaled_by_ln2 else lse)

    def _launch(self, kernel, q4, k4, v4, call, cfg: AttnConfig, aux_request, kind: tuple):
        try:
            return super()._launch(kernel, q4, k4, v4, call, cfg, aux_request, kind)
        except torch.cuda.OutOfMemoryError:
            raise  # memory, not a refusal of this kind of call
        except Exception as exc:  # noqa: BLE001 - the call's inputs were checked before (plan); what the lowering
            # raises comes in many types (ValueError from the CuTe DSL, NotImplementedError, dynamo's wrappers)
            training = torch.is_grad_enabled() and any(x.requires_grad for x in (q4, k4, v4))
            signature = flash_kind(kind[0], cfg.attn_mask_type, cfg.window_size, cfg.bias_type, bool(cfg.softcap),
                                   kind[5], kind[6], training, (q4.shape[-1], v4.shape[-1]),
                                   str(q4.dtype).removeprefix("torch."))
            message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            record_rejection(signature, message)
            raise EngineRefused(f"FlexAttention's BACKEND='FLASH' refused this call: {message}") from None

    def __call__(self, q, k, v, aux: AttnAux, cfg: AttnConfig, *, flatten_heads: bool = False):
        """A training call asks for no LSE (lse None): the FLASH backward cannot differentiate through one, and
        flex's autograd sends it a gradient slot whenever the LSE is an output of the graph."""
        training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        if not training:
            return super().__call__(q, k, v, aux, cfg, flatten_heads=flatten_heads)
        self._check_call(cfg)
        out, _ = self._run(q, k, v, aux, cfg, want_lse=False)
        return (out.flatten(-2) if flatten_heads else out), None, None


_LN2 = math.log(2.0)


def flash_lse_scaled_by_ln2(flex) -> bool:
    """Whether this torch's flex_attention returns the FLASH lowering's LSE times ln(2): its finalizer took every
    backend's statistics as base 2, and flash-attn-4's are natural logs (pytorch/pytorch#181645, fixed by #181824;
    measured on torch 2.11 on the H200: 0.693x float32's LSE). The fix made that conversion conditional
    (`stats_are_log2`, in torch 2.13's flex_attention.py)."""
    version = parse_version(torch.__version__)
    if version is not None and version.release[:2] >= (2, 13):
        return False
    try:
        return "stats_are_log2" not in inspect.getsource(flex)
    except (OSError, TypeError):  # no source shipped: the version alone
        return True


class _Call:
    __slots__ = ("block_mask", "score_mod", "blocks")

    def __init__(self, block_mask, score_mod, blocks):
        self.block_mask, self.score_mod, self.blocks = block_mask, score_mod, blocks


def plan(flex, aux: AttnAux, cfg: AttnConfig, b: int, h: int, sq: int, skv: int, device: torch.device) -> _Call:
    """The call's BlockMask (cached per structure) and score_mod (a closure over this call's tensors)."""
    frame = masks.frame_for(aux, cfg, sq, skv)
    mask4 = None
    if cfg.attn_mask_type == "arbitrary":
        if aux.attention_mask is None:
            raise ValueError("attn_mask_type='arbitrary' needs aux.attention_mask (bool, True = masked out)")
        if aux.attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask has dtype {aux.attention_mask.dtype}; it must be torch.bool "
                             "(True = masked out)")
        mask4 = masks.as_4d("attention_mask", aux.attention_mask, b, h, sq, skv)
    user_mask = masks.user_mod(aux, MASK_MOD, device)
    user_score = masks.user_mod(aux, SCORE_MOD, device)
    score_mod = masks.score_mod_for(frame, aux, cfg, b, h, sq, skv, user_score)
    mask_mod = masks.mask_mod_for(frame, cfg, mask4, user_mask)
    if mask_mod is None:
        return _Call(None, score_mod, None)
    info = masks.block_info(flex, frame, cfg, aux.attention_mask if mask4 is not None else None, mask4, user_mask,
                            mask_mod, b, h, sq, skv, device)
    block_mask = copy.copy(info.block_mask)  # the cached blocks, with this call's mask_mod
    block_mask.mask_mod = mask_mod
    return _Call(block_mask, score_mod, info)


def describe_mask(mask: torch.Tensor, batch: int, heads: int, sq: int, skv: int) -> str:
    """How FlexAttention sees a bool mask (True = masked out, Transformer Engine's convention): the share of
    128x128 blocks it skips, or that a fully dense mask gives it no sparsity to skip. Cached with the BlockMask."""
    from torch.nn.attention import flex_attention as flex

    cfg = AttnConfig(attn_mask_type="arbitrary")
    aux = AttnAux(attention_mask=mask)
    call = plan(flex, aux, cfg, batch, heads, sq, skv, mask.device)
    return call.blocks.describe()
