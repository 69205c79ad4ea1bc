"""select(params, platform, env) -> Decision: every check of every backend, then a preference order.

The preference order lives here and only here (`preference_order`). Decisions are cached on the
(params, platform, env, force, policy) tuple; AttentionParams and Platform carry precomputed hashes.
"""
from __future__ import annotations

import logging
from typing import Callable

from .constraints import TABLES
from .decision import Decision, NoBackendAvailableError, Reason, Verdict
from .env import FAMILIES, EnvFlags, _validate_forced
from .params import AttentionParams
from .platform import Platform

logger = logging.getLogger("attn_dispatch")

NOT_FORCED = "selection.not_forced"
UNKNOWN_PROVIDER = "selection.unknown_provider"


def preference_order(params: AttentionParams, platform: Platform) -> tuple[tuple[str, ...], str]:
    """Families in the order they are preferred, and why. Transformer Engine's order on each architecture:
    FlashAttention before cuDNN fused attention, except on Hopper and newer, where cuDNN's arbitrary-seqlen
    sub-backend goes first 'for performance reasons' (get_attention_backend). flash-attn-4, which Transformer
    Engine does not use, comes after cuDNN and before FA3/FA2 on the architectures it targets (sm90, sm100)."""
    if params.device_type == "cpu" or platform.device_type == "cpu":
        return ("unfused",), "on the CPU only the unfused engine runs"
    if platform.sm >= 90:
        return (("cudnn_fused", "flash_attn_4", "flash_attn_3", "flash_attn_2", "unfused"),
                f"sm{platform.sm} (Hopper or newer): Transformer Engine prefers cuDNN fused attention, then FlashAttention")
    return (("flash_attn_2", "cudnn_fused", "flash_attn_4", "flash_attn_3", "unfused"),
            f"sm{platform.sm}: Transformer Engine prefers FlashAttention 2, then cuDNN fused attention")


def _apply_order_rules(order: tuple[str, ...], verdicts: list[Verdict], platform: Platform) -> tuple[str, ...]:
    """Transformer Engine prefers cuDNN on Hopper only with its arbitrary-seqlen sub-backend."""
    if platform.sm >= 90 and order[0] == "cudnn_fused":
        cudnn = next((v for v in verdicts if v.backend == "cudnn_fused" and v.eligible), None)
        if cudnn is not None and cudnn.detail.get("sub_backend") == "F16_max512_seqlen":
            return tuple(f for f in order if f != "cudnn_fused")[:-1] + ("cudnn_fused", "unfused")
    return order


_CACHE: dict[tuple, Decision] = {}
_CACHE_LIMIT = 4096
_seen_logged: set[tuple] = set()
measured_policy_hook: Callable[[AttentionParams, Platform, list[Verdict]], str | None] | None = None


def clear_cache() -> None:
    _CACHE.clear()
    _seen_logged.clear()


def explain(params: AttentionParams, platform: Platform | None = None, env: EnvFlags | None = None, *,
            force: str | None = None, policy: str | None = None, use_cache: bool = True) -> Decision:
    """The Decision for this call, with every backend's verdict. Never raises for 'nothing qualifies'."""
    platform = Platform.detect() if platform is None else platform
    env = EnvFlags.from_environ() if env is None else env
    key = (params, platform, platform.name, env, force, policy)  # each part carries a precomputed hash
    if use_cache:
        decision = _CACHE.get(key)
        if decision is not None:
            return decision
    decision = _decide(params, platform, env, force, policy)
    if use_cache:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = decision
    _log(key, decision, env)
    return decision


def select(params: AttentionParams, platform: Platform | None = None, env: EnvFlags | None = None, *,
           force: str | None = None, policy: str | None = None, use_cache: bool = True) -> Decision:
    """Like explain, but raises NoBackendAvailableError when nothing (or not the forced backend) qualifies."""
    decision = explain(params, platform, env, force=force, policy=policy, use_cache=use_cache)
    if decision.chosen is None:
        raise NoBackendAvailableError(decision)
    return decision


