"""A bool attention_mask of prefix-LM shape, run as the two fused calls it is.

Prefix-LM models (a bidirectional prefix, causal after it: T5-style decoders, UL2, PaliGemma's image and prompt
prefix) give attention a [b|1, 1, s, s] bool mask in which row i sees the keys [0, max(P, i + 1)). Its rows split into
two calls that need no mask: rows [0, P) over keys [0, P) without a mask, and rows [P, s) over all s keys, causal
aligned to the bottom right (row P + j sees keys [0, P + j]). The two outputs are disjoint rows, so the call's output
is one beside the other, exact on every row; autograd adds up the keys' and values' gradients of the two. The fused
engines run both: FlexAttention reading the mask ran an 8k prefix-LM forward at 0.44x the causal call's TFLOP/s on
stock torch (H200, benchmarks/results/masks/bench_masks_h200_stock_inference.json).

Recognition reads the mask on its device (a row count, and a comparison with the pattern it implies: two read-backs),
once per mask tensor and version, cached on the tensor as every content check is. Forward and explain() both take a
call through question.read_mask, so explain describes the two calls that run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .call_args import CallArgs
from .document_masks import SEQ_DIM
from .tensor_cache import cached_on


@dataclass(frozen=True)
class PrefixSplit:
    """A prefix-LM call as two: `head` (rows [0, prefix) over keys [0, prefix), no mask) and `tail` (rows
    [prefix, s) over every key, causal bottom-right), each (q, k, v, CallArgs); `seq_dim`: where their outputs
    join."""
    prefix: int
    seqlen: int
    head: tuple
    tail: tuple
    seq_dim: int

    def join(self, head_out: torch.Tensor, tail_out: torch.Tensor) -> torch.Tensor:
        return torch.cat([head_out, tail_out], dim=self.seq_dim)

    def note(self, head_engine: str | None) -> str:
        ran = head_engine or "no engine qualifies: forward raises"
        return (f"the bool attention_mask is a prefix-LM mask (a bidirectional prefix of {self.prefix} tokens, causal "
                f"after it): run as two calls, exact on every row: rows [0, {self.prefix}) over keys [0, "
                f"{self.prefix}) without a mask ({ran}), then rows [{self.prefix}, {self.seqlen}) over every key, "
                "'causal_bottom_right' (this decision)")


def prefix_length(mask: torch.Tensor, batch: int, seqlen: int, *, true_keeps: bool = False,
                  view: torch.Tensor | None = None) -> int | None:
    """P when the [b|1, 1, s, s] bool mask (True: masked out; true_keeps: True takes part, torch SDPA's convention)
    has every row i of every batch element see exactly the keys [0, max(P, i + 1)), with 1 < P < s; else None.
    Cached on the mask tensor. view: the mask as [b|1, 1, s, s] when `mask` itself has another shape."""
    four = mask if view is None else view

    def compute() -> int:
        keep = four[:, 0] if true_keeps else ~four[:, 0]  # [B, s, s]
        prefixes = keep[:, 0].sum(-1).unique()  # what row 0 sees: the prefix, if the mask is one
        if prefixes.numel() != 1:
            return 0
        prefix = int(prefixes)
        if not 1 < prefix < seqlen:
            return 0
        rows = torch.arange(seqlen, device=four.device)
        expected = (rows[None, :] < prefix) | (rows[None, :] <= rows[:, None])  # [s, s]
        return prefix if torch.equal(keep, expected.expand_as(keep)) else 0

    return cached_on((mask,), ("prefix_lm_mask", batch, seqlen, true_keeps), compute) or None


def split(fmt: str, q, k, v, args: CallArgs, prefix: int) -> PrefixSplit:
    """The two calls of a prefix-LM call on bshd / sbhd tensors (args: the call's other arguments, its mask dropped
    here)."""
    sd = SEQ_DIM[fmt]
    seqlen = q.shape[sd]
    rest = args.replace(attention_mask=None)
    head = (q.narrow(sd, 0, prefix), k.narrow(sd, 0, prefix), v.narrow(sd, 0, prefix),
            rest.replace(attn_mask_type="no_mask", window_size=(-1, -1)))
    tail = (q.narrow(sd, prefix, seqlen - prefix), k, v,
            rest.replace(attn_mask_type="causal_bottom_right", window_size=(-1, 0)))
    return PrefixSplit(prefix, seqlen, head, tail, sd)


def as_prefix_lm(fmt: str, q, k, v, args: CallArgs, call: tuple[int, int, int]) -> PrefixSplit | None:
    """The call as its two calls, or None when its mask is not a prefix-LM mask. call: what
    document_masks.self_attention_mask_call answered for it."""
    _, batch, seqlen = call
    prefix = prefix_length(args.attention_mask, batch, seqlen)
    return None if prefix is None else split(fmt, q, k, v, args, prefix)
