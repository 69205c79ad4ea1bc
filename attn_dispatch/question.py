"""A module call becomes the question selection answers, in this one place, for every mode.

`route` decides which path serves a call (and raises what no path accepts) before any path acts; `ask` describes
the call as that path's selection sees it: the module's own tensors for a plain call (dense, padded, packed, FP8),
the rank's shard and the CP mode for context parallelism (whose per-block calls selection then composes), the
bucketed step for a KV-cache step. DotProductAttention.forward routes through `route` and plans through the same
describers; `DotProductAttention.explain` is `ask` answered by selection, so what it says is what forward runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import document_masks, prefix_masks, selection, sequences, validation
from .call_args import CallArgs
from .constraints.cudnn_fused_fp8 import backward_text
from .context_parallel import module_glue
from .env import EnvFlags
from .fp8 import autocast as fp8_autocast, speed
from .freshness import current_stamp
from .inputs import build_params, plain_params
from .kv_cache import attend
from .params import AttentionParams
from .platform import Platform
from .tensor_cache import cached_on
from .policy.profile import profile_for

PLAIN, CONTEXT_PARALLEL, KV_CACHE = "plain", "context_parallel", "kv_cache"


@dataclass(frozen=True)
class Question:
    """What selection is asked for one call: its path, the params as the engines run them (a window that masks
    nothing dropped), the notes saying how the call was read, and its FP8 context ((region, output in FP8) or
    None)."""

    mode: str
    params: AttentionParams
    notes: tuple[str, ...] = ()
    fp8: tuple | None = None


def route(module: torch.nn.Module, args: CallArgs) -> tuple[str, tuple | None]:
    """(the path that serves this call, its FP8 context); raises for a combination no path takes."""
    if not isinstance(args.fp8_output, bool):
        raise ValueError(f"fp8_output={args.fp8_output!r} must be True or False")
    fp8 = fp8_context(module, args)
    if args.inference_params is not None:
        if fp8 is not None:
            raise ValueError("FP8 attention with a KV cache (inference_params) is not supported by attn-dispatch "
                             "(Transformer Engine also runs no fused FP8 attention with a KV cache); run this "
                             "call outside fp8_autocast, or with a recipe whose fp8_dpa=False")
        return KV_CACHE, None
    if module.cp_group is not None:
        return CONTEXT_PARALLEL, fp8
    return PLAIN, fp8


def ask(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        args: CallArgs, read_masks: bool = True) -> Question:
    """The question forward's path asks selection for this call (validating it as that path does). read_masks=False:
    a plain call's bool mask as given, as the SDPA function's engine-bound path hands it on."""
    mode, fp8 = route(module, args)
    read: tuple[str, ...] = ()  # what the path adds: how the call was read when not as given, how CP moves data
    if mode == KV_CACHE:
        params = attend.describe(module, q, k, v, args)
    elif mode == CONTEXT_PARALLEL:
        params = module_glue.describe(module, q, k, v, args, fp8).params
        transport = module_glue.transport_note(module, params, q.device)
        read = (transport,) if transport else ()
    else:
        if args.attention_mask is not None and read_masks:
            reading, note = read_mask(module, q, k, v, args, fp8)
            read = (note,) if note else ()
            if reading is not None:  # this Decision is the last call's, as forward's last_decision
                q, k, v, args = reading.calls[-1]
        params = describe_plain(module, q, k, v, args, fp8)[0]
    params, notes = plain_params(params)
    notes = read + notes
    if fp8 is not None:
        notes += fp8_notes(params, Platform.detect(), EnvFlags.from_environ())
    return Question(mode, params, notes, fp8)


def fp8_context(module: torch.nn.Module, args: CallArgs) -> tuple | None:
    """(region, output in FP8) when this call runs in FP8: inside fp8_autocast with fp8_dpa; None otherwise."""
    region = fp8_autocast.current_region() if module._fp8_dpa else None
    if region is None:
        if args.fp8_output:
            raise ValueError("fp8_output=True needs FP8 attention: call the module inside "
                             "attn_dispatch.fp8_autocast(recipe=DelayedScaling(fp8_dpa=True))")
        return None
    return region, bool(args.fp8_output or region.recipe.fp8_mha)


@dataclass(frozen=True)
class MaskReading:
    """A plain call whose bool mask is run otherwise than as given: the calls that run, in order (q, k, v, CallArgs
    each; the last one's decision is forward's last, which explain answers), and how their outputs make the call's."""
    calls: tuple[tuple, ...]
    combine: Callable[..., torch.Tensor]


