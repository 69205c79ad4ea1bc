"""attn-dispatch: pick the attention engine for each call, and say why."""
from __future__ import annotations

from .decision import Decision, NoBackendAvailableError, Reason, Verdict
from .env import EnvFlags
from .params import AttentionParams
from .platform import Platform
from .selection import clear_cache, explain, preference_order, select

from ._version import __version__

__all__ = [
    "AttentionParams", "Decision", "DotProductAttention", "EnvFlags", "InferenceParams", "KVCacheError",
    "NoBackendAvailableError", "Platform",
    "Reason", "Verdict", "clear_cache", "explain", "explain_sdpa", "fp8_autocast", "preference_order",
    "scaled_dot_product_attention",
    "select", "__version__",
]


def __getattr__(name: str):  # the module imports torch; keep `import attn_dispatch` light for the CLI
    if name == "DotProductAttention":
        from .module import DotProductAttention

        return DotProductAttention
    if name in ("InferenceParams", "KVCacheError"):
        from . import kv_cache

        return getattr(kv_cache, name)
    if name == "fp8_autocast":
        from .fp8 import fp8_autocast

        return fp8_autocast
    if name in ("scaled_dot_product_attention", "explain_sdpa"):
        from . import sdpa

        return getattr(sdpa, name)
    raise AttributeError(f"module 'attn_dispatch' has no attribute {name!r}")
