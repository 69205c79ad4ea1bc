"""EnvFlags: what the user allows or forces through the environment, with Transformer Engine's meanings.

Parsed once per distinct set of raw values; a value outside the accepted set raises ValueError naming
the variable, the value and what is accepted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

FAMILIES = ("flash_attn_4", "flash_attn_3", "cudnn_fused", "flash_attn_2", "flex_attention", "mem_efficient",
            "unfused")

# NVTE_FUSED_ATTN_BACKEND values, as Transformer Engine's NVTE_Fused_Attn_Backend enum numbers them.
FUSED_SUB_BACKENDS = {"0": "F16_max512_seqlen", "1": "F16_arbitrary_seqlen", "2": "FP8"}
POLICIES = ("auto", "order", "measured", "checked")

ENV_VARS = (
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "NVTE_FUSED_ATTN_BACKEND",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "NVTE_FP8_DPA_BWD",
    "NVTE_DEBUG",
    "NVTE_DEBUG_LEVEL",
    "ATTN_DISPATCH_BACKEND",
    "ATTN_DISPATCH_POLICY",
    "ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS",
)
# One switch for every mechanism that reads private torch or CPython internals to save host time (the C++ tensor
# guard, autograd's raw apply, the raw CUDA stream, nn.Module.__call__'s shortcut, flash-attn-4's launch replay,
# the raw environment read of freshness.py): ATTN_DISPATCH_PRIVATE_TORCH=0, read once at import, turns them all off.
PRIVATE_TORCH = os.environ.get("ATTN_DISPATCH_PRIVATE_TORCH", "1") != "0"

# The variables a decision depends on (the debug switches only change what is logged): a plan made under other
# values of these is stale (freshness.current_stamp).
DECISION_ENV_VARS = tuple(name for name in ENV_VARS if name not in ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL"))


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable `name` (default when unset), refused with what is accepted unless in `choices`."""
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"environment variable {name}={raw!r} is not accepted; use one of {', '.join(choices)}")
    return raw


def _flag(name: str, raw: str | None, default: bool) -> bool:
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"environment variable {name}={raw!r} is not accepted; use 0 or 1")
    return raw == "1"


@dataclass(frozen=True)
class EnvFlags:
    flash_attn: bool = True          # NVTE_FLASH_ATTN: 0 disables every FlashAttention family
    fused_attn: bool = True          # NVTE_FUSED_ATTN: 0 disables cuDNN fused attention
    unfused_attn: bool = True        # NVTE_UNFUSED_ATTN: 0 disables the unfused PyTorch engine
    fused_attn_backend: str | None = None  # NVTE_FUSED_ATTN_BACKEND pins a cuDNN sub-backend
    allow_nondeterministic: bool = True    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 demands deterministic kernels
    # NVTE_FP8_DPA_BWD: with fp8_dpa, 1 runs the backward in FP8 too; 0 runs an FP8 forward and the F16/BF16 fused
    # backward on the high-precision q, k, v and O (Transformer Engine pytorch/attention/dot_product_attention/
    # backends.py FusedAttnFunc: is_bwd_fp8 = fp8 and int(os.getenv("NVTE_FP8_DPA_BWD", "1")))
    fp8_dpa_bwd: bool = True
    debug: bool = False               # NVTE_DEBUG
    debug_level: int = 0              # NVTE_DEBUG_LEVEL: 0, 1 (chosen backend) or 2 (every verdict)
    forced_backend: str | None = None  # ATTN_DISPATCH_BACKEND: 'family' or 'family:provider'
    policy: str = "auto"              # ATTN_DISPATCH_POLICY: auto (shipped profile), order (TE's), measured, checked
    allow_untested_versions: bool = False  # ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1
    raw: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # the decision cache hashes this on every call: once is enough
        object.__setattr__(self, "_hash", hash((self.flash_attn, self.fused_attn, self.unfused_attn,
                                                self.fused_attn_backend, self.allow_nondeterministic,
                                                self.fp8_dpa_bwd, self.debug,
                                                self.debug_level, self.forced_backend, self.policy,
                                                self.allow_untested_versions)))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def from_environ(environ: Mapping[str, str] | None = None) -> "EnvFlags":
        """Parsed flags of os.environ (or of the mapping given); about 1 us when nothing changed."""
        if environ is None:
            return _parse_cached(current_raw())
        return _parse_cached(tuple(environ.get(name) for name in ENV_VARS))

    @staticmethod
    def parse(environ: Mapping[str, str]) -> "EnvFlags":
        return EnvFlags.from_environ(environ)

    def family_enabled(self, family: str) -> bool:
        if family.startswith("flash_attn"):
            return self.flash_attn
        if family == "cudnn_fused":
            return self.fused_attn
        return self.unfused_attn

    @property
    def forced_family(self) -> str | None:
        return self.forced_backend.partition(":")[0] if self.forced_backend else None

    @property
    def forced_provider(self) -> str | None:
        if not self.forced_backend or ":" not in self.forced_backend:
            return None
        return self.forced_backend.partition(":")[2]

    @property
    def fused_sub_backend_name(self) -> str | None:
        return FUSED_SUB_BACKENDS.get(self.fused_attn_backend) if self.fused_attn_backend else None


