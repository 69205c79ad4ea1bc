"""A module call becomes the question selection answers, in this one place, for every mode.

`route` decides which path serves a call (and raises what no path accepts) before any path acts; `ask` describes
the call as that path's selection sees it: the module's own tensors for a plain call (dense, padded, packed, FP8),
the rank's shard and the CP mode for context parallelism (whose per-block calls selection then composes), the
bucketed step for a KV-cache step. DotProductAttention.forward routes through `route` and plans through the same
describers; `DotProductAttention.explain` is `ask` answered by selection, so what it says is what forward runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .call_args import CallArgs
from .context_parallel import module_glue
from .inputs import plain_params
from .kv_cache import attend
from .params import AttentionParams

if TYPE_CHECKING:
    from .module import DotProductAttention

PLAIN, CONTEXT_PARALLEL, KV_CACHE = "plain", "context_parallel", "kv_cache"


@dataclass(frozen=True)
class Question:
    """What selection is asked for one call: its path, the params as the engines run them (a window that masks
    nothing dropped), the notes saying how the call was read, and its FP8 context ((region, output in FP8) or
    None)."""

    mode: str
    params: AttentionParams
    notes: tuple[str, ...] = ()
    fp8: tuple | None = None


def route(module: "DotProductAttention", args: CallArgs) -> tuple[str, tuple | None]:
    """(the path that serves this call, its FP8 context); raises for a combination no path takes."""
    if not isinstance(args.fp8_output, bool):
        raise ValueError(f"fp8_output={args.fp8_output!r} must be True or False")
    fp8 = module._fp8_context(args)
    if args.inference_params is not None:
        if fp8 is not None:
            raise ValueError("FP8 attention with a KV cache (inference_params) is not supported by attn-dispatch "
                             "(Transformer Engine also runs no fused FP8 attention with a KV cache); run this "
                             "call outside fp8_autocast, or with a recipe whose fp8_dpa=False")
        return KV_CACHE, None
    if module.cp_group is not None:
        return CONTEXT_PARALLEL, fp8
    return PLAIN, fp8


def ask(module: "DotProductAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        args: CallArgs) -> Question:
    """The question forward's path asks selection for this call (validating it as that path does)."""
    mode, fp8 = route(module, args)
    if mode == KV_CACHE:
        params = attend.describe(module, q, k, v, args)
    elif mode == CONTEXT_PARALLEL:
        params = module_glue.describe(module, q, k, v, args, fp8).params
    else:
        params = module._describe(q, k, v, args, fp8)[0]
    params, notes = plain_params(params)
    return Question(mode, params, notes, fp8)
