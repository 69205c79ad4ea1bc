"""One module's plans, and the one fast path in front of selection.

Every shortcut a call can take past question/selection lives here and asks one predicate, `PlanCache.stands`
(freshness.current_stamp: the runtime facts, torch's determinism flag and the decision's environment variables
as they were when the plans were made):

- `entries`: the plan cache proper. Its key is `PlanKey`: the call's raw static facts (CallArgs.plan_key: shapes,
  dtypes, devices, flags, optional tensors' signatures, training, determinism), the FP8
  context, then the sequence facts AttentionParams holds (SeqInfo.plan_key: the number of sequences, the longest on
  each side, gaps, differing lengths), re-derived per call for packed and padded calls. LRU-bounded.
- `fast`: calls whose arguments hold no per-call data (call_args.is_cacheable), keyed by shapes, dtypes, devices,
  training and requires_grad, each with its engine call bound to the tensors it was validated on (`last` is the
  last one used, checked first); `bhsd_last` the same for the SDPA function's [b, h, s, d] tensors: its q, k,
  v-only calls, and the repeats of an inference call with a bool mask (one CallArgs object per mask tensor, which
  every layer of a step passes: the same object and the mask unwritten, checked by identity and version).
- `decode`: a one-query step's key-length bucket (the plan key of the call cut to the bucket's first length,
  inputs.decode_bucket_cut) -> (its plan, the last exact key that used it), so that each new length of a growing
  cache takes the bucket's plan instead of validating and selecting again.
- `context_parallel` and `kv_cache`: AttentionParams -> Plan for those paths, whose params are built per call.

Thread model: a module's plans may be read by several threads at once (each lookup is one dict read); a plan is
made under `lock`, so two threads missing at once make it once. One module called from several threads with
different shapes stays correct (tests/test_plans.py); its `last_decision` is the last call's of any thread.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple

from .backends.base import AttnAux, takes_cached_path
from .call_args import QKV_ONLY, CallArgs
from .freshness import current_stamp
from .inputs import FastHit, Plan, tensor_guard

MAX_SIGNATURES = 64  # raw call signatures one module keeps plans for (then all are dropped and remade)
MAX_FAST = 64
MAX_PARAMS_PLANS = 64  # per context-parallel / KV-cache store


class PlanKey(NamedTuple):
    """An entry's key in `entries`: what a plain call's plan depends on that is known without reading a tensor's
    contents. Inside the entry, plans are keyed by the sequence facts (SeqInfo.plan_key()), re-derived per call
    where they depend on contents (packed and padded calls); the stamp is checked for all of them."""

    signature: tuple  # CallArgs.plan_key(...)
    fp8: tuple | None  # (recipe kind, output in FP8) inside fp8_autocast


def fast_key(q, k, v, training: bool, call: CallArgs) -> tuple:
    """A cacheable call's key in `fast`. requires_grad is part of it: a module called under no_grad and then in
    training keeps one plan (and one bound call, whose lse depends on it) for each."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, training,
            q.requires_grad, k.requires_grad, v.requires_grad, call)


