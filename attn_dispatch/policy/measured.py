"""The measured policy: on first sight of a shape bucket, time the eligible engines and keep the fastest.

Opt in with ATTN_DISPATCH_POLICY=measured or select(..., policy='measured'); the default stays the documented
preference order. Selection calls the policy through `attn_dispatch.selection.measured_policy_hook` only when a
decision is not cached, so the hot path never pays for it.

How a bucket is tuned: every eligible provider (eligible for the call and for the bucket's representative
shape) runs once as a probe; those within `prune_ratio` of the best probe are then timed properly (median of
several calls after warm-up, CUDA events on the GPU). Forward alone in inference, forward + backward in
training. The result goes to the persistent cache (see cache.py), so the next process starts tuned.

Tuning is skipped (the preference order decides, with one warning per bucket) when it cannot run honestly:
during CUDA graph capture, inside torch.compile tracing, or for a platform other than this machine.
`attn-dispatch tune --shapes FILE` tunes ahead of time.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..decision import Verdict
from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from .buckets import BucketScheme
from .cache import TuningCache, cache_dir
from .timing import TimerSettings, mode_of, time_engine

logger = logging.getLogger("attn_dispatch.policy")

TUNING_SETTINGS = TimerSettings(warmup=2, reps=5, max_reps=30, target_ms=20.0)
PROBE_SETTINGS = TimerSettings(warmup=1, reps=1, max_reps=1, target_ms=0.0)
PRUNE_RATIO = 1.5
TUNING_ROUNDS = 3


@dataclass
class TuneResult:
    bucket: str
    representative: AttentionParams
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
    """Callable as selection's measured_policy_hook: (params, platform, eligible verdicts) -> provider id."""

    def __init__(self, *, scheme: BucketScheme = BucketScheme(), settings: TimerSettings = TUNING_SETTINGS,
                 probe_settings: TimerSettings = PROBE_SETTINGS, prune_ratio: float = PRUNE_RATIO,
                 directory: str | None = None):
        if not prune_ratio >= 1.0:
            raise ValueError(f"prune_ratio={prune_ratio!r} must be >= 1 (1.5 times the best probe, say)")
        self.scheme, self.settings, self.probe_settings = scheme, settings, probe_settings
        self.prune_ratio = prune_ratio
        self.directory = directory  # None: cache_dir(), read from the environment at each use
        self._caches: dict[tuple[str, Platform], TuningCache] = {}
        self._failed: set[tuple[str, str]] = set()  # (bucket, provider) that raised in this process
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # --- the hook ---------------------------------------------------------------------------------------
    def __call__(self, params: AttentionParams, platform: Platform, eligible: list[Verdict]) -> str | None:
        candidates = [v.id for v in eligible]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        return self.choose(params, platform, candidates).chosen

    def choose(self, params: AttentionParams, platform: Platform, candidates: list[str], *,
               retune: bool = False) -> TuneResult:
        """Look the bucket up; time the candidates it has no time for (all of them with retune)."""
        bucket = self.scheme.key(params)
        representative = self.scheme.representative(params)
        with self._lock:
            cache = self.cache_for(platform)
            entry = None if retune else cache.get(bucket)
            missing = [c for c in candidates if retune or self._untimed(entry, bucket, c)]
            tuned_now = False
            if missing:
                reason = why_not_tunable(params, platform)
                if reason is None:
                    entry = self._tune(representative, platform, missing, entry, bucket)
                    cache.put(bucket, entry)
                    tuned_now = True
                elif bucket not in self._warned:
                    self._warned.add(bucket)
                    logger.warning("measured policy: %s untimed for %s because %s; %s. Run `attn-dispatch tune` "
                                   "ahead of time to avoid this.", ", ".join(missing), params.describe(), reason,
                                   "using the fastest timed one" if fastest(entry, candidates) else
                                   "the preference order decides")
            chosen = fastest(entry, candidates)
        return TuneResult(bucket, representative, entry or {}, chosen, tuned_now)

    def tune(self, params: AttentionParams, platform: Platform | None = None, env: EnvFlags | None = None, *,
             retune: bool = False) -> TuneResult:
        """Tune params' bucket for every provider eligible for this call (what `attn-dispatch tune` runs)."""
        from ..selection import explain

        platform = Platform.detect() if platform is None else platform
        reason = why_not_tunable(params, platform)
        if reason is not None:
            raise ValueError(f"cannot tune {params.describe()}: {reason}")
        decision = explain(params, platform, env, use_cache=False)
        candidates = [v.id for v in decision.verdicts if v.eligible]
        return self.choose(params, platform, candidates, retune=retune)

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

    def _tune(self, representative: AttentionParams, platform: Platform, providers: list[str],
              entry: dict | None, bucket: str) -> dict[str, Any]:
        from ..backends import get_engine

        started = time.perf_counter()
        mode = mode_of(representative)
        entry = _fresh_entry(representative, mode, self.settings) if not entry else _copy(entry)
        ok_at_rep = self._eligible_at(representative, platform)
        engines = {}
        for pid in providers:
            if pid not in ok_at_rep:
                entry["skipped"][pid] = "not eligible at the bucket's representative shape " \
                                        f"({representative.describe()})"
                continue
            try:
                engines[pid] = get_engine(pid)
            except Exception as exc:  # noqa: BLE001 - an engine that fails to load is reported, never fatal
                self._record_failure(entry, bucket, pid, exc)
        to_time = list(engines)
        if len(engines) > 1:
            probes = {pid: self._time(pid, engines[pid], representative, mode, self.probe_settings, entry, bucket)
                      for pid in engines}
            probes = {pid: t for pid, t in probes.items() if t is not None}
            best = min(list(probes.values()) + [t for t in entry["times_ms"].values() if t is not None],
                       default=None)
            to_time = []
            for pid, t in probes.items():
                if best is not None and t > self.prune_ratio * best:
                    entry["probe_ms"][pid] = t
                else:
                    to_time.append(pid)
        # Finalists are timed in interleaved rounds, median per engine: a GPU's clock drifts under load (the H100
        # here throttles at its power cap), and timing one engine after the other hands that drift to one of them.
        samples: dict[str, list[float] | None] = {pid: [] for pid in to_time}
        for _ in range(TUNING_ROUNDS if len(to_time) > 1 else 1):
            for pid in [p for p in to_time if samples[p] is not None]:
                t = self._time(pid, engines[pid], representative, mode, self.settings, entry, bucket)
                if t is None:
                    samples[pid] = None  # failed: left out of this bucket
                else:
                    samples[pid].append(t)
        for pid, ts in samples.items():
            if ts:
                entry["times_ms"][pid] = statistics.median(ts)
                entry["probe_ms"].pop(pid, None)
        entry["tuning_s"] = round(entry.get("tuning_s", 0.0) + time.perf_counter() - started, 4)
        entry["tuned_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        entry["chosen"] = fastest(entry, list({**entry["probe_ms"], **entry["times_ms"]}))
        logger.info("measured policy: %s -> %s (%s ms; tuning took %.2f s)", representative.describe(),
                    entry["chosen"], ", ".join(f"{k} {v:.3f}" for k, v in sorted(entry["times_ms"].items())),
                    entry["tuning_s"])
        return entry

    def _time(self, pid: str, engine: Any, params: AttentionParams, mode: str, settings: TimerSettings, entry: dict,
              bucket: str) -> float | None:
        try:
            return time_engine(engine, params, mode, settings).median_ms
        except Exception as exc:  # noqa: BLE001 - an engine that fails here is left out of this bucket
            self._record_failure(entry, bucket, pid, exc)
            _release_cuda_memory(params)
            return None

    def _record_failure(self, entry: dict, bucket: str, pid: str, exc: BaseException) -> None:
        self._failed.add((bucket, pid))
        entry["errors"][pid] = f"{type(exc).__name__}: {exc}"[:500]
        logger.warning("measured policy: %s failed while being timed and is left out of this bucket: %s", pid,
                       entry["errors"][pid])

    @staticmethod
    def _eligible_at(params: AttentionParams, platform: Platform) -> set[str]:
        """Providers whose tables accept the representative shape. The call's own verdicts already applied the
        environment, so this looks at the shape alone (a permissive env)."""
        from .. import selection

        env = EnvFlags(allow_untested_versions=True)
        return {t.id for t in selection.TABLES.values() if t.evaluate(params, platform, env).eligible}


def _fresh_entry(representative: AttentionParams, mode: str, settings: TimerSettings) -> dict[str, Any]:
    return {"shape": representative.to_dict(), "mode": mode, "settings": settings.to_dict(), "times_ms": {},
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


def install(policy: MeasuredPolicy | None = None) -> MeasuredPolicy:
    """Make `policy` (default: the process-wide one) the measured policy selection calls; clears cached
    decisions so that calls already decided under another hook are decided again."""
    from .. import selection

    policy = policy or default_policy()
    selection.measured_policy_hook = policy
    selection.clear_cache()
    return policy
