"""DotProductAttention: Transformer Engine 2.x's module interface, with the engine chosen per call by
attn_dispatch.selection and the reasons kept in `last_decision` / `explain()`.

Differences from Transformer Engine, on purpose: `backend=` forces an engine, `policy=` picks this module's
selection policy (else ATTN_DISPATCH_POLICY's) and `softcap=` caps the logits (Gemma 2's soft-capping), our
extensions; bad input raises ValueError (not AssertionError); a padding
attention_mask must put padding after the real tokens,
and is not accepted together with cu_seqlens; a window (-1, 0) on a non-causal mask is a real window
(Transformer Engine resets it to (-1, -1)); with thd and no max_seqlen the exact longest sequence is used
(Transformer Engine rounds up to a multiple of 64); in eval mode the call is described with dropout 0.
FP8 attention runs inside `attn_dispatch.fp8_autocast` with a recipe whose `fp8_dpa=True` (cudnn_fused:fp8); the
scaling state lives on the module (`fp8_state`) and checkpoints in its state_dict (`_extra_state`).

forward's keywords travel as one value (attn_dispatch.call_args.CallArgs) to every path: selection's
(_dispatch/_prepare), explain(), the KV cache and context parallelism; question.route is where each call's
path is chosen (and what no path takes refused) before any of them acts.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module
from torch.utils.checkpoint import checkpoint

from . import call_args, inputs, question, selection, sequences, validation
from .backends.base import EngineRefused
from .backends.base import AttnAux
from .backends.unfused import draw_dropout_seed
from .call_args import QKV_ONLY, CallArgs
from .context_parallel import module_glue
from .decision import Decision
from .fp8 import autocast as _fp8_autocast
from .env import FAMILIES, POLICIES, PRIVATE_TORCH, EnvFlags
from .freshness import current_stamp
from .kv_cache import attend
from .plans import MAX_SIGNATURES, PlanCache, PlanKey
from .params import CP_COMM_TYPES, QKV_FORMATS, SOFTMAX_TYPES, _choice, has_padding
from .backends.cudnn_fused_fp8 import FP8Call
from .fp8 import FP8ScalingState
from .fp8.recipe import DelayedScaling, Float8CurrentScaling

_MISS = object()  # _fast_forward found no validated plan
_MODULE_CALL = torch.nn.Module.__call__
_MODULE_CALL_EAGER = torch.compiler.disable(_MODULE_CALL)
_is_compiling = torch.compiler.is_compiling
# nn.Module's process-wide hook registries (dicts that registration fills in place), checked by __call__'s shortcut.
_GLOBAL_FORWARD_PRE_HOOKS = _nn_module._global_forward_pre_hooks
_GLOBAL_FORWARD_HOOKS = _nn_module._global_forward_hooks
_GLOBAL_BACKWARD_PRE_HOOKS = _nn_module._global_backward_pre_hooks
_GLOBAL_BACKWARD_HOOKS = _nn_module._global_backward_hooks


class DotProductAttention(torch.nn.Module):
    """Scaled dot-product attention over q, k, v with heads as a separate dim; returns heads flattened:
    [sq, b, h*dv] (sbhd), [b, sq, h*dv] (bshd), [t, h*dv] (thd); with return_max_logit, (out, max_logit)."""
    def __init__(self, num_attention_heads: int, kv_channels: int | tuple[int, int], num_gqa_groups: int | None = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: tuple[int, int] | None = None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker: Callable | None = None, tp_group: Any = None, layer_number: int | None = None,
                 attention_type: str = "self", cp_group: Any = None, cp_global_ranks: list[int] | None = None,
                 cp_stream: Any = None, cp_comm_type: str = "p2p", softmax_scale: float | None = None,
                 softmax_type: str = "vanilla", return_max_logit: bool = False, *, backend: str | None = None,
                 softcap: float = 0.0, policy: str | None = None, mask_mod: Callable | None = None,
                 score_mod: Callable | None = None) -> None:
        super().__init__()
        heads = validation.positive_int("num_attention_heads", num_attention_heads)
        dim_qk, dim_v = _kv_channels(kv_channels)
        groups = heads if num_gqa_groups is None else validation.positive_int("num_gqa_groups", num_gqa_groups)
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not divisible by num_gqa_groups={groups}; each "
                             "key/value head must serve a whole number of query heads")
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)
        tp_size = validation.positive_int("tp_size", tp_size)
        if heads % tp_size or groups % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_attention_heads={heads} and num_gqa_groups={groups}")
        _choice("attention_type", attention_type, ("self", "cross"))
        _choice("cp_comm_type", cp_comm_type, CP_COMM_TYPES)
        _choice("softmax_type", softmax_type, SOFTMAX_TYPES)
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 <= softcap < math.inf:
            raise ValueError(f"softcap={softcap!r} must be a finite float >= 0 (0 turns logit soft-capping off)")
        self._softcap = float(softcap)
        # FlexAttention modifiers of the user's (our extension): only flex_attention runs them; every other engine's
        # table refuses a call that has them, so none is silently dropped
        for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name}={fn!r} must be a function (FlexAttention's {name} signature) or None")
        self._user_mods = {name: fn for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod))
                           if fn is not None}
        self.__dict__["_planned"] = False  # the setters below re-plan only once construction is done
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.attention_type = attention_type
        self.num_attention_heads = heads
        self.num_gqa_groups = groups
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = dim_qk, dim_v
        self.tp_size, self.tp_group, self.sequence_parallel = tp_size, tp_group, sequence_parallel
        self.layer_number = 1 if layer_number is None else layer_number
        self.softmax_type = softmax_type
        self.return_max_logit = return_max_logit
        self.backend = backend
        self.policy = policy
        self.get_rng_state_tracker = get_rng_state_tracker
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        # Transformer Engine draws attention dropout inside the RNG tracker's fork(), except with sequence parallelism.
        self.rng_states_tracker = None
        if get_rng_state_tracker is not None and not sequence_parallel:
            self.rng_states_tracker = get_rng_state_tracker()
        self.attention_dropout = attention_dropout
        self.softmax_scale = 1.0 / math.sqrt(dim_qk) if softmax_scale is None else softmax_scale
        self._heads_local, self._groups_local = heads // tp_size, groups // tp_size
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self._heads_local))
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self._heads_local), persistent=False)
        else:
            self.softmax_offset = None
        self._plans = PlanCache()  # every plan and shortcut of this module (plans.py)
        self._fp8_dpa = True  # runs in FP8 inside fp8_autocast (the SDPA function's modules keep torch SDPA's dtype)
        self._alibi_cache: dict[torch.device, torch.Tensor] = {}
        self.last_decision: Decision | None = None
        self.__dict__["_planned"] = True
        self._configure()

    # --- configuration: every public setting forward acts on; assigning one re-plans ----------------------
    def _configure(self) -> None:
        """Rebuild the spec plans are made from and drop every plan, so that the next call decides again."""
        if not self.__dict__.get("_planned"):
            return
        self._spec = validation.ModuleSpec(
            num_heads=self._heads_local, num_gqa_groups=self._groups_local,
            head_dim_qk=self.hidden_size_per_attention_head_k, head_dim_v=self.hidden_size_per_attention_head_v,
            softmax_scale=self._softmax_scale, attention_dropout=self._attention_dropout,
            softmax_type=self.softmax_type, return_max_logit=self._return_max_logit,
            attention_type=self.attention_type, deterministic=False, cp_comm_type=self.cp_comm_type,
            backend=self._backend, softcap=self._softcap, policy=self._policy,
            mask_mod="mask_mod" in self._user_mods, score_mod="score_mod" in self._user_mods)
        self._forget_plans()

    def _spec_now(self) -> validation.ModuleSpec:
        """The spec with determinism as the environment and torch report it now (read when a plan is made)."""
        env = EnvFlags.from_environ()
        deterministic = not env.allow_nondeterministic or _deterministic_now()
        return self._spec if deterministic == self._spec.deterministic else \
            dataclasses.replace(self._spec, deterministic=deterministic)

    @property
    def qkv_format(self) -> str:
        return self._qkv_format

    @qkv_format.setter
    def qkv_format(self, value: str) -> None:
        _choice("qkv_format", value, QKV_FORMATS)
        self.__dict__["_qkv_format"] = value
        self._configure()

    @property
    def attn_mask_type(self) -> str:
        return self._attn_mask_type

    @attn_mask_type.setter
    def attn_mask_type(self, value: str) -> None:
        mask_type = validation.normalize_mask_type(value)
        window = validation.check_window(self.__dict__.get("_window_arg"), mask_type)
        self.__dict__.update(_attn_mask_type=mask_type, _window=window)
        self._configure()

    @property
    def window_size(self) -> tuple[int, int]:
        return self._window

    @window_size.setter
    def window_size(self, value: tuple[int, int] | None) -> None:
        # kept as given: each forward's mask type normalises it (causal => right 0)
        window = validation.check_window(value, self._attn_mask_type)
        self.__dict__.update(_window_arg=value, _window=window)
        self._configure()

    @property
    def attention_dropout(self) -> float:
        return self._attention_dropout

    @attention_dropout.setter
    def attention_dropout(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"attention_dropout={value!r} must be a float in [0, 1)")
        tracker = self.__dict__.get("rng_states_tracker")
        self.__dict__.update(_attention_dropout=float(value),
                             _dropout_ctx=tracker.fork if tracker is not None and value > 0 else nullcontext)
        self._configure()

    @property
    def softmax_scale(self) -> float:
        return self._softmax_scale

    @softmax_scale.setter
    def softmax_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"softmax_scale={value!r} must be a positive finite number")
        self.__dict__["_softmax_scale"] = float(value)
        self._configure()

    @property
    def backend(self) -> str | None:
        return self._backend

    @backend.setter
    def backend(self, value: str | None) -> None:
        if value is not None and (not isinstance(value, str) or value.partition(":")[0] not in FAMILIES):
            raise ValueError(f"backend={value!r} names no backend; use one of {', '.join(FAMILIES)} "
                             "(optionally 'family:provider'), or None")
        self.__dict__["_backend"] = value
        self._configure()

    @property
    def policy(self) -> str | None:
        return self._policy

    @policy.setter
    def policy(self, value: str | None) -> None:
        if value is not None and value not in POLICIES:
            raise ValueError(f"policy={value!r} is not a policy; use one of {', '.join(POLICIES)}, or None "
                             "(ATTN_DISPATCH_POLICY's, 'auto' by default)")
        self.__dict__["_policy"] = value
        self._configure()

    @property
    def return_max_logit(self) -> bool:
        return self._return_max_logit

    @return_max_logit.setter
    def return_max_logit(self, value: bool) -> None:
        self.__dict__["_return_max_logit"] = bool(value)
        self._configure()

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: list[int] | None, cp_stream: Any,
                                   cp_comm_type: str = "p2p") -> None:
        _choice("cp_comm_type", cp_comm_type, CP_COMM_TYPES)
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = \
            cp_group, cp_global_ranks, cp_stream, cp_comm_type

    # ------------------------------------------------------------------------------------------
    def __call__(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor, *args: Any,
                 **kwargs: Any):
        """nn.Module's call, with a shortcut for the commonest calls: a repeat of a validated signature whose
        arguments hold no per-call data (q, k, v alone, or with settings such as attn_mask_type="causal", as
        Megatron passes), on a module with no hooks, outside tracing and compilation. nn.Module's own __call__
        and forward's argument handling cost several microseconds, which the hot-path budget (5 us over the
        engine) cannot spare; every other call, and any module with hooks, goes through them unchanged."""
        if _is_compiling():  # dynamo stops here: the whole call runs eagerly (one graph break)
            return _MODULE_CALL_EAGER(self, query_layer, key_layer, value_layer, *args, **kwargs)
        plans = self._plans
        if plans.fast and _SHORTCUT and isinstance(query_layer, torch.Tensor) and not (
                self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks
                or _GLOBAL_FORWARD_PRE_HOOKS or _GLOBAL_FORWARD_HOOKS or _GLOBAL_BACKWARD_PRE_HOOKS
                or _GLOBAL_BACKWARD_HOOKS or self._compiled_call_impl is not None or torch._C._get_tracing_state()):
            call = QKV_ONLY if not args and not kwargs else call_args.cached_call_args(args, kwargs)
            if call is not None:
                # The commonest call of all, inline (a frame less: ~1 us on the H100's host, where a small forward
                # costs ~30 us): the last signature again, with the engine's op bound to it.
                # (PlanCache.hit's checks and its stands(), written out: no function call before the op's)
                guard, training, hit, last_call = plans.last
                if hit is not None and hit.call is not None and training is self.training \
                        and (call is last_call or call == last_call) and self.cp_group is None \
                        and not _FP8_REGIONS[0] and hit.plan.stamp == current_stamp() \
                        and guard(query_layer, key_layer, value_layer):
                    plan = hit.plan
                    if self.__dict__["last_decision"] is not plan.decision:
                        self.__dict__["last_decision"] = plan.decision
                    return hit.call(query_layer, key_layer, value_layer)
                result = self._fast_forward(query_layer, key_layer, value_layer, call=call)
                if result is not _MISS:
                    return result
        # Looked up per call: torch.fx patches nn.Module.__call__ while tracing, which makes this module a leaf.
        return torch.nn.Module.__call__(self, query_layer, key_layer, value_layer, *args, **kwargs)

    def _fast_forward(self, query_layer, key_layer, value_layer, merged: bool = True, call: CallArgs = QKV_ONLY):
        """The cached path for a call with arguments `call` (call_args.is_cacheable): _MISS unless this signature
        was validated before (dynamo never traces it: every caller checks first). merged=False (the SDPA
        function's path) returns the engine's output with heads not merged, and _MISS where cuDNN refuses the
        cached graph."""
        if self.cp_group is not None or (_FP8_REGIONS[0] and self._fp8_dpa):  # an FP8 region open: plan under it
            return _MISS
        hit = self._plans.hit(query_layer, key_layer, value_layer, self.training, call)
        if hit is None:
            return _MISS
        plan = hit.plan
        if self.__dict__["last_decision"] is not plan.decision:
            self.__dict__["last_decision"] = plan.decision  # plain attribute: skips nn.Module.__setattr__
        if hit.call is not None and merged:  # the engine's call bound to these tensors (no max logit, no cuDNN graph)
            return hit.call(query_layer, key_layer, value_layer)
        aux = hit.aux
        if aux is None:  # a sink offset: read per call, since .to() replaces buffers
            aux = AttnAux(max_seqlen_q=hit.max_q, max_seqlen_kv=hit.max_kv, softmax_offset=self.softmax_offset)
        try:
            out, _, max_logit = plan.engine(query_layer, key_layer, value_layer, aux, plan.cfg, flatten_heads=merged)
        except EngineRefused:
            if not merged:
                self._forget_plans()
                return _MISS
            return self._refused(query_layer, key_layer, value_layer)
        if not merged:
            return out
        return (out, max_logit) if self.return_max_logit else out

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
                qkv_format: str | None = None, cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_kv: torch.Tensor | None = None, cu_seqlens_q_padded: torch.Tensor | None = None,
                cu_seqlens_kv_padded: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_kv: int | None = None, attn_mask_type: str | None = None,
                window_size: tuple[int, int] | None = None, checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None, fast_zero_fill: bool = True, inference_params: Any = None,
                pad_between_seqs: bool | None = None, fp8_output: bool = False):
        # fast_zero_fill only picks how Transformer Engine zero-initialises outputs; results are the same.
        if attention_mask is None and qkv_format is None and cu_seqlens_q is None and cu_seqlens_kv is None \
                and cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None and max_seqlen_q is None \
                and max_seqlen_kv is None and attn_mask_type is None and window_size is None \
                and not checkpoint_core_attention and core_attention_bias_type == "no_bias" \
                and core_attention_bias is None and alibi_slopes is None and inference_params is None \
                and pad_between_seqs is None and not fp8_output:
            if self._plans.fast and not _is_compiling():
                result = self._fast_forward(query_layer, key_layer, value_layer)
                if result is not _MISS:
                    return result
            args = QKV_ONLY
        else:  # in field order, positionally (keywords cost ~0.6 us a call); tests/test_call_args.py checks it
            args = CallArgs(attention_mask, qkv_format, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
                            checkpoint_core_attention, core_attention_bias_type, core_attention_bias, alibi_slopes,
                            inference_params, pad_between_seqs, fp8_output)
        return self._forward_args(query_layer, key_layer, value_layer, args)

    def _forward_args(self, q, k, v, args: CallArgs):
        """forward past the fast path: the path question.route picks (the same one explain() describes)."""
        mode, fp8 = question.route(self, args)
        if mode == question.KV_CACHE:
            return attend.forward(self, q, k, v, args)
        if mode == question.CONTEXT_PARALLEL:
            return module_glue.forward(self, q, k, v, args, fp8)
        # Under torch.compile the dispatcher stays out of the graph: selection, caches and engines run eagerly, so a
        # compiled model neither traces the decision nor recompiles per call. Eagerly, the disabling wrapper (a few
        # microseconds) is skipped.
        dispatch = self._dispatch_opaque if torch.compiler.is_compiling() else self._dispatch
        if args.attention_mask is not None:
            reading = question.read_mask(self, q, k, v, args, fp8)[0]
            if reading is not None:  # in order: the last call's decision is last_decision, as explain() answers
                return reading.combine(*[dispatch(*call, fp8) for call in reading.calls])
        return dispatch(q, k, v, args, fp8)

    # --- FP8 (fp8_autocast) ---------------------------------------------------------------------------
    def _fp8_call(self, fp8: tuple, device: torch.device):
        """The engine's FP8 data for this call: the module's scaling state (made, or fitted to a new recipe)."""
        region, output_fp8 = fp8
        state = self.__dict__.get("_fp8_state")
        if state is None:
            state = FP8ScalingState(region.recipe, device)
        elif not state.matches(region.recipe):
            state = state.adopt(region.recipe)
        state.recipe = region.recipe
        self.__dict__["_fp8_state"] = state.to(device)
        return FP8Call(state, region.group, output_fp8)

    @property
    def fp8_state(self):
        """The FP8 scaling state (scales, amax histories) of this module's FP8 calls; None before the first."""
        return self.__dict__.get("_fp8_state")

    def get_extra_state(self) -> Any:
        """What a checkpoint keeps besides tensors: the FP8 scaling state (Transformer Engine keeps its FP8
        metadata in `_extra_state` too); None for a module that never ran in FP8."""
        state = self.__dict__.get("_fp8_state")
        return None if state is None else state.state_dict()

    def set_extra_state(self, state: Any) -> None:
        if state is None:
            self.__dict__.pop("_fp8_state", None)
            return
        if not isinstance(state, dict) or state.get("recipe") not in ("DelayedScaling", "Float8CurrentScaling"):
            raise ValueError(f"extra state {type(state).__name__} is not an FP8 scaling state saved by "
                             "attn_dispatch.DotProductAttention")
        history = state.get("amax_history")
        recipe = (DelayedScaling(fp8_format=state.get("fp8_format", "HYBRID"), fp8_dpa=True,
                                 amax_history_len=int(history.shape[0]) if isinstance(history, torch.Tensor) else 1)
                  if state["recipe"] == "DelayedScaling" else
                  Float8CurrentScaling(fp8_format=state.get("fp8_format", "HYBRID"), fp8_dpa=True))
        device = self._fp8_state.scale.device if self.__dict__.get("_fp8_state") is not None else "cpu"
        self.__dict__["_fp8_state"] = FP8ScalingState.from_state_dict(state, recipe, device)

    def _refused(self, q, k, v):
        """cuDNN refused a cached plan's graph at run time: select again (see _dispatch)."""
        self._forget_plans()
        return self._dispatch(q, k, v, QKV_ONLY)

    def _dispatch(self, q, k, v, args: CallArgs, fp8: tuple | None = None):
        plan, aux = self._prepare(q, k, v, args, fp8)
        self.__dict__["last_decision"] = plan.decision
        checkpoint_core_attention = args.checkpoint_core_attention
        try:
            out, max_logit = self._run(plan, aux, q, k, v, checkpoint_core_attention)
        except EngineRefused:
            # cuDNN refused a graph the table let through: the engine recorded cuDNN's message (the table's
            # cudnn_rejected check now reports it) and cleared the decision cache, so selecting again moves on.
            self._forget_plans()
            plan, aux = self._prepare(q, k, v, args, fp8)
            self.__dict__["last_decision"] = plan.decision
            out, max_logit = self._run(plan, aux, q, k, v, checkpoint_core_attention)
        if self.cp_group is None and fp8 is None and (args is QKV_ONLY or call_args.is_cacheable(args)):
            self._plans.remember(plan, aux, q, k, v, self.training, args, bind=not self.return_max_logit)
        return (out, max_logit) if self.return_max_logit else out

    def _forget_plans(self) -> None:
        self._plans.forget()

    @torch.compiler.disable
    def _dispatch_opaque(self, q, k, v, args: CallArgs, fp8: tuple | None = None):
        return self._dispatch(q, k, v, args, fp8)

    def explain(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                **kwargs: Any) -> Decision:
        """The Decision forward would act on for these inputs (same keywords as forward), without running it:
        the question forward's path asks (question.ask), answered by the same selection. Raises what forward
        raises for bad input; never raises for 'nothing qualifies' (the Decision lists every backend's reasons)."""
        unexpected = {k: v for k, v in kwargs.items() if k not in call_args.KEYWORDS}
        if unexpected:
            raise ValueError(f"explain() got unexpected arguments {sorted(unexpected)}; it takes forward's keywords")
        kwargs.pop("fast_zero_fill", None)
        if kwargs.get("core_attention_bias_type") is None:
            kwargs["core_attention_bias_type"] = "no_bias"
        asked = question.ask(self, query_layer, key_layer, value_layer, CallArgs(**kwargs))
        return selection.explain(asked.params, force=self.backend, policy=self.policy).with_notes(*asked.notes)

    def _prepare(self, q, k, v, args: CallArgs, fp8: tuple | None = None):
        """(Plan, AttnAux) for a call. The raw arguments' static facts key a cache entry, so a repeated call
        skips validation; tensor contents (cu_seqlens, padding masks) are re-checked, cached on the tensors.
        fp8: (region, output in FP8) of an FP8 call (question.fp8_context)."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            validation.check_ranks(validation.resolve_call(self, args)[0], q, k, v)  # raises ValueError
        key = PlanKey(args.plan_key(q, k, v, self.training, _deterministic_now()),
                      None if fp8 is None else (fp8[0].recipe.kind, fp8[1]))
        plans = self._plans
        plans.drop_if_stale()
        entry = plans.entries.get(key)
        if entry is None:
            fmt, mask_type, window = validation.resolve_call(self, args)
            validation.check_ranks(fmt, q, k, v)
            entry = inputs.Entry(fmt, mask_type, window, dynamic=fmt == "thd" or has_padding(mask_type))
        if entry.dynamic or entry.seq is None:
            seq = sequences.sequence_info(entry.fmt, entry.mask_type, q, k, args, entry.window)
        else:
            seq = entry.seq
        seq_key = seq.plan_key()
        plan = entry.plans.get(seq_key)
        if plan is not None and entry.dynamic:
            entry.plans[seq_key] = entry.plans.pop(seq_key)  # most recently used last: the bound drops the oldest
        if plan is None:
            with plans.lock:  # another thread may have made it meanwhile
                entry = plans.entries.get(key, entry)
                plan = entry.plans.get(seq_key)
                if plan is None:
                    plan = self._make_plan(plans, key, entry, seq, q, k, v, args, fp8)
        alibi_slopes = args.alibi_slopes
        if args.core_attention_bias_type == "alibi":
            alibi_slopes = self._alibi_slopes(alibi_slopes, q.device)
        aux = inputs.make_aux(seq, entry.mask_type, args.attention_mask, args.core_attention_bias, alibi_slopes,
                              self.softmax_offset, entry.window)
        if self._user_mods:
            aux.extra.update(self._user_mods)
        if fp8 is not None:
            aux.extra["fp8"] = self._fp8_call(fp8, q.device)
        return plan, aux

    def _make_plan(self, plans: PlanCache, key: PlanKey, entry: inputs.Entry, seq, q, k, v, args: CallArgs,
                   fp8: tuple | None) -> inputs.Plan:
        """The slow path's plan for a call (the same description explain() answers), stored under key. A one-query
        step over a growing cache takes the plan its key-length bucket already has (inputs.decode_bucket_cut: the
        calls of a bucket validate and decide alike), so a new token costs no new plan; its own sequence facts and
        aux are still its own."""
        bucket = None
        if fp8 is None and not entry.dynamic:
            cut = inputs.decode_bucket_cut(entry.fmt, q, k, v, args, self.training)
            if cut is not None:
                bucket = args.plan_key(q, k, v, self.training, _deterministic_now(), kv_cut=cut)
        known = None if bucket is None else plans.decode.get(bucket)
        if len(entry.plans) >= inputs.MAX_DYNAMIC_PLANS:
            del entry.plans[next(iter(entry.plans))]
        if known is not None:
            plan = entry.plans[seq.plan_key()] = known[0]
            plans.entries.pop(known[1], None)  # the cache's previous length: a growing cache never comes back to it
        else:
            spec = self._spec_now()
            params = question.plan_params(spec, entry.fmt, entry.mask_type, entry.window, q, k, v, seq, args,
                                          self.training, fp8)
            plan = entry.plans[seq.plan_key()] = inputs.make_plan(spec, params, seq.lengths)
        if len(plans.entries) >= MAX_SIGNATURES:
            plans.forget()
        if not entry.dynamic:
            entry.seq = seq
        plans.entries[key] = entry
        if bucket is not None:
            plans.remember_decode(bucket, plan, key)
        return plan

    def _alibi_slopes(self, slopes: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if slopes is not None:
            return slopes if slopes.dtype == torch.float32 else slopes.float()
        cached = self._alibi_cache.get(device)
        if cached is None:
            cached = self._alibi_cache[device] = validation.default_alibi_slopes(self._spec.num_heads).to(device)
        return cached

    def _attend_bhsd(self, q, k, v, call: CallArgs = QKV_ONLY):
        """The SDPA function's cached path: [b, h, s, d] tensors in, [b, h, sq, d_v] out, the engine's call bound to
        them (no bshd views either way); None unless this signature's plan was bound through _attend_unmerged (with
        bhsd=): a q, k, v-only call once its plan was used twice; a masked inference call (`call`, the SDPA
        function's CallArgs for its mask) once such a call was bound (Engine.bind_masked), and then the calls that
        differ from it only in their mask and their keys' length within its plan's range (plans.MaskedBinding)."""
        if self.cp_group is not None or (_FP8_REGIONS[0] and self._fp8_dpa) or _is_compiling():
            return None
        bound, plan = self._plans.bhsd_call(q, k, v, self.training, call)
        if bound is None:
            return None
        if self.__dict__["last_decision"] is not plan.decision:
            self.__dict__["last_decision"] = plan.decision
        return bound(q, k, v) if call is QKV_ONLY else bound(q, k, v, call.attention_mask)

    def _attend_unmerged(self, q, k, v, args: CallArgs = QKV_ONLY, bhsd: tuple | None = None):
        """forward's work for a bshd call (forward's keywords after q, k, v as `args`: attention_mask, the mask
        type, a bias, cu_seqlens and a window at most), returning [b, s, h, d_v] in the engine's own memory order,
        heads not merged: the SDPA function's path, whose [b, h, s, d] callers would otherwise pay a copy both ways.
        A call with only q, k, v takes the cached path once its signature has been planned, as forward's does; bhsd
        (the [b, h, s, d] tensors q, k, v are views of) then binds the plan for _attend_bhsd, and so does a masked
        inference call's."""
        only_qkv = args is QKV_ONLY
        if only_qkv and self._plans.fast and not _is_compiling():
            out = self._fast_forward(q, k, v, merged=False)
            if out is not _MISS:
                if bhsd is not None:
                    self._plans.remember_bhsd(*bhsd, self.training, bind=not self.return_max_logit)
                return out
        bind_masked = bhsd is not None and not only_qkv and args.attention_mask is not None \
            and self.cp_group is None and not self.return_max_logit
        for attempt in (0, 1):
            plan, aux = self._prepare(q, k, v, args)
            self.__dict__["last_decision"] = plan.decision
            # a masked inference call the engine binds: bound now, with the mask an argument, for the calls that
            # differ from it only in the mask and the keys' length within its plan's range (the other layers of a
            # decode step and the next steps, through _attend_bhsd); this call runs the bound call too
            bound = None
            if bind_masked:
                lengths = inputs.decode_bucket_lengths("bshd", q, k, v, args, self.training)  # the SDPA path's views
                bound = self._plans.remember_masked_bhsd(plan, aux, *bhsd, self.training, args, lengths)
            with self._dropout_ctx():
                if plan.cfg.dropout_p > 0.0:
                    aux.extra["dropout_seed"] = draw_dropout_seed(q.device)
                try:
                    out = plan.engine(q, k, v, aux, plan.cfg)[0] if bound is None else \
                        bound(*bhsd, args.attention_mask).transpose(1, 2)
                except EngineRefused:  # recorded by the engine: selecting again moves on (see _dispatch)
                    if attempt:
                        raise
                    self._forget_plans()
                    continue
            if only_qkv and self.cp_group is None:
                self._plans.remember(plan, aux, q, k, v, self.training, QKV_ONLY, bind=not self.return_max_logit)
            return out

    def _run(self, plan: inputs.Plan, aux, q, k, v, checkpoint_core_attention: bool):
        engine, cfg = plan.engine, plan.cfg
        with self._dropout_ctx():
            if cfg.dropout_p > 0.0:
                # Drawn here, inside the tracker's fork, so that recomputation (checkpointing) reuses it.
                aux.extra["dropout_seed"] = draw_dropout_seed(q.device)
            if checkpoint_core_attention and torch.is_grad_enabled():
                out, _, max_logit = checkpoint(lambda q_, k_, v_: engine(q_, k_, v_, aux, cfg, flatten_heads=True),
                                               q, k, v, use_reentrant=False)
            else:
                out, _, max_logit = engine(q, k, v, aux, cfg, flatten_heads=True)
        return out, max_logit


_deterministic_now = torch.are_deterministic_algorithms_enabled


_FP8_REGIONS = _fp8_autocast.ACTIVE
# __call__'s shortcut reads nn.Module's private hook registries: on only with the private switch on.
_SHORTCUT = PRIVATE_TORCH


def _kv_channels(kv_channels: Any) -> tuple[int, int]:
    if isinstance(kv_channels, int) and not isinstance(kv_channels, bool):
        return validation.positive_int("kv_channels", kv_channels), kv_channels
    if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2:
        return (validation.positive_int("kv_channels[0]", kv_channels[0]),
                validation.positive_int("kv_channels[1]", kv_channels[1]))
    raise ValueError(f"kv_channels={kv_channels!r} must be an int or a pair (head_dim_qk, head_dim_v)")