def read_mask(module: torch.nn.Module, q, k, v, args: CallArgs,
              fp8: tuple | None) -> tuple[MaskReading | None, str | None]:
    """(how a plain call's bool mask runs when not as given, or None; the note saying how it was read, or None):
    causal documents as the thd call they are (document_masks); a prefix-LM mask as its two calls (prefix_masks)
    where they are predicted to pay, else as given with the note saying why, decided once per mask tensor and
    version, module and call signature, as selection's answers stand."""
    fmt, mask_type, window = validation.resolve_call(module, args)
    # only an 'arbitrary' mask is ever rewritten: a padding mask's call reads no environment here
    plain = mask_type == "arbitrary" and _rewritable(module, fp8)
    call = document_masks.self_attention_mask_call(fmt, mask_type, window, q, k, v, args, plain)
    if call is None:
        return None, None
    packed = document_masks.as_documents(q, k, v, args, call)
    if packed is not None:
        return MaskReading(((packed.q, packed.k, packed.v, packed.args),), packed.restore), packed.note
    split = prefix_masks.as_prefix_lm(fmt, q, k, v, args, call)
    if split is None:
        return None, None
    signature = (id(module), module.training, module.policy, tuple(q.shape), tuple(k.shape), tuple(v.shape),
                 q.dtype, q.device, q.requires_grad or k.requires_grad or v.requires_grad, torch.is_grad_enabled(),
                 current_stamp())
    pays, note = cached_on((args.attention_mask,), ("prefix_split_pays", signature),
                           lambda: _split_pays(module, q, k, v, args, split))
    return (MaskReading((split.head, split.tail), split.join) if pays else None), note


def _rewritable(module: torch.nn.Module, fp8: tuple | None) -> bool:
    """Whether a mask's reading may rewrite the module's call: nothing the rewritten call would change (user
    modifiers, the max-logit output, FP8's scaling over the call), and no forced backend (it may not take the
    rewritten call: forced means forced, by backend= or ATTN_DISPATCH_BACKEND)."""
    return (fp8 is None and not module._user_mods and not module.return_max_logit and module.backend is None
            and EnvFlags.from_environ().forced_backend is None)


# FlexAttention on a prefix-LM mask (the call as given) reached at best 0.83x the causal call's TFLOP/s (H200, flex
# lowered to flash-attn-4, inference; 0.79 training; on its Triton kernels 0.6-0.68: benchmarks/results/masks/
# bench_masks_h200_full_inference.json, bench_masks_h200_full_flash_train.json, bench_masks_h200_stock_inference.json)
FLEX_PREFIX_FRACTION = 0.83


def _pick(module: torch.nn.Module, q, k, v, args: CallArgs) -> tuple[str | None, float | None]:
    """(selection's pick for a plain call, its predicted ms or None)."""
    params = plain_params(describe_plain(module, q, k, v, args)[0])[0]
    decision = selection.explain(params, force=module.backend, policy=module.policy)
    return decision.chosen, decision.estimates.get(decision.chosen) if decision.chosen else None


def _split_pays(module: torch.nn.Module, q, k, v, args: CallArgs, split) -> tuple[bool, str]:
    """Whether the two calls are predicted within 1 / FLEX_PREFIX_FRACTION of the causal call over the same tensors
    (where the mask as given would at best run), and the note saying so. Without a prediction for either (no
    profile for this platform: nothing to weigh), the two calls, whose engines are the structured ones that take
    most calls: an unmeasured default, said so in the note."""
    (head, head_ms), (tail, tail_ms) = _pick(module, *split.head), _pick(module, *split.tail)
    causal, causal_ms = _pick(module, q, k, v, args.replace(attention_mask=None, attn_mask_type="causal",
                                                            window_size=(-1, 0)))
    if head is None or tail is None:
        return False, (f"the bool attention_mask is a prefix-LM mask (a prefix of {split.prefix} tokens); its two "
                       f"calls have no engine ({head or 'none'} for the prefix rows, {tail or 'none'} for the rest): "
                       "run as given")
    if head_ms is None or tail_ms is None or not causal_ms:
        return True, split.note(head) + "; no predicted time to weigh them against the mask as given"
    ratio = (head_ms + tail_ms) / causal_ms
    weighed = (f"predicted {head_ms + tail_ms:.3f} ms ({head} {head_ms:.3f}, {tail} {tail_ms:.3f}), {ratio:.2f}x "
               f"the causal call over the same tensors ({causal} {causal_ms:.3f} ms)")
    if ratio <= 1.0 / FLEX_PREFIX_FRACTION:
        return True, f"{split.note(head)}; {weighed}"
    return False, (f"the bool attention_mask is a prefix-LM mask (a prefix of {split.prefix} tokens), run as given: "
                   f"its two calls are {weighed}, more than the {1.0 / FLEX_PREFIX_FRACTION:.2f}x at which "
                   f"FlexAttention on the mask measured at best ({FLEX_PREFIX_FRACTION}x the causal call's TFLOP/s)")


