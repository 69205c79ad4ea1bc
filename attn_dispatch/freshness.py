"""When a plan made earlier still stands: the one invalidation predicate every cached path asks.

A plan (module.py's plan cache, the KV-cache and context-parallel plans, the SDPA function's bound calls) is
stamped when it is made with `current_stamp()`: the runtime facts value (replaced by an engine that failed to load, a
graph cuDNN refused, selection.clear_cache()), torch's determinism flag, and the raw values of the environment
variables that change a decision. A plan stands while its stamp equals the current one, so setting
`NVTE_UNFUSED_ATTN=0` after a first call re-plans the next call, as `explain()` would answer it.

The raw environment read below is one of the private mechanisms env.PRIVATE_TORCH switches off.
"""
from __future__ import annotations

import os

import torch

from . import runtime_facts
from .env import DECISION_ENV_VARS, PRIVATE_TORCH

# torch's determinism flag read in C where allowed (torch.are_deterministic_algorithms_enabled is a Python wrapper
# around this call: a frame less for each stamp, which every cached call takes)
_deterministic_now = getattr(torch._C, "_get_deterministic_algorithms", None) if PRIVATE_TORCH else None
if _deterministic_now is None:
    _deterministic_now = torch.are_deterministic_algorithms_enabled


def _environ_reader():
    """(a function returning the raw values of DECISION_ENV_VARS, and for the private read its store's get and
    keys, else None, None). os.environ.get decodes every key and value (~2 us for the set); os.environ's own store,
    keyed by the encoded names, answers in ~0.3 us. That store is a CPython detail, so it is used only where it
    agrees with os.environ here (checked once), and not at all with the private switch off."""
    names = DECISION_ENV_VARS
    environ = os.environ

    def public() -> tuple:
        return tuple(map(environ.get, names))

    store = getattr(environ, "_data", None)
    encode = getattr(environ, "encodekey", None)
    if not PRIVATE_TORCH or not isinstance(store, dict) or encode is None:
        return public, None, None
    try:
        keys = tuple(encode(name) for name in names)
        decode = environ.decodevalue
        if tuple(None if raw is None else decode(raw) for raw in map(store.get, keys)) != public():
            return public, None, None
        probe = "ATTN_DISPATCH_FRESHNESS_PROBE"
        probe_key = encode(probe)
        environ[probe] = "1"
        seen = store.get(probe_key)
        del environ[probe]
        if seen is None or store.get(probe_key) is not None:
            return public, None, None
    except Exception:  # noqa: BLE001 - an interpreter that keeps os.environ otherwise: use the public reads
        return public, None, None
    get = store.get
    return (lambda: tuple(map(get, keys))), get, keys


environ_now, _ENV_GET, _ENV_KEYS = _environ_reader()

# current_stamp: every cached call asks it (some twice), so it is one frame: the facts value read from its holder
# (runtime_facts._CURRENT, looked up each call, as tests replace it), the flag and the store read inline
if _ENV_GET is not None:
    def current_stamp() -> tuple:
        """What every plan is checked against: (the runtime facts, torch's determinism flag, the decision's
        environment variables as set now)."""
        return runtime_facts._CURRENT[0], _deterministic_now(), tuple(map(_ENV_GET, _ENV_KEYS))
else:
    def current_stamp() -> tuple:
        """What every plan is checked against: (the runtime facts, torch's determinism flag, the decision's
        environment variables as set now)."""
        return runtime_facts._CURRENT[0], _deterministic_now(), environ_now()
