"""The measured policy: on first sight of a shape bucket, time the eligible engines and keep the fastest.

Opt in with ATTN_DISPATCH_POLICY=measured or select(..., policy='measured'); the default is the `auto` policy
(the shipped profile), which also reads the buckets tuned here. Selection consults a policy only when a decision
is not cached, so the hot path never pays for it.

How a bucket is tuned: every provider eligible for the call that first reaches the bucket is timed at that call's
shape (what the user's step costs; later calls of the bucket reuse the result) against the others, interleaved
after a warm period (timing.time_interleaved; CUDA events on the GPU). One whose least time over its estimate and
two confirming calls is beyond `prune_ratio` times the best is not timed further (a single estimate right after a
JIT compile or a graph build is no measurement). A packed (thd) call is timed on its own sequence lengths where
selection passes them (the module does), not on full-length sequences (PACKED_LENGTHS; a packed bucket from an
older cache, timed on full lengths, is timed again once). A sample of a call under
2 ms is a block of back-to-back calls after a synchronisation and a lead-in call (TUNING_SETTINGS.block_ms): a
provider in a steady loop of itself, whatever was timed just before it, host launch overhead included where the
GPU does not hide it; longer calls are sampled one at a time. What is timed is what a user's step costs: the
engine called as the module's repeat calls call it (timing.engine_step), forward alone in inference (no_grad),
forward then backward into the leaf tensors' .grad in training. Whenever a candidate is missing from a bucket's
entry, all candidates are timed again together (at the new call's shape), so an entry never compares times taken
at different moments. The entry records what tuning cost (`tuning_s`) and on which lengths (`lengths`). The
result goes to the persistent cache (see cache.py), so the next process starts tuned.

Tuning is skipped (the preference order decides, with one warning per bucket) when it cannot run honestly:
during CUDA graph capture, inside torch.compile tracing, or for a platform other than this machine.
`attn-dispatch tune --shapes FILE` tunes ahead of time.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..params import AttentionParams, SeqLengths
from ..platform import Platform
from .base import Choice
from .buckets import BucketScheme
from .cache import TuningCache, cache_dir
from .timing import TimerSettings, mode_of, time_engines
from ..backends import get_engine

logger = logging.getLogger("attn_dispatch.policy")

# ~60 ms of warm period and >= 30 ms of timed rounds per bucket: close engines differ by a few percent, less than
# a short burst's clock drift on a power-capped GPU. Blocks of ~3 ms: a 0.1 ms call is timed 30 at a time, calls
# over 2 ms one at a time. Bound per bucket (JIT compiles and graph builds aside): per provider, at most 4 calls
# before the warm period (first, estimate, 2 confirming samples), then max(reps, 30 ms / the fastest's sample)
# samples, at most max_reps, of ~block_ms (+ one lead-in call) or one call: about 0.2-0.5 s for 4 providers of
# 0.1-1 ms; above 2 ms, 10 rounds of one call each.
TUNING_SETTINGS = TimerSettings(warmup=2, reps=10, max_reps=60, target_ms=30.0, warm_ms=60.0, confirm=2,
                                block_ms=3.0)
PRUNE_RATIO = 2.0
# PACKED_LENGTHS: a packed call is timed on the tokens per sequence of the call that reached the bucket, as its
# shape is: on a small one the engines rank by the tokens present (timed at full length, one pick ran at 2.2x).
# On a GPU the unfused engine is not timed when a fused one is eligible: it never came within 4.1x of the best fused
# engine over 2329 calls, and its probe cost up to 2 minutes a bucket (benchmarks/results/README.md). It stays the
# choice where nothing else runs.
UNFUSED_ON_GPU_REASON = ("not timed: on a GPU with a fused engine eligible, the unfused engine was 4.1x or more "
                         "slower than the best fused one on every one of 2329 calls measured on the H100 and H200")


def left_untimed(shape: AttentionParams, providers: list[str]) -> dict[str, str]:
    """{provider: why} for the providers a bucket at `shape` does not time."""
    unfused = [p for p in providers if p.startswith("unfused:")]
    if shape.device_type != "cuda" or len(unfused) == len(providers):
        return {}
    return {p: UNFUSED_ON_GPU_REASON for p in unfused}


@dataclass
class TuneResult:
    bucket: str
    timed_shape: AttentionParams  # the call whose shape was timed for the bucket (the first to reach it)
    entry: dict[str, Any]
    chosen: str | None
    tuned_now: bool


def fastest(entry: dict[str, Any] | None, candidates: list[str]) -> str | None:
    """The candidate with the lowest time in the entry (a pruned provider counts with its probe time)."""
    if not entry:
        return None
    times = {**entry.get("probe_ms", {}), **entry.get("times_ms", {})}
    timed = [(times[c], c) for c in candidates if times.get(c) is not None]
    return min(timed)[1] if timed else None


def why_not_tunable(params: AttentionParams, platform: Platform) -> str | None:
    """None when timing can run here and now; else why not."""
    if platform != Platform.detect():
        return "the platform is not this machine (a described platform cannot be timed)"
    import torch

    if params.device_type == "cuda":
        if not torch.cuda.is_available():
            return "the call is on CUDA but this machine has no CUDA GPU"
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    return None


class MeasuredPolicy:
    """The `measured` policy: choose() times the eligible providers once per shape bucket (see the module doc)."""
    name = "measured"

    def __init__(self, *, scheme: BucketScheme = BucketScheme(), settings: TimerSettings = TUNING_SETTINGS,
                 prune_ratio: float = PRUNE_RATIO, directory: str | None = None):
        if not prune_ratio >= 1.0:
            raise ValueError(f"prune_ratio={prune_ratio!r} must be >= 1 (2 times the best estimate, say)")
        self.scheme, self.settings = scheme, settings
        self.prune_ratio = prune_ratio
        self.directory = directory  # None: cache_dir(), read from the environment at each use
        self._caches: dict[tuple[str, Platform], TuningCache] = {}
        self._failed: set[tuple[str, str]] = set()  # (bucket, provider) that raised in this process
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # --- the policy -------------------------------------------------------------------------------------
    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice:
        if len(eligible) <= 1:
            return Choice(eligible[0] if eligible else None,
                          "the only eligible provider" if eligible else "no provider is eligible")
        result = self.tune_bucket(params, platform, eligible, lengths=lengths)
        if result.chosen is None:
            return Choice(eligible[0], f"untimed (bucket {result.bucket}); Transformer Engine's preference order "
                                       "decides")
        times = {**result.entry.get("probe_ms", {}), **result.entry.get("times_ms", {})}
        timed = {p: round(times[p], 4) for p in eligible if times.get(p) is not None}
        how = "timed now" if result.tuned_now else "timed earlier on this machine"
        return Choice(result.chosen, f"measured fastest ({how}, bucket {result.bucket}, at "
                                     f"{result.timed_shape.describe()}): {timed[result.chosen]:.3f} ms per step",
                      timed, "ms per step, measured here")

    def lookup(self, params: AttentionParams, platform: Platform) -> dict[str, Any] | None:
        """The bucket's tuned entry on disk, if any (no timing)."""
        with self._lock:
            return self.cache_for(platform).get(self.scheme.key(params))

    def tune_bucket(self, params: AttentionParams, platform: Platform, candidates: list[str], *,
                    retune: bool = False, lengths: SeqLengths | None = None) -> TuneResult:
        """Look the bucket up; if it has no time for some candidate (or retune), time all candidates together, at
        this call's own shape: what the user's step costs. (Timing the bucket's largest shape instead misled on
        host-bound engines: a held-out grid's encoder d64 s384 b42 training, tuned at b64 where flash-attn-4's ~0.5 ms
        host floor was hidden, picked it at 1.59x cuDNN's time at b42; benchmarks/results/README.md.)"""
        bucket = self.scheme.key(params)
        with self._lock:
            cache = self.cache_for(platform)
            entry = None if retune else cache.get(bucket)
            # a packed bucket timed before entries recorded their lengths was timed on full-length sequences:
            # timed again, once, on this call's (PACKED_LENGTHS)
            unsized = entry is not None and "lengths" not in entry and _timed_lengths(params, lengths) is not None
            missing = [c for c in candidates if retune or unsized or self._untimed(entry, bucket, c)]
            tuned_now = False
            if missing:
                reason = why_not_tunable(params, platform)
                if reason is None:
                    timeable = [c for c in candidates if (bucket, c) not in self._failed]
                    entry = self._tune(params, platform, timeable, entry, bucket, lengths)
                    cache.put(bucket, entry)
                    tuned_now = True
                elif bucket not in self._warned:
                    self._warned.add(bucket)
                    logger.warning("measured policy: %s untimed for %s because %s; %s. Run `attn-dispatch tune` "
                                   "ahead of time to avoid this.", ", ".join(missing), params.describe(), reason,
                                   "using the fastest timed one" if fastest(entry, candidates) else
                                   "the preference order decides")
            chosen = fastest(entry, candidates)
        timed_shape = AttentionParams(**entry["shape"]) if entry and "shape" in entry else params
        return TuneResult(bucket, timed_shape, entry or {}, chosen, tuned_now)

    def tune(self, params: AttentionParams, platform: Platform, candidates: list[str], *,
             retune: bool = False) -> TuneResult:
        """Tune params' bucket for these candidates now (what `attn-dispatch tune` runs, with the providers
        selection found eligible); ValueError when timing cannot run here."""
        reason = why_not_tunable(params, platform)
        if reason is not None:
            raise ValueError(f"cannot tune {params.describe()}: {reason}")
        return self.tune_bucket(params, platform, candidates, retune=retune)

    def cache_for(self, platform: Platform) -> TuningCache:
        directory = self.directory or str(cache_dir())
        cache = self._caches.get((directory, platform))
        if cache is None:
            cache = self._caches[(directory, platform)] = TuningCache(platform, directory)
        return cache

    # --- tuning -----------------------------------------------------------------------------------------
    def _untimed(self, entry: dict | None, bucket: str, provider: str) -> bool:
        if (bucket, provider) in self._failed:
            return False
        if not entry:
            return True
        return not any(provider in entry.get(k, {}) for k in ("times_ms", "probe_ms", "skipped"))

    def _tune(self, shape: AttentionParams, platform: Platform, providers: list[str],
              entry: dict | None, bucket: str, lengths: SeqLengths | None = None) -> dict[str, Any]:
        """Time providers at `shape` (a call's own, eligible for each of them; on its sequence lengths where given)
        into the bucket's entry: a fresh one where the entry's times were taken at another shape or on other
        lengths, so that an entry never mixes them."""
        started = time.perf_counter()
        mode = mode_of(shape)
        lengths = _timed_lengths(shape, lengths)
        timed_on = [list(side) for side in lengths] if lengths is not None else "full"
        same_shape = entry and entry.get("shape") == shape.to_dict() and entry.get("lengths", "full") == timed_on
        entry = _copy(entry) if same_shape else _fresh_entry(shape, mode, self.settings)
        entry["settings"] = self.settings.to_dict()
        untimed = left_untimed(shape, providers)
        entry["skipped"].update(untimed)
        engines = {}
        for pid in providers:
            if pid in untimed:
                continue
            try:
                engines[pid] = get_engine(pid)
            except Exception as exc:  # noqa: BLE001 - an engine that fails to load is reported, never fatal
                self._record_failure(entry, bucket, pid, exc)
        if engines:
            entry["lengths"] = timed_on  # what was timed: "full" sequences, or the call's [query, key] lengths
            timings, errors = time_engines(engines, shape, mode, self.settings, lengths=lengths,
                                           cutoff_ratio=self.prune_ratio if len(engines) > 1 else None)
            for pid, exc in errors.items():
                self._record_failure(entry, bucket, pid, exc)
            if errors:
                _release_cuda_memory(shape)
            for pid, timing in timings.items():
                times, other = ("probe_ms", "times_ms") if timing.cut_short else ("times_ms", "probe_ms")
                entry[times][pid] = timing.median_ms
                entry[other].pop(pid, None)
        entry["tuning_s"] = round(entry.get("tuning_s", 0.0) + time.perf_counter() - started, 4)
        entry["tuned_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        entry["chosen"] = fastest(entry, list({**entry["probe_ms"], **entry["times_ms"]}))
        logger.info("measured policy: %s -> %s (%s ms; tuning took %.2f s)", shape.describe(),
                    entry["chosen"], ", ".join(f"{k} {v:.3f}" for k, v in sorted(entry["times_ms"].items())),
                    entry["tuning_s"])
        return entry

    def _record_failure(self, entry: dict, bucket: str, pid: str, exc: BaseException) -> None:
        self._failed.add((bucket, pid))
        entry["errors"][pid] = f"{type(exc).__name__}: {exc}"[:500]
        logger.warning("measured policy: %s failed while being timed and is left out of this bucket: %s", pid,
                       entry["errors"][pid])


def _timed_lengths(shape: AttentionParams, lengths: SeqLengths | None) -> SeqLengths | None:
    """The sequence lengths a bucket is timed on (PACKED_LENGTHS): a packed (thd) call's own, where given; None,
    full lengths, otherwise."""
    return lengths if shape.qkv_format == "thd" else None


def _fresh_entry(shape: AttentionParams, mode: str, settings: TimerSettings) -> dict[str, Any]:
    return {"shape": shape.to_dict(), "mode": mode, "settings": settings.to_dict(), "times_ms": {},
            "probe_ms": {}, "skipped": {}, "errors": {}, "tuning_s": 0.0}


def _copy(entry: dict[str, Any]) -> dict[str, Any]:
    copied = dict(entry)
    for key in ("times_ms", "probe_ms", "skipped", "errors"):
        copied[key] = dict(entry.get(key, {}))
    return copied


def _release_cuda_memory(params: AttentionParams) -> None:
    if params.device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


_DEFAULT: MeasuredPolicy | None = None


def default_policy() -> MeasuredPolicy:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MeasuredPolicy()
    return _DEFAULT
