"""The performance profile shipped with the package, and how it predicts an engine's cost for an unmeasured call.

A profile (profiles/<arch>.json) holds, per measured call, what a user's step cost with each eligible provider
forced (benchmarks/bench_user_step.py: the module called as a user calls it, forward, or forward and backward
into the leaves' .grad; interleaved on the same inputs), on a named machine and software stack.

The cost model: a step costs its host time or its GPU time, whichever dominates (the GPU runs behind the host),
combined smoothly as t = (H^8 + G^8)^(1/8).
- H, the host floor of a provider, is the least it was measured to cost on calls of the same training mode and
  packing: the tiniest calls are host-bound (flash-attn-4's Python launch costs ~0.2 ms a forward on the H100's
  host), and packed (thd) calls cost more per call than dense ones (~0.4 ms inference, ~1.3 ms training at any size
  in the H100 fit grid, every engine): one floor for both under-predicted small thd calls 4x.
- G = work / rate: the work is the call's matmul flops (policy.timing.attention_flops), and the rate is
  taken from the nearest measured call (K = 1; K > 1 averages log rates) of the same kind (training or inference, causal,
  windowed or neither, packed/padded or dense), nearness being a weighted distance over log2 sizes (head dims,
  query and key lengths, the key span a window leaves, batch x heads, GQA ratio) plus a penalty for another
  memory format. The GPU part of a measured time is what remains of it above the host floor.
Leave-one-out on the fit grid and a held-out grid chose the weights and K (benchmarks/results/profile/README.md);
predict(exclude_label=) leaves a measured call out of its neighbours and of the host floors, for that check.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..params import AttentionParams
from ..platform import Platform
from .timing import attention_flops, mode_of

PROFILE_DIR = Path(__file__).with_name("profiles")
K_NEIGHBOURS = 1
# Distance per log2 unit (a doubling) of each size; and for a different memory format.
WEIGHTS = {"d_qk": 4.0, "d_v": 2.0, "sq": 0.5, "skv": 0.25, "span": 1.0, "bh": 1.0, "gqa": 2.0}
FORMAT_MISMATCH = 1.5
_FEATURES = tuple(WEIGHTS)
COMBINE = 8.0  # t = (H^p + G^p)^(1/p): close to max(H, G), smooth where they meet


def features(p: AttentionParams) -> tuple[tuple, dict[str, float], str]:
    """(kind, log2 sizes, memory format) of a call, as the profile compares calls."""
    left, right = p.window_size
    span = p.max_seqlen_kv
    if p.has_sliding_window and left >= 0:
        span = min(span, left + (right if right >= 0 else 0) + 1)
    mask = "window" if p.has_sliding_window else ("causal" if p.is_causal else "none")
    kind = (p.is_training, mask, p.has_padding)
    if p.inference_kv_cache:  # a decode/prefill step over a cache: compared only with measured cache steps
        kind += ("kv-cache paged" if p.kv_cache_paged else "kv-cache",)
    log2 = {"d_qk": math.log2(p.head_dim_qk), "d_v": math.log2(p.head_dim_v), "sq": math.log2(p.max_seqlen_q),
            "skv": math.log2(p.max_seqlen_kv), "span": math.log2(max(1, span)),
            "bh": math.log2(p.batch_size * p.num_heads), "gqa": math.log2(p.gqa_ratio)}
    fmt = "sbhd" if p.qkv_format == "sbhd" else "bshd"
    return kind, log2, fmt


def work(p: AttentionParams) -> float:
    """The call's nominal matmul flops (full-length sequences, also for thd): the unit rates are kept in."""
    return attention_flops(p, mode_of(p))


@dataclass(frozen=True)
class Entry:
    label: str
    kind: tuple
    log2: dict[str, float]
    fmt: str
    work: float
    times_ms: dict[str, float]


@dataclass(frozen=True)
class Prediction:
    """Predicted step time (ms) of each provider the profile knows for this kind of call, and the measured calls
    nearest to it."""

    times_ms: dict[str, float]
    neighbours: tuple[str, ...]

    def best(self, candidates: list[str]) -> str | None:
        known = [(self.times_ms[c], i, c) for i, c in enumerate(candidates) if c in self.times_ms]
        return min(known)[2] if known else None


