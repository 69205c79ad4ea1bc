"""Unfused PyTorch attention: runs everywhere (CPU included), every feature, any float dtype."""
from __future__ import annotations

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from . import common
from .base import Failure, Table, fail

OURS = "attn_dispatch.backends.unfused (our implementation)"

UNFUSED = Table("unfused", "pytorch", "query-blocked PyTorch attention with recompute in backward; any device")
UNFUSED.add(
    common.env_enabled(UNFUSED),
    common.dtypes(UNFUSED, ("float16", "bfloat16", "float32", "float64"), source=OURS),
    common.no_fp8(UNFUSED, source=OURS),
    common.kv_cache(UNFUSED, contiguous=True, paged=True,
                    source=OURS + " (gathers each sequence's cached keys; any page size)"),
    common.cp_comm_types(UNFUSED, ("p2p", "all_gather", "a2a", "a2a+p2p"), source="attn_dispatch.context_parallel"),
)


@UNFUSED.check("device", requires="the call's device matches the platform", topic="platform", source=OURS)
def _device(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    if p.device_type == "cuda" and plat.device_type != "cuda":
        return fail("the call is on CUDA but the platform has no CUDA GPU")
    return None


@UNFUSED.note
def _slow_on_gpu(p: AttentionParams, plat: Platform) -> str | None:
    if p.device_type == "cuda":
        return "unfused on a GPU is several times slower than the fused engines and uses O(block x skv) extra memory"
    return None


@UNFUSED.check("softcap", requires="any softcap >= 0 (scores -> softcap * tanh(scores / softcap))", topic="softmax",
               source=OURS)
def _softcap(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
    return None  # implemented in forward and backward; AttentionParams already refuses negative values
