"""Compatibility names: the context-parallel support table lives in attn_dispatch.constraints.context_parallel
(data the constraint tables read); this package only implements it."""
from __future__ import annotations

from ..constraints.context_parallel import (COMM_TYPES, SOFTMAX_TYPES, SOURCE, SUPPORT, CommTypeSupport,
                                            block_params, is_windowed, params_failures, unsupported_features)


def engine_block_params(p, a2a_size: int | None = None) -> list:
    """The plain calls the engines receive for this CP call (see constraints.context_parallel.block_params)."""
    return block_params(p if a2a_size is None else p.replace(cp_a2a_size=a2a_size))


__all__ = ["COMM_TYPES", "SOFTMAX_TYPES", "SOURCE", "SUPPORT", "CommTypeSupport", "block_params",
           "engine_block_params", "is_windowed", "params_failures", "unsupported_features"]