class Profile:
    def __init__(self, data: dict[str, Any], source: str = ""):
        self.source = source
        self.arch: str = data["arch"]
        self.machines: list[str] = data.get("machines", [])
        self.stack: dict[str, str] = data.get("stack", {})
        self.date: str = data.get("date", "")
        self.entries = [Entry(e["label"], tuple(e["kind"]), e["log2"], e["fmt"], e["work"], e["times_ms"])
                        for e in data["entries"]]
        # Host floors per (provider, training, packed) and per (provider, training): the two least times with their
        # calls (so that leave-one-out can leave a call out of the floor too). Packed (thd) calls cost more per call.
        self._floors: dict[tuple, list[tuple[float, str]]] = {}
        self.host_ms: dict[tuple[str, bool], float] = {}  # (provider, training): the least time of any call
        for e in self.entries:
            for provider, ms in e.times_ms.items():
                for key in ((provider, e.kind[0], e.kind[2]), (provider, e.kind[0], None)):
                    self._floors[key] = sorted(self._floors.get(key, []) + [(ms, e.label)])[:2]
                self.host_ms[(provider, e.kind[0])] = min(self.host_ms.get((provider, e.kind[0]), math.inf), ms)
        # Per kind of call, (entry, its log2 sizes in _FEATURES order): a fresh decision compares only these.
        self._by_kind: dict[tuple, list[tuple[Entry, tuple[float, ...]]]] = {}
        for e in self.entries:
            self._by_kind.setdefault(e.kind, []).append((e, tuple(e.log2[f] for f in _FEATURES)))

    def describe(self) -> str:
        stack = ", ".join(f"{k} {v}" for k, v in self.stack.items())
        return f"the {self.arch} profile measured on {' and '.join(self.machines)} ({stack}; {self.date})"

    def predict(self, params: AttentionParams, *, exclude_label: str | None = None) -> Prediction:
        kind, log2, fmt = features(params)
        here = tuple(log2[f] for f in _FEATURES)
        scale = tuple(WEIGHTS[f] for f in _FEATURES)
        near = sorted(
            (sum(w * abs(a - b) for w, a, b in zip(scale, here, sizes)) + (FORMAT_MISMATCH if e.fmt != fmt else 0.0),
             i, e)
            for i, (e, sizes) in enumerate(self._by_kind.get(kind, ())) if e.label != exclude_label)
        hosts: dict[str, float] = {}
        rates: dict[str, list[tuple[float, float]]] = {}
        for dist, _, e in near:
            for provider, ms in e.times_ms.items():
                found = rates.setdefault(provider, [])
                if len(found) >= K_NEIGHBOURS:
                    continue
                host = hosts.get(provider)
                if host is None:
                    host = hosts[provider] = self._host(provider, kind, exclude_label)
                gpu = max(ms ** COMBINE - host ** COMBINE, (0.05 * ms) ** COMBINE) ** (1.0 / COMBINE)
                found.append((dist, math.log(e.work / gpu)))
        times = {}
        amount = work(params)
        for provider, found in rates.items():
            weights = [1.0 / (dist + 0.25) for dist, _ in found]
            rate = math.exp(sum(w * lr for w, (_, lr) in zip(weights, found)) / sum(weights))
            host = hosts[provider]
            times[provider] = (host ** COMBINE + (amount / rate) ** COMBINE) ** (1.0 / COMBINE)
        return Prediction(times, tuple(e.label for _, _, e in near[:K_NEIGHBOURS]))

    def _host(self, provider: str, kind: tuple, exclude_label: str | None = None) -> float:
        """The provider's host floor for this kind of call: the least time of calls of the same training mode and
        packing, else of that training mode (leaving exclude_label's call out)."""
        for key in ((provider, kind[0], kind[2]), (provider, kind[0], None)):
            for ms, label in self._floors.get(key, ()):
                if label != exclude_label:
                    return ms
        return 0.0


def arch_of(platform: Platform) -> str | None:
    return f"sm{platform.sm}" if platform.device_type == "cuda" and platform.sm else None


@lru_cache(maxsize=8)
def _load(path: str) -> Profile:
    return Profile(json.loads(Path(path).read_text()), source=path)


def profile_for(platform: Platform, directory: Path = PROFILE_DIR) -> Profile | None:
    """The shipped profile for the platform's architecture, or None."""
    arch = arch_of(platform)
    if arch is None:
        return None
    path = directory / f"{arch}.json"
    return _load(str(path)) if path.is_file() else None


def build(rows: list[dict], *, arch: str, machines: list[str], stack: dict[str, str], date: str) -> dict[str, Any]:
    """A profile from bench_user_step.py rows: each row's provider times (SDPA and policy columns left out)."""
    entries = []
    for row in rows:
        times = {n: t for n, t in row["times_ms"].items() if ":" in n}
        if not times:
            continue
        kind, log2, fmt = features(AttentionParams(**row["params"]))
        entries.append({"label": row["label"], "kind": list(kind), "log2": {k: round(v, 4) for k, v in log2.items()},
                        "fmt": fmt, "work": work(AttentionParams(**row["params"])),
                        "times_ms": {k: round(v, 5) for k, v in times.items()}})
    return {"arch": arch, "machines": machines, "stack": stack, "date": date, "entries": entries}
