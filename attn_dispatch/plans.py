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
  last one used, checked first); `bhsd_last` the same for the SDPA function's [b, h, s, d] tensors and its q, k,
  v-only calls.
- `bhsd_masked`: the SDPA function's inference calls with an 'arbitrary' bool mask (a decode step's mask as given),
  their plan bound with the mask an argument (Engine.bind_masked, a MaskedBinding). It serves every call that
  differs from the one it was made for only in the mask's contents and in the keys' length within the range the
  plan was decided for (a decode step's key-length bucket): every layer of a step (one CallArgs object, which every
  layer passes: checked by identity and the binding's guard on q, k, v) and the next steps' new masks (checked
  against the binding's signature once per step). A new batch's mask, whatever its padding, is a new mask: the
  engine derives its bias from its contents on the device (per mask tensor and version), nothing is read back.
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

import torch

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


class MaskedBinding(NamedTuple):
    """An SDPA-path inference call with a bool mask, bound (Engine.bind_masked) for the calls it serves: those
    whose arguments but the mask equal `settings`, whose q, k, v pass `guard` (k and v as these but for their
    length: inputs.tensor_guard's free dims), whose keys' length is within `lengths` (the range the plan was decided
    for: inputs.decode_bucket_lengths), and whose mask is a bool tensor of `mask` (its shape but for the last dim,
    the keys' length; its device)."""

    plan: Plan
    call: Any  # (q, k, v, mask) -> [b, h, sq, d_v]
    settings: tuple  # the CallArgs' fields after attention_mask
    guard: Any
    lengths: tuple[int, int]
    mask: tuple  # (shape but the last dim, device)

    def serves(self, q, k, v, call: CallArgs) -> bool:
        mask = call.attention_mask
        skv = k.shape[2]
        lo, hi = self.lengths
        return (call[1:] == self.settings and mask.__class__ is torch.Tensor and mask.dtype is torch.bool
                and lo <= skv <= hi and v.shape[2] == skv and mask.shape[-1] == skv
                and (mask.shape[:-1], mask.device) == self.mask and self.guard(q, k, v))


def fast_key(q, k, v, training: bool, call: CallArgs) -> tuple:
    """A cacheable call's key in `fast`. requires_grad is part of it: a module called under no_grad and then in
    training keeps one plan (and one bound call, whose lse depends on it) for each."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, training,
            q.requires_grad, k.requires_grad, v.requires_grad, call)


class PlanCache:
    __slots__ = ("entries", "fast", "last", "bhsd_last", "bhsd_masked", "decode", "context_parallel", "kv_cache",
                 "stamp", "lock")

    def __init__(self) -> None:
        self.entries: dict[PlanKey, Any] = {}  # -> inputs.Entry (its plans by sequence facts)
        self.fast: dict[tuple, FastHit] = {}
        self.last: tuple = (None, None, None, None)  # (tensor guard, training, FastHit, CallArgs)
        # (training, FastHit with a bhsd call): the q, k, v-only call
        self.bhsd_last: tuple = (None, None)
        # (training, MaskedBinding, the CallArgs it last served): the masked inference call
        self.bhsd_masked: tuple = (None, None, None)
        self.decode: dict[tuple, tuple] = {}  # bucket key -> (Plan, the last exact PlanKey it served)
        self.context_parallel: dict = {}
        self.kv_cache: dict = {}
        self.stamp = current_stamp()
        self.lock = threading.RLock()

    # --- the one invalidation predicate ---------------------------------------------------------------------
    def stands(self, hit: FastHit | MaskedBinding) -> bool:
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
        self.bhsd_last = (None, None)
        self.bhsd_masked = (None, None, None)
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
        """The SDPA function's bound call for [b, h, s, d] tensors with arguments `call`, with its plan; (None,
        None) where none stands. QKV_ONLY: (q, k, v) -> out. A masked call: (q, k, v, mask) -> out, where the masked
        binding serves it: the CallArgs object it last served with tensors of that call's signature (the other
        layers of a decode step), or a call it serves by its signature (MaskedBinding.serves: a new step's mask and
        keys, checked once a step)."""
        if call is QKV_ONLY:
            last_training, hit = self.bhsd_last
            if hit is None or last_training is not training:
                return None, None
            guard, bound = hit.bhsd
            if not self.stands(hit) or not guard(q, k, v):
                return None, None
            return bound, hit.plan
        last_training, binding, last_call = self.bhsd_masked
        if binding is None or last_training is not training or not self.stands(binding):
            return None, None
        if call is last_call:  # its translation's shapes: the ones the binding served it with
            if not binding.guard(q, k, v):
                return None, None
        elif binding.serves(q, k, v, call):
            self.bhsd_masked = (training, binding, call)
        else:
            return None, None
        return binding.call, binding.plan

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
            self.bhsd_last = (training, hit)

    def remember_masked_bhsd(self, plan: Plan, aux: AttnAux, q4, k4, v4, training: bool, call: CallArgs,
                             lengths: tuple[int, int]):
        """For an SDPA-path call whose one per-call tensor is a bool mask (call.attention_mask; no gradients,
        dropout, bias or sequence offsets): its plan bound with the mask an argument (Engine.bind_masked) for the
        [b, h, s, d] tensors q4, k4, v4, kept for the calls it serves (MaskedBinding; lengths: the keys' lengths
        the plan was decided for), and returned ((q4, k4, v4, mask) -> [b, h, sq, d_v]); None where the engine
        binds no such call."""
        mask = call.attention_mask
        if training or mask is None or aux.attention_mask is not mask or q4.requires_grad or k4.requires_grad \
                or v4.requires_grad or not takes_cached_path(aux, plan.cfg, mask_kept=True):
            return None
        guard = tensor_guard(q4, k4, v4, free_dims=(None, 2, 2))
        bound = None if guard is None else plan.engine.bind_masked(q4, k4, v4, aux, plan.cfg)
        if bound is not None:
            binding = MaskedBinding(plan, bound, call[1:], guard, lengths, (mask.shape[:-1], mask.device))
            self.bhsd_masked = (training, binding, call)
        return bound

    def forget_masked(self, call: CallArgs) -> None:
        """The mask of `call` died or was replaced: the binding lets go of the call (its mask, and what the engine
        keeps on it); the binding itself stays for the next mask."""
        training, binding, last_call = self.bhsd_masked
        if last_call is call:
            self.bhsd_masked = (training, binding, None)

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
