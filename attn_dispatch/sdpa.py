"""`scaled_dot_product_attention`: torch SDPA's signature and semantics, dispatched through the same decision as
`DotProductAttention` (same tables, policy, explanations and errors).

Translation to Transformer Engine's terms (the module's forward):
- [b, h, s, d] tensors become bshd views (no copy); the engine's output comes back as a [b, h, sq, d_v] view,
  heads never merged (merging them, as the module's forward does, would copy a [b, h, s, d] result both ways).
- `is_causal` is SDPA's top-left diagonal: Transformer Engine's 'causal'.
- A float `attn_mask` is added to the scaled scores: a post-scale bias [1|b, 1|h, sq, skv] (cuDNN fuses it).
- A bool `attn_mask` (True = take part, the opposite of Transformer Engine's convention) that is exactly a causal
  pattern (top-left or bottom-right, shared by every batch and head) runs as that mask type; one packed row whose
  mask is causal within consecutive segments (what a flattening collator gives) runs as thd with those segments'
  cu_seqlens ('padding_causal'); a padding or sliding-window pattern (attn_dispatch.mask_patterns: key padding,
  with or without a causal diagonal and a sliding window, right or left padded, decode steps over a padded cache)
  runs as 'padding' /
  'padding_causal' / 'padding_causal_bottom_right' with its lengths (bshd; thd views with offsets where keys start
  inside the row), exact on every row. So the fused engines take them. Any other bool mask is 'arbitrary'
  (True = masked out, inverted here), and explain_sdpa's `notes` say why. Recognising a pattern runs a few
  reductions over the mask on its device and one host sync; the verdict is cached per mask tensor and version,
  and `recognize_masks=False` skips it. `recognize_masks` may also be a function (query, key, value, attn_mask,
  dropout_p, scale, enable_gqa, softcap) -> bool, asked only when a bool mask is translated (once per mask tensor
  and version, not once per layer): the transformers integration's choice of a decode step's reading.
- A row every key of which is masked out returns 0, as torch's SDPA does.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from .call_args import QKV_ONLY, CallArgs
from .decision import Decision
from .document_masks import documents
from .freshness import current_stamp
from .tensor_cache import cached_on
from .mask_patterns import NotRecognised, PaddingLayout, recognise_padding
from . import question, selection
from .module import DotProductAttention

# (h, h_kv, d_qk, d_v, scale, dropout, softcap, mask type, mask_mod, score_mod) -> DotProductAttention
_MODULES: dict[tuple, Any] = {}


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                                 recognize_masks: bool | Callable[..., bool] = True, softcap: float = 0.0,
                                 mask_mod=None, score_mod=None) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on [b, h, s, d] tensors. Our extensions:
    `softcap` (0 = off) caps the scaled logits at softcap * tanh(x / softcap), as Gemma 2 does; `mask_mod`
    ((b, h, q_idx, kv_idx) -> bool, ANDed with the mask) and `score_mod` ((score, b, h, q_idx, kv_idx) -> score)
    are FlexAttention's modifiers, which only the flex_attention engine runs."""
    module, _, args, _, packed, layout, module_reads = _translation(query, key, value, attn_mask, dropout_p,
                                                                    is_causal, scale, enable_gqa, recognize_masks,
                                                                    softcap, mask_mod, score_mod)
    if module_reads:  # a self-attention mask the module may read (causal documents, prefix-LM): its forward's path
        out = module._forward_args(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), args)
        return out.unflatten(-1, (query.shape[1], -1)).transpose(1, 2)
    if packed is not None:  # one packed row: thd with the sequences' own lengths (fused engines take it)
        return varlen_attention(query, key, value, packed, dropout_p, scale, enable_gqa, softcap=softcap)
    if layout is not None:  # keys (and queries) starting inside the row: thd views with offsets
        q, k, v = _thd_views(query, key, value, layout)
        out = module(q, k, v, qkv_format="thd", **_thd_kwargs(layout))  # [t, h * d_v], t = b * sq - q_skip
        if layout.q_skip:
            out = F.pad(out, (0, 0, layout.q_skip, 0))  # rows before the first sequence: fully masked, 0
        b, h, sq = query.shape[:3]
        return out.view(b, sq, h, -1).transpose(1, 2)
    # the engine's call bound to these [b, h, s, d] tensors, once planned: a plain causal / no-mask call's, or
    # (the same CallArgs object: the other layers of a decode step) a bool mask's
    out = module._attend_bhsd(query, key, value, args)
    if out is not None:
        return out
    out = module._attend_unmerged(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), args,
                                  bhsd=(query, key, value))
    return out.transpose(1, 2)  # [b, h, sq, d_v]: no copy where the engine wrote that order


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     dropout_p: float = 0.0, scale: float | None = None, enable_gqa: bool = False,
                     window_left: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention within each of the packed sequences of one [1, h, t, d] row (int32 `cu_seqlens` [n+1]):
    thd with the sequences' own lengths, as a flattening collator's batch means it; `window_left` keys before each
    query at most (a sliding window). Returns [1, h, t, d_v]."""
    module, _ = _translate(query, key, value, None, dropout_p, False, scale, enable_gqa, False, softcap)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [t, h, d] views
    out = module(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu_seqlens,
                 cu_seqlens_kv=cu_seqlens, window_size=None if window_left is None else (window_left, 0))
    return out.view(1, q.shape[0], q.shape[1], -1).transpose(1, 2)


def explain_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, *, recognize_masks: bool | Callable[..., bool] = True,
                 softcap: float = 0.0, mask_mod=None, score_mod=None) -> Decision:
    """The Decision scaled_dot_product_attention would act on for these arguments, without running it; its `notes`
    say how a bool mask was read (the pattern recognised, or why it stays 'arbitrary')."""
    module, kwargs, args, note, packed, layout, module_reads = _translation(query, key, value, attn_mask, dropout_p,
                                                                           is_causal, scale, enable_gqa,
                                                                           recognize_masks, softcap, mask_mod,
                                                                           score_mod)
    if packed is not None:
        decision = module.explain(*(x[0].transpose(0, 1) for x in (query, key, value)), qkv_format="thd",
                                  attn_mask_type="padding_causal", cu_seqlens_q=packed, cu_seqlens_kv=packed)
    elif layout is not None:
        decision = module.explain(*_thd_views(query, key, value, layout), qkv_format="thd", **_thd_kwargs(layout))
    elif module_reads or args.attention_mask is None:
        decision = module.explain(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **kwargs)
    else:  # forward hands the mask to the engine as it is (_attend_unmerged): asked without the module's readings
        asked = question.ask(module, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), args,
                             read_masks=False)
        decision = selection.explain(asked.params, force=module.backend, policy=module.policy).with_notes(*asked.notes)
    return decision if note is None else decision.with_notes(note())


def _thd_views(query, key, value, layout: PaddingLayout):
    """[b, h, s, d] -> the [b * s, h, d] token rows (a view where the memory allows, else a copy), less the rows
    before the first sequence (so that the offsets start at 0)."""
    b, h, sq, d = query.shape
    skv = key.shape[2]
    q = query.transpose(1, 2).reshape(b * sq, h, d)[layout.q_skip:]
    k, v = (x.transpose(1, 2).reshape(b * skv, x.shape[1], x.shape[3])[layout.kv_skip:] for x in (key, value))
    return q, k, v


def _thd_kwargs(layout: PaddingLayout) -> dict[str, Any]:
    return {"attn_mask_type": layout.mask_type, "cu_seqlens_q": layout.cu_seqlens_q,
            "cu_seqlens_kv": layout.cu_seqlens_kv, "cu_seqlens_q_padded": layout.cu_seqlens_q_padded,
            "cu_seqlens_kv_padded": layout.cu_seqlens_kv_padded, "window_size": layout.window}


class _Translation(NamedTuple):
    """A call in the module's terms: the module, forward's keywords for a bshd call (as keywords for explain, and as
    the one CallArgs forward's path hands the module: QKV_ONLY where there are none), how a bool mask was read (a
    note for explain), and the thd routes a recognised mask takes instead (packed cu_seqlens, a padding layout)."""

    module: Any
    kwargs: dict
    args: CallArgs
    note: Any
    packed: torch.Tensor | None
    layout: PaddingLayout | None
    module_reads: bool  # a mask the module may read (its forward's path, not the bound engine's)


def _translation(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, recognize_masks,
                 softcap: float = 0.0, mask_mod=None, score_mod=None) -> _Translation:
    """_translate's answer as forward and explain act on it. A bool mask's is kept for the next call (_LAST_MASKED):
    a model hands every layer of a step one mask tensor, so the layers after the first reuse the first one's
    translation (no re-validation, no new reading of the mask) while that tensor, unchanged, comes with the same
    shapes, device, gradient flags and arguments."""
    memo = None
    if attn_mask is not None and attn_mask.__class__ is torch.Tensor and attn_mask.dtype is torch.bool:
        try:
            version = attn_mask._version
        except RuntimeError:  # an inference tensor: no version counter to tell an in-place write
            version = None
        if version is not None:
            memo = (version, query.shape, key.shape, value.shape, query.device, torch.is_grad_enabled(),
                    query.requires_grad, key.requires_grad, value.requires_grad, attn_mask.requires_grad, dropout_p,
                    is_causal, scale, enable_gqa, recognize_masks, softcap, mask_mod, score_mod,
                    # a function's reading asks selection: it stands while selection's answers do
                    None if recognize_masks.__class__ is bool else current_stamp())
            last = _LAST_MASKED[0]
            if last is not None and last[0]() is attn_mask and last[1] == memo and \
                    _MODULES.get(last[2]) is last[3].module:
                module = last[3].module
                if module.training is not last[4]:
                    module.train(last[4])
                return last[3]
    if recognize_masks.__class__ is not bool:  # a function choosing the reading of a bool mask
        recognize_masks = bool(recognize_masks(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap)) \
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool else True
    module, kwargs = _translate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                recognize_masks, softcap, mask_mod, score_mod)
    note, packed, layout, module_reads = (kwargs.pop("mask_note", None), kwargs.pop("packed_cu_seqlens", None),
                                          kwargs.pop("padding_layout", None), kwargs.pop("module_reads", False))
    translation = _Translation(module, kwargs, CallArgs(**kwargs) if kwargs else QKV_ONLY, note, packed, layout,
                               module_reads)
    if memo is not None:
        previous = _LAST_MASKED[0]
        if previous is not None:  # its bound call goes with it: a module keeps none past its translation
            previous[3].module._plans.forget_masked(previous[3].args)
        _LAST_MASKED[0] = (weakref.ref(attn_mask, _forget_last_masked), memo, module._sdpa_key, translation,
                           module.training)
    return translation


def _forget_last_masked(ref) -> None:
    """The kept translation's mask died: what was read from it goes too (the inverse mask, a layout's offsets)."""
    last = _LAST_MASKED[0]
    if last is not None and last[0] is ref:
        _LAST_MASKED[0] = None
        translation = last[3]
        translation.module._plans.forget_masked(translation.args)  # the bound call made for it


# (weak ref to the mask, (its version, shapes, flags, arguments), _MODULES key, _Translation, module.training)
_LAST_MASKED: list = [None]


def _translate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, recognize_masks,
               softcap: float = 0.0, mask_mod=None, score_mod=None):
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)
            and query.dim() == 4 and key.dim() == 4 and value.dim() == 4):  # one test per call; the loop says which
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, tensor) or x.dim() != 4:
                shape = list(x.shape) if isinstance(x, tensor) else type(x).__name__
                raise ValueError(f"{name} is {shape}; attn_dispatch.scaled_dot_product_attention takes 4-D "
                                 "[batch, heads, seq, head_dim] tensors")
    b, h, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[-1] != d:
        raise ValueError(f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}: key and "
                         "value must share batch, heads and length, and key the query's head_dim")
    if hkv != h and not enable_gqa:
        raise ValueError(f"query has {h} heads and key {hkv}: pass enable_gqa=True for grouped-query attention")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal=True were both given; torch's SDPA refuses this too: pass one")
    kwargs: dict[str, Any] = {}
    mask_type = "causal" if is_causal else "no_mask"
    if attn_mask is not None:
        kwargs = {"attn_mask_type": mask_type, **_mask_kwargs(attn_mask, b, h, sq, skv, query.device,
                                                              recognize_masks, mask_mod is None and score_mod is None)}
        mask_type = "no_mask"
        if set(kwargs) == {"attn_mask_type"}:  # a mask that is a plain causal / no-mask pattern: that module type
            mask_type = kwargs.pop("attn_mask_type")
    # a plain causal / no-mask call: a module of that type, and its cached path
    module = _module(h, hkv, d, value.shape[-1], float(scale), float(dropout_p), float(softcap), mask_type,
                     mask_mod, score_mod)
    bias = kwargs.get("core_attention_bias") if kwargs else None
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad) or (
        isinstance(bias, torch.Tensor) and bias.requires_grad)
    training = bool(needs_grad) or dropout_p > 0
    if module.training is not training:  # nn.Module.train() walks the module and sets attributes: ~5 us a call
        module.train(training)
    return module, kwargs


def _module(h: int, hkv: int, d: int, dv: int, scale: float, dropout: float, softcap: float,
            mask_type: str = "no_mask", mask_mod=None, score_mod=None):
    key = (h, hkv, d, dv, scale, dropout, softcap, mask_type, mask_mod, score_mod)
    module = _MODULES.get(key)
    if module is None:
        if len(_MODULES) >= 64:
            _MODULES.clear()
        module = _MODULES[key] = DotProductAttention(h, (d, dv), num_gqa_groups=hkv, attention_dropout=dropout,
                                                     qkv_format="bshd", attn_mask_type=mask_type,
                                                     softmax_scale=scale, softcap=softcap, mask_mod=mask_mod,
                                                     score_mod=score_mod)
        module._fp8_dpa = False  # torch SDPA's semantics: the inputs' dtype, inside fp8_autocast too
        module._sdpa_key = key  # what a kept translation checks its module against (_translation)
    return module


def _as_4d(mask: torch.Tensor, b: int, h: int, sq: int, skv: int) -> torch.Tensor:
    """A [1|b, 1|h, sq, skv] view of a mask SDPA would broadcast to [b, h, sq, skv]."""
    shape = mask.shape
    rank = len(shape)
    # broadcasts to exactly [b, h, sq, skv]: each trailing dim is 1 or that size (torch.broadcast_shapes asks the
    # same through torch's symbolic-shape guards, ~80 us a call); a 4-D mask, the common case, without generator
    # frames
    if rank == 4:
        n0, n1, n2, n3 = shape
        fits = (n0 == 1 or n0 == b) and (n1 == 1 or n1 == h) and (n2 == 1 or n2 == sq) and (n3 == 1 or n3 == skv)
    else:
        fits = rank < 4 and all(n == 1 or n == want for n, want in zip(shape, (b, h, sq, skv)[4 - rank:]))
    if not fits:
        raise ValueError(f"attn_mask has shape {list(shape)}; it must broadcast to [{b}, {h}, {sq}, {skv}]")
    mask4 = mask if rank == 4 else mask.reshape((1,) * (4 - rank) + tuple(shape))
    if mask4.shape[2] == sq and mask4.shape[3] == skv:
        return mask4  # expand would return an equal view: a new tensor object for nothing
    return mask4.expand(mask4.shape[0], mask4.shape[1], sq, skv)


def _inverted(mask: torch.Tensor, mask4: torch.Tensor) -> torch.Tensor:
    """~mask4 (Transformer Engine's True = masked out), made once per mask tensor and version and kept on the mask
    itself: a model passing one mask to every layer hands the engines one tensor, so what they build from it (flex's
    BlockMask, mem_efficient's bias) is built once; a mask made anew each step takes its inverse with it."""
    try:
        version = mask._version
    except RuntimeError:  # an inference tensor: no version counter to tell an in-place write
        return ~mask4
    cached = getattr(mask, "_attn_dispatch_inverted", None)
    if cached is not None and cached[0] == version and cached[1].shape == mask4.shape:
        return cached[1]
    inverted = ~mask4
    mask._attn_dispatch_inverted = (version, inverted)
    return inverted


def _mask_kwargs(mask: torch.Tensor, b: int, h: int, sq: int, skv: int, device: torch.device,
                 recognize: bool, module_may_read: bool = True) -> dict[str, Any]:
    """forward's keywords for attn_mask (and how it was read: a note, or a thd route); module_may_read: no user
    modifier reads positions, so that the module may read a self-attention mask (causal documents of several rows,
    a prefix-LM mask as two calls) on its forward's path."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attn_mask must be a tensor (bool: True takes part; float: added to the scores); got "
                         f"{type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {device}")
    mask4 = _as_4d(mask, b, h, sq, skv)
    if mask.dtype == torch.bool:
        if not recognize:
            return {"attn_mask_type": "arbitrary", "attention_mask": _inverted(mask, mask4),
                    "mask_note": lambda: "bool attn_mask taken as 'arbitrary': recognize_masks=False"}
        if mask4.shape[0] == 1 and mask4.shape[1] == 1:
            pattern = _pattern(mask, mask4[0, 0], sq, skv)
            if pattern is not None:
                return {"attn_mask_type": pattern, "mask_note": lambda: f"bool attn_mask recognised as {pattern!r}"}
            if b == 1 and sq == skv:
                found = documents(mask, 1, sq, true_keeps=True, view=mask4)  # a flattening collator's packed row
                cu = found[0] if found is not None else None
                if cu is not None:
                    return {"packed_cu_seqlens": cu, "mask_note": lambda: "bool attn_mask recognised as packed "
                            f"causal sequences: thd 'padding_causal' with cu_seqlens {cu.tolist()}"}
        layout = recognise_padding(mask, mask4, b, sq, skv)
        if isinstance(layout, NotRecognised):
            return {"attn_mask_type": "arbitrary", "attention_mask": _inverted(mask, mask4),
                    "mask_note": lambda: f"bool attn_mask taken as 'arbitrary': {layout.why}",
                    "module_reads": module_may_read and sq == skv and mask4.shape[1] == 1}
        note = lambda: f"bool attn_mask recognised as {layout.describe()}"  # noqa: E731 - read by explain only
        if layout.thd:
            return {"padding_layout": layout, "mask_note": note}
        kwargs = {"attn_mask_type": layout.mask_type, "mask_note": note}
        if layout.cu_seqlens_q is not None:
            kwargs.update(cu_seqlens_q=layout.cu_seqlens_q, cu_seqlens_kv=layout.cu_seqlens_kv)
        if layout.window is not None:
            kwargs["window_size"] = layout.window
        return kwargs
    if not mask.dtype.is_floating_point:
        raise ValueError(f"attn_mask has dtype {mask.dtype}; it must be bool or a float dtype")
    return {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": mask4}


def _pattern(mask: torch.Tensor, mask2: torch.Tensor, sq: int, skv: int) -> str | None:
    """'causal' / 'causal_bottom_right' when the [sq, skv] bool mask is exactly that triangle, else None; cached on
    the mask tensor (a dead or modified mask is looked at again)."""
    def compute() -> str:
        ones = torch.ones(sq, skv, dtype=torch.bool, device=mask.device)
        if torch.equal(mask2, ones.tril()):
            return "causal"
        if torch.equal(mask2, ones.tril(skv - sq)):
            return "causal_bottom_right"
        return ""

    return cached_on((mask,), ("sdpa_pattern", sq, skv), compute) or None


