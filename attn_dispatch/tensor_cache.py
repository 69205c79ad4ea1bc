"""Values derived from a tensor's contents, computed once per tensor object and version.

Validation (inputs.py) reads cu_seqlens back to the host once per tensor; the engines derive small device tensors
from them (int32 lengths, ragged offsets). A model's layers call attention with the same cu_seqlens tensor
(Transformer Engine's users do), so both are keyed on the tensor itself: its identity (a weak reference, so that
a dead tensor whose id is reused misses) and its version counter (an in-place write misses). Bounded: the cache
is emptied when it reaches CACHE_LIMIT entries. Inference tensors track no version, so nothing is cached for them.

While a CUDA graph is captured, device tensors are derived afresh (cached_device_tensor): the graph then owns
them (a cached one could be freed by an eviction while the graph still reads it) and recomputes them from the
cu_seqlens contents of each replay, which may differ from the ones seen at capture.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

CACHE_LIMIT = 256
_CACHE: dict[tuple, tuple[tuple, tuple, Any]] = {}
_MISS = object()


def _lookup(tensors: tuple[torch.Tensor, ...], context: tuple) -> tuple[Any, tuple | None]:
    """(the cached value or _MISS, the tensors' versions; None for an inference tensor, which is never cached)."""
    try:
        versions = tuple(t._version for t in tensors)
    except RuntimeError:  # an inference tensor: no version counter, so a later in-place write could not be seen
        return _MISS, None
    hit = _CACHE.get(tuple(map(id, tensors)) + context)
    if hit is not None and hit[1] == versions and all(ref() is t for ref, t in zip(hit[0], tensors)):
        return hit[2], versions
    return _MISS, versions


def cached_on(tensors: tuple[torch.Tensor, ...], context: tuple, compute: Callable[[], Any]) -> Any:
    """compute() once per (tensor objects, their versions, context); a dead or modified tensor misses. The
    context must name everything else the value depends on (a stride, a dtype, the purpose)."""
    value, versions = _lookup(tensors, context)
    if value is not _MISS:
        return value
    value = compute()
    if versions is None:
        return value
    key = tuple(map(id, tensors)) + context
    if len(_CACHE) >= CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = (tuple(weakref.ref(t) for t in tensors), versions, value)
    return value


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (t: a tensor of the call, on its device). Host facts
    read from cu_seqlens then describe the capture's contents only, not those of later replays."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def cached_device_tensor(tensors: tuple[torch.Tensor, ...], context: tuple,
                         compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """cached_on for a device tensor derived from the tensors' contents, made afresh while a CUDA graph is
    captured (see the module doc)."""
    if capturing(tensors[0]):
        return compute()
    return cached_on(tensors, context, compute)


def remember_values(t: torch.Tensor, values: list) -> None:
    """Record t.tolist() == values for a tensor just made from those host values (e.g. cu_seqlens built from a
    mask's lengths): a later known_values(t) answers without reading the device back. A dead or modified t misses."""
    cached_on((t,), ("host_values",), lambda: list(values))


def known_values(t: torch.Tensor) -> list | None:
    """t's values as recorded by remember_values (for t's current version), else None: nothing is read."""
    value = _lookup((t,), ("host_values",))[0]
    return None if value is _MISS else value


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same values (e.g. cu_seqlens_q and cu_seqlens_kv): compared on the host where both were
    recorded by remember_values, else a device comparison and a sync; once per pair of tensors and versions."""
    if a is b:
        return True

    def compare() -> bool:
        known_a, known_b = known_values(a), known_values(b)
        if known_a is not None and known_b is not None:
            return a.shape == b.shape and known_a == known_b
        return a.shape == b.shape and bool(torch.equal(a.to(b.dtype), b))
    return cached_on((a, b), ("same_values",), compare)


def clear() -> None:
    _CACHE.clear()
