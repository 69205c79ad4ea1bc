"""KV-cache inference: Transformer Engine's InferenceParams (contiguous or paged caches) for DotProductAttention."""
from .inference_params import InferenceParams, KVCacheError

__all__ = ["InferenceParams", "KVCacheError"]