def _decide(params: AttentionParams, platform: Platform, env: EnvFlags, force: str | None,
            policy: str | None) -> Decision:
    forced, forced_by = (force, "the force= argument") if force else (env.forced_backend, "ATTN_DISPATCH_BACKEND")
    if force:
        _validate_forced("force", force)
    forced_family, _, forced_provider = (forced or "").partition(":")
    verdicts = []
    for table in TABLES.values():
        verdict = table.evaluate(params, platform, env)
        if params.cp_size > 1 and verdict.eligible:
            verdict = _with_cp_blocks(table, verdict, params, platform, env)
        if forced and (table.family != forced_family or (forced_provider and table.provider != forced_provider)):
            verdict = verdict.model_copy(update={
                "eligible": False,
                "reasons": [Reason(code=NOT_FORCED, message=f"{forced_by} forces {forced}",
                                   fix=f"unset {forced_by}" if forced_by.isupper() else None,
                                   source="attn-dispatch")] + verdict.reasons})
        verdicts.append(verdict)
    if forced and forced_provider and not any(v.id == forced for v in verdicts):
        known = ", ".join(v.id for v in verdicts if v.backend == forced_family) or "none declared"
        raise ValueError(f"{forced_by}={forced!r} names no provider of {forced_family}; known: {known}")
    order, order_reason = preference_order(params, platform)
    order = _apply_order_rules(order, verdicts, platform)
    policy = policy or env.policy
    chosen = None
    if policy == "measured" and not forced:
        hook = measured_policy_hook
        if hook is None:
            from .policy import install  # attaches the measured policy on first use (it loads torch)

            hook = install()
        chosen = hook(params, platform, [v for v in verdicts if v.eligible])
    if chosen is None:
        chosen = next((v.id for family in order for v in verdicts if v.backend == family and v.eligible), None)
    rank = {family: i for i, family in enumerate(order)}
    verdicts.sort(key=lambda v: rank.get(v.backend, len(FAMILIES)))
    return Decision(
        chosen=chosen, policy=policy, forced=forced, forced_by=forced_by if forced else None, order=list(order),
        order_reason=order_reason, verdicts=verdicts, params=params.to_dict(), platform=platform.to_dict(),
        params_text=params.describe(), platform_text=platform.describe(),
    )


def _with_cp_blocks(table, verdict: Verdict, params: AttentionParams, platform: Platform, env: EnvFlags) -> Verdict:
    """Context parallelism: the engine must also run every per-block call the CP code makes (declared by
    constraints.context_parallel.block_params); its own table answers each. At run time each block's engine is
    chosen by select() on these same block params."""
    from .constraints.context_parallel import block_params

    for block in block_params(params):
        reasons = list(table.failures(block, platform, env))
        if reasons:
            message = (f"under cp_comm_type={params.cp_comm_type!r}, {table.id} would run per-block calls "
                       f"(sq={block.max_seqlen_q}, skv={block.max_seqlen_kv}, {block.attn_mask_type}, "
                       f"window={block.window_size}, h={block.num_heads}) that it cannot: "
                       + "; ".join(r.message for r in reasons[:3]))
            reason = Reason(code=f"{table.family}.cp_blocks", message=message, fix=reasons[0].fix,
                            source="attn_dispatch.constraints.context_parallel.block_params, composed by selection")
            return verdict.model_copy(update={"eligible": False, "reasons": [reason], "detail": {}})
    return verdict


def _log(key: tuple, decision: Decision, env: EnvFlags) -> None:
    if not env.debug or env.debug_level < 1 or key in _seen_logged:
        return
    _seen_logged.add(key)
    _ensure_debug_handler()
    logger.info("selected %s for %s", decision.chosen or "nothing", decision.params_text)
    if env.debug_level >= 2:
        for v in decision.verdicts:
            if v.eligible:
                logger.debug("  %s: eligible", v.id)
            for r in v.reasons:
                logger.debug("  %s: [%s] %s%s", v.id, r.code, r.message, f" Fix: {r.fix}" if r.fix else "")


def _ensure_debug_handler() -> None:
    """NVTE_DEBUG=1 prints to stderr, as Transformer Engine does, without touching the root logger."""
    if not any(getattr(h, "attn_dispatch_debug", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.attn_dispatch_debug = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("[attn_dispatch %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def warn_unfused_fallback(decision: Decision) -> None:
    """On a GPU, falling back to unfused names why each faster engine was rejected (once per decision)."""
    if decision.backend != "unfused" or decision.params.get("device_type") != "cuda" or decision.forced:
        return
    key = ("fallback", decision.params_text, decision.platform_text)
    if key in _seen_logged:
        return
    _seen_logged.add(key)
    lines = [f"falling back to the unfused engine on a GPU for {decision.params_text}; rejected:"]
    for v in decision.verdicts:
        if v.backend != "unfused" and not v.eligible:
            lines.append(f"  {v.id}: " + "; ".join(r.message for r in v.reasons))
    logger.warning("\n".join(lines))
