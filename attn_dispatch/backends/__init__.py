"""Engines, one module per family. Imported lazily: an engine's package is loaded on its first use."""
from __future__ import annotations

import importlib

from ..runtime_facts import record_load_failure
from .base import AttnAux, AttnConfig, BwdResult, Engine, EngineUnavailableError, FwdResult

# provider id -> "module:class". The order within a family is the providers' preference order.
ENGINE_CLASSES: dict[str, str] = {
    "flash_attn_4:cute": "attn_dispatch.backends.flash_attn_4:FlashAttn4Engine",
    "flash_attn_3:interface": "attn_dispatch.backends.flash_attn_3:FlashAttn3Engine",
    "cudnn_fused:frontend": "attn_dispatch.backends.cudnn_fused:CudnnFrontendEngine",
    "cudnn_fused:torch": "attn_dispatch.backends.cudnn_fused:TorchCudnnEngine",
    "cudnn_fused:fp8": "attn_dispatch.backends.cudnn_fused_fp8:CudnnFP8Engine",
    "flash_attn_2:package": "attn_dispatch.backends.flash_attn_2:FlashAttn2PackageEngine",
    "flash_attn_2:torch": "attn_dispatch.backends.flash_attn_2:TorchFlashEngine",
    "flex_attention:flash_attn_4": "attn_dispatch.backends.flex_attention:FlexFlashEngine",
    "flex_attention:torch": "attn_dispatch.backends.flex_attention:FlexAttentionEngine",
    "mem_efficient:torch": "attn_dispatch.backends.mem_efficient:MemEfficientEngine",
    "unfused:pytorch": "attn_dispatch.backends.unfused:UnfusedEngine",
}

_INSTANCES: dict[str, Engine] = {}


def get_engine(provider_id: str) -> Engine:
    engine = _INSTANCES.get(provider_id)
    if engine is not None:
        return engine
    if provider_id not in ENGINE_CLASSES:
        raise ValueError(f"backend provider {provider_id!r} is unknown; known: {', '.join(ENGINE_CLASSES)}")
    module_name, _, class_name = ENGINE_CLASSES[provider_id].partition(":")
    try:
        engine = getattr(importlib.import_module(module_name), class_name)()
    except (ImportError, OSError, RuntimeError) as exc:
        record_load_failure(provider_id, f"{type(exc).__name__}: {exc}")
        raise EngineUnavailableError(f"{provider_id} failed to load: {exc}") from exc
    _INSTANCES[provider_id] = engine
    return engine


__all__ = ["AttnAux", "AttnConfig", "BwdResult", "Engine", "EngineUnavailableError", "FwdResult",
           "ENGINE_CLASSES", "get_engine"]
