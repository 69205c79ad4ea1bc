"""How the auto policy predicts a KV-cache decode step, which its profile does not cover.

Why not the profile: its rows are training and prefill calls, predicted from matmul flops at a measured rate
(policy/profile.py). A decode step has almost no flops; it streams the cache. Its time is the bytes of K/V it
reads over the memory bandwidth its blocks reach, or the provider's host floor, whichever is larger:

    t = max(host floor, bytes / (bandwidth x min(1, blocks / SMs)))

where blocks are the thread blocks the step runs (constraints/kv_decode.py): an engine that splits the keys
(split-KV) fills the SMs whatever the batch; one that does not runs batch x kv-heads blocks, and a batch of 1
with 8 kv heads then reads the cache with 8 of 132 SMs. The host floors are the profile's (the least a provider
was ever measured to cost in inference: flash-attn-4's Python launch, ~0.2 ms on the H100's host, decides
small steps). Bandwidth and SM counts are the data-centre parts' nominal figures per architecture: they only
weigh bytes against host floors, and the ratio between providers does not depend on them.
A provider whose decode launch is not known (cuDNN on sm90) is left unpredicted and named in the reason; it is
picked only when nothing predicted is eligible. Applies to short queries (q_len x GQA ratio <= one 64-row tile),
where reading the cache dominates; longer chunked-prefill steps keep the profile/preference-order path.
"""
from __future__ import annotations

from ..constraints import kv_decode
from ..params import AttentionParams
from ..platform import Platform
from .base import Choice

# sm major -> (SMs, HBM bytes/s): H100 SXM / H200, B200, A100 SXM.
NOMINAL = {9: (132, 3.35e12), 10: (148, 8.0e12), 8: (108, 2.0e12)}
MAX_PACKED_ROWS = 64


def applies(p: AttentionParams, platform: Platform) -> bool:
    return (p.inference_kv_cache and platform.device_type == "cuda" and platform.sm // 10 in NOMINAL
            and p.max_seqlen_q * p.gqa_ratio <= MAX_PACKED_ROWS)


def kv_bytes(p: AttentionParams) -> float:
    """Bytes of K and V a step reads: each sequence's cached keys (a window's worth with a sliding window)."""
    span = p.max_seqlen_kv
    if p.window_size[0] >= 0:
        span = min(span, p.window_size[0] + p.max_seqlen_q)
    element = 4 if p.dtype == "float32" else 2
    return float(p.batch_size * span * p.num_gqa_groups * (p.head_dim_qk + p.head_dim_v) * element)


def predict(p: AttentionParams, platform: Platform, provider: str, host_ms: float) -> tuple[float, str] | None:
    """(ms, why) for one provider, or None when its decode launch is not known."""
    found = kv_decode.launch(provider, p, platform)
    if found is None or found.split_kv is None:
        return None
    sms, bandwidth = NOMINAL[platform.sm // 10]
    busy = 1.0 if found.split_kv else min(1.0, found.blocks / sms)
    gpu_ms = kv_bytes(p) / (bandwidth * busy) * 1e3
    return max(host_ms, gpu_ms), f"{found.blocks} blocks{' split' if found.split_kv else ''} on {sms} SMs"


def choose(p: AttentionParams, platform: Platform, eligible: list[str], host_ms: dict[str, float]) -> Choice:
    """The fastest eligible provider by the decode model; host_ms: each provider's host floor (0 if unknown)."""
    estimates, why = {}, {}
    for provider in eligible:
        found = predict(p, platform, provider, host_ms.get(provider, 0.0))
        if found is not None:
            estimates[provider], why[provider] = found
    if not estimates:
        return Choice(eligible[0], "a KV-cache decode step no decode model covers for "
                                   f"{', '.join(eligible)}; Transformer Engine's preference order decides")
    chosen = min(eligible, key=lambda name: estimates.get(name, float("inf")))  # ties: the preference order
    others = ", ".join(f"{name} {estimates[name]:.3f} ms ({why[name]})" for name in eligible
                       if name in estimates and name != chosen) or "no other predicted provider"
    unknown = [name for name in eligible if name not in estimates]
    reason = (f"decode model (memory-bound KV-cache step, {kv_bytes(p) / 1e6:.0f} MB of K/V): predicted "
              f"{estimates[chosen]:.3f} ms with {why[chosen]}, vs {others}")
    if unknown:
        reason += f"; not predicted (decode parallelism unknown): {', '.join(unknown)}"
    return Choice(chosen, reason, {name: round(t, 4) for name, t in estimates.items()}, "ms per step, predicted")
