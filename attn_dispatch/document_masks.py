"""A bool attention_mask that is causal attention within consecutive documents, run as the packed call it is.

A training batch of packed documents often reaches attention as a [b|1, 1, s, s] bool mask (Transformer Engine's
convention: True masks a pair out) with mask type 'arbitrary'. When every row sees exactly the keys from the start of
its document to itself, the call is the thd call with those documents as sequences and 'padding_causal': the fused
varlen engines run it, exact on every row (no row is fully masked). On the H200 (benchmarks/results/masks/
bench_masks_h200_full_flash_train.json, 8 documents in 16k tokens) that thd call took 1.34 ms a training step against
2.30 for FlexAttention on the mask and 25.5 for F.scaled_dot_product_attention.

Recognition reads the mask on its device with a few reductions and one read-back, once per mask tensor and version
(cached on the tensor, as every content check is). Forward and explain() both take the call through question.read_mask,
so explain describes the thd call that runs, with a note saying why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .call_args import CallArgs
from .tensor_cache import cached_on

SEQ_DIM = {"bshd": 1, "sbhd": 0}


@dataclass(frozen=True)
class DocumentCall:
    """The packed form of a call: q, k, v as thd, its CallArgs, how to bring the output back, and explain's note."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    args: CallArgs
    restore: Callable[[torch.Tensor], torch.Tensor]
    note: str


def documents(mask: torch.Tensor, batch: int, seqlen: int, *, true_keeps: bool = False,
              view: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int] | None:
    """(int32 cu_seqlens over the batch's b * s tokens, the longest document, their count) when the [b|1, 1, s, s]
    bool mask (True: masked out; true_keeps: True takes part, torch SDPA's convention) is causal attention within
    consecutive documents of every batch element, else None; cached on the mask tensor. view: the mask as
    [b|1, 1, s, s] when `mask` itself has another shape."""
    four = mask if view is None else view

    def compute():
        keep = four[:, 0] if true_keeps else ~four[:, 0]  # [B, s, s]
        rows = torch.arange(seqlen, device=four.device)
        first = keep.to(torch.int8).argmax(dim=-1)  # the first key each row sees
        starts = first == rows  # [B, s]: rows that begin a document
        segment = starts.cumsum(-1)
        expected = (segment[:, :, None] == segment[:, None, :]) & (rows[None, None, :] <= rows[None, :, None])
        if not bool(starts[:, 0].all()) or not torch.equal(keep, expected):
            return None
        bounds = [torch.nonzero(s).flatten().tolist() + [seqlen] for s in starts]
        if len(bounds) == 1:
            bounds = bounds * batch
        cu = [0]
        for b, edges in enumerate(bounds):
            cu += [b * seqlen + e for e in edges[1:]]
        longest = max(e - s for edges in bounds for s, e in zip(edges, edges[1:]))
        return torch.tensor(cu, dtype=torch.int32, device=mask.device), longest, len(cu) - 1

    return cached_on((mask,), ("document_mask", batch, seqlen, true_keeps), compute)


def self_attention_mask_call(fmt: str, mask_type: str, window: tuple[int, int], q, k, v, args: CallArgs,
                             plain_module: bool) -> tuple[int, int, int] | None:
    """(sequence dim, batch, seqlen) of a call a bool mask's reading may rewrite, else None: an 'arbitrary' [b|1, 1,
    s, s] bool mask on a bshd/sbhd self-attention call with nothing else that reads positions (no window, bias,
    ALiBi, explicit lengths). plain_module: the module adds nothing a rewritten call would change (no user mask_mod
    or score_mod, no max-logit output, no forced backend)."""
    mask = args.attention_mask
    if (mask_type != "arbitrary" or fmt not in SEQ_DIM or not plain_module or not isinstance(mask, torch.Tensor)
            or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
            or window not in ((-1, -1), (-1, 0)) or args.core_attention_bias_type != "no_bias"
            or args.alibi_slopes is not None or args.cu_seqlens_q is not None or args.cu_seqlens_kv is not None
            or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))):
        return None
    sd = SEQ_DIM[fmt]
    batch, seqlen = q.shape[1 - sd], q.shape[sd]
    if k.shape[sd] != seqlen or mask.shape[2:] != (seqlen, seqlen) or mask.shape[0] not in (1, batch) \
            or mask.device != q.device:
        return None
    return sd, batch, seqlen


def as_documents(q, k, v, args: CallArgs, call: tuple[int, int, int]) -> DocumentCall | None:
    """The call as packed documents (thd, 'padding_causal'), or None when its mask is not causal documents. call:
    what self_attention_mask_call answered for it."""
    sd, batch, seqlen = call
    mask = args.attention_mask
    found = documents(mask, batch, seqlen)
    if found is None:
        return None
    cu, longest, count = found

    def packed(t: torch.Tensor) -> torch.Tensor:
        return (t if sd == 1 else t.transpose(0, 1)).reshape(batch * seqlen, *t.shape[2:])

    def restore(out: torch.Tensor) -> torch.Tensor:
        out = out.reshape(batch, seqlen, *out.shape[1:])
        return out if sd == 1 else out.transpose(0, 1)

    new_args = args.replace(attention_mask=None, qkv_format="thd", attn_mask_type="padding_causal",
                            cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                            window_size=(-1, 0))
    note = (f"the bool attention_mask is causal attention within {count} consecutive documents (the longest "
            f"{longest} tokens): run as thd 'padding_causal' with their cu_seqlens, exact on every row")
    return DocumentCall(packed(q), packed(k), packed(v), new_args, restore, note)
