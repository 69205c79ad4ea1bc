"""Choosing the fastest engine, not just an eligible one: shape buckets, timing, the measured policy and its
persistent cache, and the benchmark core behind `attn-dispatch bench`.

Importing this package is light (torch loads on the first timing). `install()` attaches the measured policy to
selection; `select(..., policy='measured')` or ATTN_DISPATCH_POLICY=measured then uses it.
"""
from __future__ import annotations

from .buckets import BucketScheme
from .cache import TuningCache, cache_dir
from .measured import MeasuredPolicy, TuneResult, default_policy, install
from .timing import TimerSettings, Timing, attention_flops, build_inputs, time_engine

__all__ = ["BucketScheme", "MeasuredPolicy", "TimerSettings", "Timing", "TuneResult", "TuningCache",
           "attention_flops", "build_inputs", "cache_dir", "default_policy", "install", "time_engine"]
