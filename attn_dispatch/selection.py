"""select(params, platform, env) -> Decision: every check of every backend, then a policy's pick.

Selection is the one place that composes: it evaluates every constraint table, orders the eligible providers by
Transformer Engine's preference order (policy/order.py) and hands them to a policy object (policy/: `auto`, the
default, `order` or `measured`), which returns the pick and why. Decisions are cached on the
(params, platform, env, force, policy) tuple; AttentionParams and Platform carry precomputed hashes.
"""
from __future__ import annotations

import logging

from . import runtime_facts
from .constraints import TABLES
from .decision import Decision, NoBackendAvailableError, Reason, Verdict
from .env import FAMILIES, POLICIES, EnvFlags, _validate_forced
from .params import AttentionParams, SeqLengths
from .platform import Platform
from .policy.base import Policy
from .policy.order import apply_order_rules, preference_order
from .policy import AutoPolicy, CheckedPolicy, OrderPolicy, default_policy
from .platform import refresh_detected as probe_again
from .constraints.context_parallel import block_params

logger = logging.getLogger("attn_dispatch")

NOT_FORCED = "selection.not_forced"
UNKNOWN_PROVIDER = "selection.unknown_provider"


_CACHE: dict[tuple, Decision] = {}
_CACHE_LIMIT = 4096
_seen_logged: set[tuple] = set()
_POLICIES: dict[str, Policy] = {}


def policy_named(name: str) -> Policy:
    """The process's policy object for a name in env.POLICIES (built on first use)."""
    policy = _POLICIES.get(name)
    if policy is None:
        makers = {"order": OrderPolicy, "measured": default_policy,
                  "auto": lambda: AutoPolicy(measured=default_policy()),
                  "checked": lambda: CheckedPolicy(policy_named("auto"), default_policy())}
        if name not in makers:
            raise ValueError(f"policy={name!r} is not a policy; use one of {', '.join(makers)}")
        policy = _POLICIES[name] = makers[name]()
    return policy


def set_policy(name: str, policy: Policy) -> None:
    """Use this policy object for `name` from now on (e.g. a MeasuredPolicy with other timer settings or cache
    directory); cached decisions are dropped. `auto` reads the tuned buckets of the `measured` one, and `checked`
    times with it."""
    if name not in POLICIES:
        raise ValueError(f"name={name!r} is not a policy; use one of {', '.join(POLICIES)}")
    _POLICIES[name] = policy
    if name == "measured":
        _POLICIES["auto"] = AutoPolicy(measured=policy)
        _POLICIES["checked"] = CheckedPolicy(_POLICIES["auto"], policy)
    clear_cache()


def clear_cache() -> None:
    """Forget every decision, here and in every module's plans (a new runtime-facts value: their stamp is stale).
    A new runtime fact (an engine that failed to load, a graph cuDNN refused) or an environment change needs no
    call: the live platform carries the facts and a plan's stamp the environment it was made under."""
    _CACHE.clear()
    _seen_logged.clear()
    runtime_facts.renew()


def refresh_detected() -> Platform:
    """Probe the machine again (after installing an engine in a running process, say) and forget decisions."""
    platform = probe_again()
    clear_cache()
    return platform


def explain(params: AttentionParams, platform: Platform | None = None, env: EnvFlags | None = None, *,
            force: str | None = None, policy: str | Policy | None = None, use_cache: bool = True,
            lengths: SeqLengths | None = None) -> Decision:
    """The Decision for this call, with every backend's verdict. Never raises for 'nothing qualifies'. lengths: a
    packed call's own tokens per sequence, for a policy that times the call (not part of the decision's key)."""
    platform = Platform.detect() if platform is None else platform
    env = EnvFlags.from_environ() if env is None else env
    key = (params, platform, platform.name, env, force, policy)  # each part carries a precomputed hash
    if use_cache:
        decision = _CACHE.get(key)
        if decision is not None:
            return decision
    decision = _decide(params, platform, env, force, policy, lengths)
    if use_cache:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = decision
    _log(key, decision, env)
    return decision


def select(params: AttentionParams, platform: Platform | None = None, env: EnvFlags | None = None, *,
           force: str | None = None, policy: str | Policy | None = None, use_cache: bool = True,
           lengths: SeqLengths | None = None) -> Decision:
    """Like explain, but raises NoBackendAvailableError when nothing (or not the forced backend) qualifies."""
    decision = explain(params, platform, env, force=force, policy=policy, use_cache=use_cache, lengths=lengths)
    if decision.chosen is None:
        raise NoBackendAvailableError(decision)
    return decision


def _decide(params: AttentionParams, platform: Platform, env: EnvFlags, force: str | None,
            policy: str | Policy | None, lengths: SeqLengths | None = None) -> Decision:
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
                "reasons": (Reason(code=NOT_FORCED, message=f"{forced_by} forces {forced}",
                                   fix=f"unset {forced_by}" if forced_by.isupper() else None,
                                   source="attn-dispatch"), *verdict.reasons)})
        verdicts.append(verdict)
    if forced and forced_provider and not any(v.id == forced for v in verdicts):
        known = ", ".join(v.id for v in verdicts if v.backend == forced_family) or "none declared"
        raise ValueError(f"{forced_by}={forced!r} names no provider of {forced_family}; known: {known}")
    order, order_reason = preference_order(params, platform)
    order = apply_order_rules(order, verdicts, platform)
    policy_obj = policy_named(policy or env.policy) if not hasattr(policy, "choose") else policy
    eligible = [v.id for family in order for v in verdicts if v.backend == family and v.eligible]
    if forced:
        chosen = eligible[0] if eligible else None
        choice_reason, estimates, unit = (f"forced by {forced_by}" if chosen else ""), {}, ""
    else:
        choice = policy_obj.choose(params, platform, eligible, lengths)
        chosen, choice_reason, estimates, unit = choice.chosen, choice.reason, choice.estimates, choice.unit
    rank = {family: i for i, family in enumerate(order)}
    verdicts.sort(key=lambda v: rank.get(v.backend, len(FAMILIES)))
    return Decision(
        chosen=chosen, policy=policy_obj.name, policy_reason=choice_reason, estimates=estimates, estimate_unit=unit,
        forced=forced, forced_by=forced_by if forced else None, order=list(order),
        order_reason=order_reason, verdicts=verdicts, params=params.to_dict(), platform=platform.to_dict(),
        params_text=params.describe(), platform_text=platform.describe(),
    )


def _with_cp_blocks(table, verdict: Verdict, params: AttentionParams, platform: Platform, env: EnvFlags) -> Verdict:
    """Context parallelism: the engine must also run every per-block call the CP code makes (declared by
    constraints.context_parallel.block_params); its own table answers each. At run time each block's engine is
    chosen by select() on these same block params."""
    for block in block_params(params):
        reasons = list(table.failures(block, platform, env))
        if reasons:
            message = (f"under cp_comm_type={params.cp_comm_type!r}, {table.id} would run per-block calls "
                       f"(sq={block.max_seqlen_q}, skv={block.max_seqlen_kv}, {block.attn_mask_type}, "
                       f"window={block.window_size}, h={block.num_heads}) that it cannot: "
                       + "; ".join(r.message for r in reasons[:3]))
            reason = Reason(code=f"{table.family}.cp_blocks", message=message, fix=reasons[0].fix,
                            source="attn_dispatch.constraints.context_parallel.block_params, composed by selection")
            return verdict.model_copy(update={"eligible": False, "reasons": (reason,), "detail": {}})
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