class PlanCache:
    __slots__ = ("entries", "fast", "last", "bhsd_last", "decode", "context_parallel", "kv_cache", "stamp", "lock")

    def __init__(self) -> None:
        self.entries: dict[PlanKey, Any] = {}  # -> inputs.Entry (its plans by sequence facts)
        self.fast: dict[tuple, FastHit] = {}
        self.last: tuple = (None, None, None, None)  # (tensor guard, training, FastHit, CallArgs)
        # (training, FastHit with a bhsd call, the CallArgs it serves, the version of that CallArgs' mask or None)
        self.bhsd_last: tuple = (None, None, None, None)
        self.decode: dict[tuple, tuple] = {}  # bucket key -> (Plan, the last exact PlanKey it served)
        self.context_parallel: dict = {}
        self.kv_cache: dict = {}
        self.stamp = current_stamp()
        self.lock = threading.RLock()

    # --- the one invalidation predicate ---------------------------------------------------------------------
    def stands(self, hit: FastHit) -> bool:
        return hit.plan.stamp == current_stamp()

    def drop_if_stale(self) -> None:
        """Plans made under another stamp are stale: drop them all."""
        stamp = current_stamp()
        if self.stamp != stamp:
            self.forget()
            self.stamp = stamp

    def forget(self) -> None:
        self.entries.clear()
        self.fast.clear()
        self.last = (None, None, None, None)
        self.bhsd_last = (None, None, None, None)
        self.decode.clear()
        self.context_parallel.clear()
        self.kv_cache.clear()

    def remember_decode(self, bucket: tuple, plan: Plan, key: Any) -> None:
        if len(self.decode) >= MAX_SIGNATURES:
            self.decode.clear()
        self.decode[bucket] = (plan, key)

    # --- the fast path ----------------------------------------------------------------------------------------
    def hit(self, q, k, v, training: bool, call: CallArgs) -> FastHit | None:
        """The validated plan for a cacheable call that was planned before and still stands; None otherwise.
        hit.call is None where the bound engine call does not apply to these tensors (other strides)."""
        guard, last_training, hit, last_call = self.last
        if guard is None or last_training is not training or (call is not last_call and call != last_call) \
                or not guard(q, k, v):
            try:
                key = fast_key(q, k, v, training, call)
            except AttributeError:  # not tensors: the full path says what is wrong
                return None
            hit = self.fast.get(key)
            if hit is None:
                return None
            self.last = (hit.guard, training, hit, call)
            if hit.call is not None and not hit.guard(q, k, v):
                hit = dataclasses.replace(hit, call=None)
        return hit if self.stands(hit) else None

    def remember(self, plan: Plan, aux: AttnAux, q, k, v, training: bool, call: CallArgs, bind: bool) -> None:
        """Lets later calls of this signature with arguments `call` skip planning: only for plans whose aux holds
        nothing per call (no dropout seed, no cu_seqlens, mask, bias or slopes), so one aux serves them all.
        bind: the engine's call may be bound to the tensors (not where the caller needs more than the output)."""
        if not takes_cached_path(aux, plan.cfg):
            return
        if len(self.fast) >= MAX_FAST:
            self.fast.clear()
        guard = tensor_guard(q, k, v)
        bound = plan.engine.bind_fast(q, k, v, aux, plan.cfg) if guard is not None and bind else None
        hit = FastHit(plan, aux if aux.softmax_offset is None else None, aux.max_seqlen_q, aux.max_seqlen_kv,
                      guard, bound)
        self.fast[fast_key(q, k, v, training, call)] = hit
        self.last = (hit.guard, training, hit, call)

    def bhsd_call(self, q, k, v, training: bool, call: CallArgs = QKV_ONLY):
        """The SDPA function's bound call for [b, h, s, d] tensors with arguments `call` (QKV_ONLY, or a masked
        call's CallArgs object by identity, its mask unwritten since), with its plan; (None, None) where none
        stands."""
        last_training, hit, last_call, mask_version = self.bhsd_last
        if hit is None or last_training is not training or last_call is not call:
            return None, None
        if mask_version is not None and call.attention_mask._version != mask_version:
            return None, None
        guard, bound = hit.bhsd
        if not self.stands(hit) or not guard(q, k, v):
            return None, None
        return bound, hit.plan

    def remember_bhsd(self, q4, k4, v4, training: bool, bind: bool) -> None:
        """After a cached q, k, v-only call of the SDPA path: bind its plan to the [b, h, s, d] tensors q4, k4, v4
        (once per plan)."""
        hit = self.last[2]
        if hit is None:
            return
        if hit.bhsd is None:
            guard = tensor_guard(q4, k4, v4)
            call = None
            if guard is not None and hit.aux is not None and bind:
                call = hit.plan.engine.bind_fast(q4, k4, v4, hit.aux, hit.plan.cfg, layout="bhsd")
            hit.bhsd = (guard, call) if call is not None else False
        if hit.bhsd:
            self.bhsd_last = (training, hit, QKV_ONLY, None)

    def remember_masked_bhsd(self, plan: Plan, aux: AttnAux, q4, k4, v4, training: bool, call: CallArgs):
        """For an SDPA-path call whose one per-call tensor is a bool mask (call.attention_mask; no gradients,
        dropout, bias or sequence offsets): its plan bound to the [b, h, s, d] tensors q4, k4, v4 and to that mask,
        kept for the repeats that pass the same CallArgs object (the other layers of a decode step), and returned
        (q4, k4, v4 -> [b, h, sq, d_v]); None where the engine binds no such call."""
        mask = call.attention_mask
        if training or mask is None or aux.attention_mask is not mask or q4.requires_grad or k4.requires_grad \
                or v4.requires_grad or not takes_cached_path(aux, plan.cfg, mask_kept=True):
            return None
        try:
            version = mask._version
        except RuntimeError:  # an inference tensor: no version counter to tell an in-place write
            return None
        guard = tensor_guard(q4, k4, v4)
        bound = None if guard is None else plan.engine.bind_fast(q4, k4, v4, aux, plan.cfg, layout="bhsd")
        if bound is not None:
            hit = FastHit(plan, aux, aux.max_seqlen_q, aux.max_seqlen_kv, bhsd=(guard, bound))
            self.bhsd_last = (training, hit, call, version)
        return bound

    def forget_masked(self, call: CallArgs) -> None:
        """The mask of `call` died: its bound call (and what it holds of the mask) goes."""
        if self.bhsd_last[2] is call:
            self.bhsd_last = (None, None, None, None)

    # --- plans of the context-parallel and KV-cache paths ----------------------------------------------------
    def by_params(self, store: dict, params, make) -> Plan:
        """store's plan for params (made by make() under the lock on a miss)."""
        self.drop_if_stale()
        plan = store.get(params)
        if plan is None:
            with self.lock:
                plan = store.get(params)
                if plan is None:
                    if len(store) >= MAX_PARAMS_PLANS:
                        store.clear()
                    plan = store[params] = make()
        return plan
