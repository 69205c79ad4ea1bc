"""Hugging Face transformers: `register()` makes `attn_implementation="attn_dispatch"` work for the models that
use transformers' AttentionInterface (Llama, Mistral, Qwen2/3, Gemma 2/3, ...).

The models build SDPA-format masks for this implementation (transformers' `sdpa_mask`: None where causality alone
says it, else a bool mask, True = take part), and the attention runs through
`attn_dispatch.scaled_dot_product_attention`: the same decision, explanations and errors as the module. A plain
causal call (no padding) reaches the fused engines as 'causal'; decode steps (one query, every cached key visible)
as 'no_mask'; a packed row from a flattening collator (`cu_seq_lens_q`, or, where transformers passes no mask,
`position_ids` restarting at 0) runs as thd, each sequence attending only to itself (as transformers' FlashAttention
path treats it; sliding windows kept); padded batches carry a bool mask that the SDPA function recognises as a
padding pattern (attn_dispatch.mask_patterns: right padding as bshd 'padding_causal' with every query row real, left
padding and decode steps over a padded cache as thd views with offsets), exact on every row as transformers' SDPA
path is, so they reach cuDNN on a GPU; sliding-window masks are recognised as causal with a window (padded or not).
A mask that is no such pattern runs as 'arbitrary' (explain_sdpa's notes say why). Attention logit softcapping
(Gemma 2's) runs on the engines that implement it (the unfused one, and flash-attn-4 where its table takes it; the
others refuse it with the reason). Whatever the interface passes that no engine here can do is refused with the
reason (attention weights as output, position_bias).
"""
from __future__ import annotations

from typing import Any

import torch

from ..decision import Decision
from ..freshness import current_stamp
from ..sdpa import explain_sdpa, scaled_dot_product_attention
from ..sdpa import varlen_attention
from ..tensor_cache import cached_on