def describe_plain(module: torch.nn.Module, q, k, v, args: CallArgs, fp8: tuple | None = None):
    """Validated (params, sequence facts) of a plain call: the slow path's description, which the plan cache
    keys and explain() answers. fp8: (region, output in FP8) inside fp8_autocast."""
    fmt, mask_type, window = validation.resolve_call(module, args)
    validation.check_ranks(fmt, q, k, v)
    seq = sequences.sequence_info(fmt, mask_type, q, k, args, window)
    return plan_params(module._spec_now(), fmt, mask_type, window, q, k, v, seq, args, module.training, fp8), seq


def plan_params(spec, fmt: str, mask_type: str, window: tuple[int, int], q, k, v, seq, args: CallArgs,
                training: bool, fp8: tuple | None) -> AttentionParams:
    """A plain call's AttentionParams, for the plan cache and explain() alike."""
    params = build_params(spec, fmt, mask_type, window, q, k, v, seq, args, training)
    if fp8 is None:
        return params
    region, output_fp8 = fp8
    return params.replace(fp8=True, fp8_recipe=region.recipe.kind, fp8_output=output_fp8)


BF16_BASELINE = "cudnn_fused:frontend"  # what the FP8 measurement timed against (fp8/speed.py)


def fp8_notes(params: AttentionParams, platform: Platform, env: EnvFlags) -> tuple[str, ...]:
    """An FP8 call's notes: which backward runs (training), and the predicted FP8 and bf16 times (fp8/speed.py)."""
    if not params.fp8:
        return ()
    notes = ("backward: " + backward_text(env),) if params.is_training else ()
    return notes + (_fp8_speed(params, platform, env),)


def _fp8_speed(params: AttentionParams, platform: Platform, env: EnvFlags) -> str:
    if platform.device_type != "cuda" or platform.sm != speed.MEASURED_SM:
        return (f"FP8 speed: measured on sm{speed.MEASURED_SM} only ({speed.MEASURED_ON}, {speed.SOURCE}); no "
                "prediction for this platform")
    if params.cp_size > 1:
        return "FP8 speed: no prediction under context parallelism (the measurement is of one GPU's calls)"
    bf16 = params.replace(fp8=False, fp8_recipe=None, fp8_output=False)
    profile = profile_for(platform)
    times = profile.predict(bf16, machine=platform.device_name).times_ms if profile is not None else {}
    bf16_ms = times.get(BF16_BASELINE)
    if not bf16_ms:
        return f"FP8 speed: the profile has no bf16 {BF16_BASELINE} prediction for this call, hence none for FP8"
    e = speed.estimate(bf16_ms, causal="causal" in params.attn_mask_type, seqlen=params.max_seqlen_q,
                       training=params.is_training)
    # cuDNN's FP8 backward on Hopper: head dim 128, no thd (the FP8 table's fp8_head_dim and fp8_format)
    fp8_backward_possible = (params.head_dim_qk, params.head_dim_v) == (128, 128) and params.qkv_format != "thd"
    text = "FP8 speed: " + speed.describe(e, env.fp8_dpa_bwd, fp8_backward_possible)
    pick = selection.explain(bf16, platform, env).chosen
    if pick and pick != BF16_BASELINE and times.get(pick, bf16_ms) < bf16_ms:
        text += f"; in bf16 this call would run {pick}, predicted at {times[pick]:.3f} ms"
    return text
