"""Choosing among the eligible providers: the policies selection consults (`auto`, the default: the shipped
performance profile; `order`: Transformer Engine's order; `measured`: timed here once per shape bucket; `checked`:
the profile, timing only the providers it predicts too close to call), the
profile, shape buckets, timing and the measured policy's persistent cache.

Nothing here imports selection: selection composes the tables and a policy. Importing this package is light
(torch loads on the first timing).
"""
from __future__ import annotations

from .auto import AutoPolicy
from .base import Choice, Policy
from .buckets import BucketScheme
from .cache import TuningCache, cache_dir
from .checked import CheckedPolicy
from .measured import MeasuredPolicy, TuneResult, default_policy
from .order import OrderPolicy, preference_order
from .profile import Profile, profile_for
from .timing import TimerSettings, Timing, attention_flops, build_inputs, time_engine

__all__ = ["AutoPolicy", "BucketScheme", "CheckedPolicy", "Choice", "MeasuredPolicy", "OrderPolicy", "Policy",
           "Profile", "TimerSettings", "Timing", "TuneResult", "TuningCache", "attention_flops", "build_inputs",
           "cache_dir", "default_policy", "preference_order", "profile_for", "time_engine"]