NAME = "attn_dispatch"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: [b, h, s, d] in, ([b, s, h, d_v], None) out."""
    softcap = float(kwargs.get("softcap") or 0.0)  # Gemma 2's attn_logit_softcapping: the unfused engine takes it
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: attn_dispatch's engines return no attention weights; use "
                         "attn_implementation='eager' to get them")
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias is not supported by attn_dispatch (models such as T5 pass one); use "
                         "attn_implementation='sdpa'")
    q_len = query.shape[2]
    cu = _packed_offsets(query, key, attention_mask, kwargs) if query.shape[0] == 1 else None
    if cu is not None:  # a flattening collator's row: each sequence attends only to itself, as thd

        window = kwargs.get("sliding_window")  # the last `window` keys, the query's own included (transformers')
        out = varlen_attention(query, key, value, cu, dropout if module.training else 0.0, scaling,
                               key.shape[1] != query.shape[1], None if window is None else int(window) - 1,
                               softcap=softcap)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None or q_len == 1:
        is_causal = False  # a mask says it all; one query sees every key
    else:
        is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if is_causal and key.shape[2] > q_len:  # SDPA's top-left causal with more keys: only the first q_len count
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    gqa = key.shape[1] != query.shape[1]
    dropout_p = dropout if module.training else 0.0
    # a one-query step's bool mask: its reading chosen by _recognise_decode_masks, which the SDPA function asks once
    # per mask tensor (the step's first layer), not once per layer
    recognize = _recognise_decode_masks if q_len == 1 and attention_mask is not None else True
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout_p,
                                       is_causal=is_causal, scale=scaling, enable_gqa=gqa, softcap=softcap,
                                       recognize_masks=recognize)
    return out.transpose(1, 2).contiguous(), None


def _recognise_decode_masks(query, key, value, mask, dropout_p, scale, gqa, softcap) -> bool:
    """Whether a one-query step's bool mask is read as a padding pattern (transformers builds a new mask every
    decode step, so reading it costs a device sync and its offsets every step) or handed on as it is ('arbitrary').
    Selection answers both descriptions once for the generation's shapes (and the live platform and environment),
    and the mask is read only where the pick for the padding pattern beats the pick for the mask as given."""
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    # current_stamp: the runtime facts (what Platform.detect adds to its one probe), determinism and the decision's
    # environment variables, in ~1 us; Platform.detect() and EnvFlags.from_environ() took ~10x that per call
    memo_key = (query.shape[0], query.shape[1], key.shape[1], query.shape[3], value.shape[3], query.dtype,
                query.device, mask.shape[0], mask.shape[1], scale, softcap, dropout_p, training, current_stamp())
    known = _DECODE_READING.get(memo_key)
    if known is None:
        asked = dict(dropout_p=dropout_p, scale=scale, enable_gqa=gqa, softcap=softcap)
        as_given = explain_sdpa(query, key, value, mask, recognize_masks=False, **asked)
        as_padding = explain_sdpa(query, key, value, mask, recognize_masks=True, **asked)
        known = prefer_padding_reading(as_padding, as_given)
        if len(_DECODE_READING) >= 64:
            _DECODE_READING.clear()
        _DECODE_READING[memo_key] = known
    return known


def prefer_padding_reading(as_padding: Decision, as_given: Decision) -> bool:
    """True when selection's pick for the mask read as a padding pattern is better than its pick for the mask as
    given: an engine where the other has none, a fused engine where the other runs only unfused on a GPU, or, both
    predicted, a shorter predicted time. Otherwise (ties, and a prediction against none) the mask stays as given:
    reading it costs every step a host sync and a few reductions, and the thd views copy each layer's keys and
    values, none of which a prediction of the kernel counts."""
    def kind(decision: Decision) -> tuple[bool, bool]:
        last_resort = decision.backend == "unfused" and decision.params.get("device_type") == "cuda"
        return decision.chosen is None, last_resort

    if kind(as_padding) != kind(as_given):
        return kind(as_padding) < kind(as_given)
    if as_padding.chosen is None:
        return False
    padding_ms, given_ms = as_padding.estimates.get(as_padding.chosen), as_given.estimates.get(as_given.chosen)
    return padding_ms is not None and given_ms is not None and padding_ms < given_ms


# (shapes, dtype, device, mask broadcast, scale, softcap, dropout, training, freshness stamp) -> whether a
# one-query step's mask is read as a padding pattern
_DECODE_READING: dict[tuple, bool] = {}


def _packed_offsets(query, key, attention_mask, kwargs) -> torch.Tensor | None:
    """int32 cu_seqlens of a packed row: the collator's `cu_seq_lens_q` (== `cu_seq_lens_k`; it wins over the
    causal or sliding-window mask transformers builds over the whole row), or, with no mask, where `position_ids`
    restart at 0; None for anything else (batches of several rows, a KV cache)."""
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        if cu_k is not None and not torch.equal(cu_q, cu_k):
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: packed self-attention needs the same "
                             "sequence boundaries for queries and keys")
        return cu_q.to(torch.int32)
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or not isinstance(position_ids, torch.Tensor) or \
            position_ids.shape != (1, query.shape[2]) or not _READ_POSITIONS[0]:
        return None  # a mask transformers built says more than the positions: follow it, as its SDPA path does

    def compute():
        starts = torch.nonzero(position_ids[0] == 0).flatten()
        if starts.numel() <= 1 or int(starts[0]) != 0:
            return None  # one sequence (or positions not starting at 0): plain causal
        t = position_ids.shape[1]
        return torch.cat([starts, torch.tensor([t], device=starts.device)]).to(torch.int32)

    return cached_on((position_ids,), ("hf_packed",), compute)


# Whether batch-1 calls with no mask read position_ids to find packed rows (register(packed_positions=...)).
_READ_POSITIONS = [True]


def register(name: str = NAME, *, packed_positions: bool = True) -> str:
    """Register the attention function (and transformers' SDPA mask format) under `name`; returns it.

    packed_positions: a batch-1 call with no mask reads position_ids to find a flattening collator's packed row
    (transformers builds no mask for it while a KV cache is in use, and its SDPA path then attends across the
    sequences). Reading them is one device sync per forward: on the H100 it cost a 1B Llama's unpadded batch-1
    training step 6% against "sdpa" (benchmarks/results/transformers/llama_1b_b1_packed_positions_h100.json).
    False skips it, for training that never packs rows by position_ids alone (collators passing cu_seq_lens are found
    either way)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(packed_positions, bool):
        raise ValueError(f"packed_positions={packed_positions!r} must be True or False")
    _READ_POSITIONS[0] = packed_positions
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