_PARSED: dict[tuple, EnvFlags] = {}


def current_raw() -> tuple:
    """The raw values of ENV_VARS now (None where unset), read through os.environ. Like Transformer Engine, the
    environment is read when a decision is made: a decision (and a module's plan) made earlier stands until
    `attn_dispatch.clear_cache()`; nothing watches the process environment in between."""
    environ = os.environ
    return tuple(environ.get(name) for name in ENV_VARS)


def _parse_cached(raw_values: tuple) -> EnvFlags:
    flags = _PARSED.get(raw_values)
    if flags is None:
        text = tuple(os.environ.decodevalue(v) if isinstance(v, bytes) else v for v in raw_values)
        flags = _parse(dict(zip(ENV_VARS, text)))
        if len(_PARSED) > 256:
            _PARSED.clear()
        _PARSED[raw_values] = flags
    return flags


def _parse(values: dict[str, str | None]) -> EnvFlags:
    sub_backend = values["NVTE_FUSED_ATTN_BACKEND"] or None
    if sub_backend is not None and sub_backend not in FUSED_SUB_BACKENDS:
        accepted = ", ".join(f"{k} ({v})" for k, v in FUSED_SUB_BACKENDS.items())
        raise ValueError(f"environment variable NVTE_FUSED_ATTN_BACKEND={sub_backend!r} is not accepted; "
                         f"use {accepted}")
    level_raw = values["NVTE_DEBUG_LEVEL"]
    if level_raw not in (None, "", "0", "1", "2"):
        raise ValueError(f"environment variable NVTE_DEBUG_LEVEL={level_raw!r} is not accepted; use 0, 1 or 2")
    forced = (values["ATTN_DISPATCH_BACKEND"] or "").strip() or None
    if forced in ("auto",):
        forced = None
    if forced is not None:
        _validate_forced("ATTN_DISPATCH_BACKEND", forced)
    policy = (values["ATTN_DISPATCH_POLICY"] or "auto").strip()
    if policy not in POLICIES:
        raise ValueError(f"environment variable ATTN_DISPATCH_POLICY={policy!r} is not accepted; "
                         f"use one of {', '.join(POLICIES)}")
    return EnvFlags(
        flash_attn=_flag("NVTE_FLASH_ATTN", values["NVTE_FLASH_ATTN"], True),
        fused_attn=_flag("NVTE_FUSED_ATTN", values["NVTE_FUSED_ATTN"], True),
        unfused_attn=_flag("NVTE_UNFUSED_ATTN", values["NVTE_UNFUSED_ATTN"], True),
        fused_attn_backend=sub_backend,
        allow_nondeterministic=_flag("NVTE_ALLOW_NONDETERMINISTIC_ALGO",
                                     values["NVTE_ALLOW_NONDETERMINISTIC_ALGO"], True),
        fp8_dpa_bwd=_flag("NVTE_FP8_DPA_BWD", values["NVTE_FP8_DPA_BWD"], True),
        debug=_flag("NVTE_DEBUG", values["NVTE_DEBUG"], False),
        debug_level=int(level_raw) if level_raw else 0,
        forced_backend=forced,
        policy=policy,
        allow_untested_versions=_flag("ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS",
                                      values["ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS"], False),
        raw=tuple((k, v) for k, v in values.items() if v is not None),
    )


def _validate_forced(source: str, forced: str) -> None:
    """'cudnn_fused' or 'flash_attn_2:torch'; provider names are checked against the registry later."""
    family = forced.partition(":")[0]
    if family not in FAMILIES:
        raise ValueError(f"{source}={forced!r} names no backend; use one of {', '.join(FAMILIES)} "
                         "(optionally 'family:provider', e.g. 'flash_attn_2:torch'), or 'auto'")
