"""The module's own host overhead, without kernel time: DotProductAttention.forward (cached path) against the
chosen engine called directly through Engine.__call__. Two stand-in engines, on CPU (no GPU needed); min over
repeats, because the machine may be shared:
- trivial: an Engine whose forward hands back preallocated tensors (the autograd-Function path the cuDNN frontend
  and flash-attn engines take);
- native: the torch providers' native-op path (backends/_torch_native.flash_call, what flash_attn_2:torch runs
  for dense calls) with a clone of q standing in for the CUDA op: the same Python code around it, and like the op
  one C++ autograd node and an output in [b, h, s, d] order over bshd memory (torch's CPU flash kernel would do
  too, but its run time varies by more than the host time measured here), at a tiny shape (the views' host
  time does not depend on it; the clone's does).

    python3 benchmarks/bench_hotpath_cpu.py                 # table, us/call
    python3 benchmarks/bench_hotpath_cpu.py --profile       # plus cProfile of the module's cached path
    python3 benchmarks/bench_hotpath_cpu.py --json OUT.json
    python3 benchmarks/bench_hotpath_cpu.py --decode [--profile]   # transformers' decode step, see below

Headline: "module - engine" (us/call) in inference (eval, no_grad) and training (train, grad enabled,
inputs requiring grad); the budget is 5 us on a GPU host. "module(kw)" is the same call passing one
keyword at its default value (attn_mask_type="no_mask"): the cached path every call with keywords takes (through
nn.Module.__call__, forward and the plan cache). "sdpa_fn-op": attn_dispatch.scaled_dot_product_attention on
[b, h, s, d] tensors (the transformers integration's call) over the stand-in op called on them directly.

--decode: the transformers integration's attention function called as transformers 5.24 calls it in a batched
greedy decode step (query [8, 16, 1, d] a transposed view, key/value [8, 8, L, d] with L growing by one a step, a new
4-D bool mask from transformers' own sdpa_mask each step, left padding, shared by the step's 8 layers, kwargs
position_ids and use_cache), against torch's SDPA called the same way. Both readings of the mask are measured: as
given ('arbitrary', what stock torch runs on a GPU) and as a padding pattern (thd views with offsets, what the full
stack runs with cuDNN), the latter by preferring that reading as a GPU platform with cudnn-frontend does. The
engine (unfused:pytorch on CPU) is replaced by one returning an empty output, so that what is timed is the host
path around it; torch SDPA computes, at a tiny head_dim (8) its kernel time is small. Per call, mean over the
steps (the mask and cache are new each step, so a minimum over repeats of one call would hide the per-step work).
"difference" is attn_dispatch's host path (engine stubbed) less torch SDPA's whole call (its CPU kernel included):
an upper bound on what the integration adds; the as_padding row includes the thd views' key/value copies (device
work on a GPU, host memcpy here) and the mask's reading once a step. On 2 shared cores (torch 2.13 CPU), before ->
after this mode's fixes: as_given 124 -> 61 us/call, as_padding 477 -> 334 us/call.

Run it from the repository root with PYTHONPATH=. to measure this checkout rather than the installed package.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from typing import Any, Callable

import torch

from attn_dispatch import backends
from attn_dispatch.backends import _torch_native
from attn_dispatch.backends.base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult
from attn_dispatch.module import DotProductAttention
from attn_dispatch.sdpa import scaled_dot_product_attention as sdpa_function

SHAPE = dict(batch=1, seqlen=128, heads=16, head_dim=64)
NATIVE_SHAPE = dict(batch=1, seqlen=8, heads=2, head_dim=16)
PROVIDER = "unfused:pytorch"  # the id the stand-in engines take (the module forces this family)


class TrivialEngine(Engine):
    """Returns preallocated tensors: whatever time a call takes beyond engine.forward is the caller's own."""

    family, provider = "unfused", "pytorch"

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        b, s, h, _ = q.shape
        self.out = torch.zeros(b, s, h, v.shape[-1], dtype=q.dtype)
        self.lse = torch.zeros(b, h, s, dtype=torch.float32)
        self.flat_out = torch.zeros(b, s, h * v.shape[-1], dtype=q.dtype)  # its own storage: not a view

    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        # Fresh tensor objects (aliases of preallocated storage), as a real engine returns new outputs: autograd
        # then attaches each call's node to new tensors rather than re-pointing one tensor's grad_fn.
        return FwdResult(self.out.detach(), self.lse.detach())

    def forward_flat(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        # As the cuDNN frontend engine does: the output is allocated with heads merged, so no view is taken.
        return FwdResult(self.flat_out.detach(), self.lse.detach())

    def backward(self, dout, q, k, v, out, lse, state, aux, cfg) -> BwdResult:
        return BwdResult(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))


class NativeStandIn(_torch_native.NativeOpPath, TrivialEngine):
    """flash_attn_2:torch's dense path (NativeOpPath -> flash_call), its aten op replaced by flash_op."""

    native_call = staticmethod(_torch_native.flash_call)

    def flash_op(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        """aten::_scaled_dot_product_flash_attention's signature; q [b, h, s, d] is a view of bshd memory."""
        return q.clone(), self.lse


def _time(fns: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(200):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits all alike
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def measure(training: bool, calls: int = 2000, repeats: int = 15, profile: bool = False,
            stand_in: str = "trivial") -> dict[str, float]:
    shape = NATIVE_SHAPE if stand_in == "native" else SHAPE
    b, s, h, d = shape["batch"], shape["seqlen"], shape["heads"], shape["head_dim"]
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16).requires_grad_(training) for _ in range(3))
    saved, saved_flash = backends._INSTANCES.get(PROVIDER), _torch_native._FLASH
    engine = backends._INSTANCES[PROVIDER] = (NativeStandIn if stand_in == "native" else TrivialEngine)(q, v)
    if stand_in == "native":
        _torch_native._FLASH = engine.flash_op
    try:
        module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", backend="unfused")
        module.train(training)
        cfg = AttnConfig(qkv_format="bshd", attn_mask_type="no_mask", window_size=(-1, -1),
                         softmax_scale=1.0 / d ** 0.5)
        aux = AttnAux(max_seqlen_q=s, max_seqlen_kv=s)
        with torch.set_grad_enabled(training):
            module(q, k, v)
            assert module.last_decision.chosen == PROVIDER, module.last_decision.chosen
            fns = {"module": lambda: module(q, k, v), "engine_call": lambda: engine(q, k, v, aux, cfg),
                   "module_keywords": lambda: module(q, k, v, attn_mask_type="no_mask")}
            if stand_in == "native":  # the SDPA-signature function on [b, h, s, d] views, against the op alone
                q4, k4, v4 = (x.transpose(1, 2) for x in (q, k, v))
                op = _torch_native._FLASH
                fns["sdpa_function"] = lambda: sdpa_function(q4, k4, v4)
                fns["op"] = lambda: op(q4, k4, v4, 0.0, False, False, scale=1.0 / d ** 0.5)
            if stand_in == "trivial":  # the native stand-in's own forward is not what the native path runs
                fns["engine_forward"] = lambda: engine.forward(q, k, v, aux, cfg)
            result = _time(fns, calls, repeats)
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    module(q, k, v)
                prof.disable()
                print(f"--- cProfile, module cached path, {'training' if training else 'inference'}, {stand_in} ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        _torch_native._FLASH = saved_flash
        if saved is None:
            backends._INSTANCES.pop(PROVIDER, None)
        else:
            backends._INSTANCES[PROVIDER] = saved
    if "sdpa_function" in result:
        result["sdpa_function_minus_op"] = result["sdpa_function"] - result["op"]
    result["module_minus_engine"] = result["module"] - result["engine_call"]
    result["module_keywords_minus_engine"] = result["module_keywords"] - result["engine_call"]
    return result


DECODE = dict(batch=8, heads=16, kv_heads=8, head_dim=8, prompt=32, layers=8, steps=64)


class EmptyOutEngine(TrivialEngine):
    """Returns a new uninitialised output of the call's shape (bshd or thd): the host path around it is timed."""

    def __init__(self):  # noqa: D107 - no preallocation: the shapes change every step
        pass

    def forward(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        return FwdResult(q.new_empty(q.shape[:-1] + v.shape[-1:]), None)

    def forward_flat(self, q, k, v, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        return FwdResult(q.new_empty(q.shape[:-2] + (q.shape[-2] * v.shape[-1],)), None)


def decode_steps(shape: dict, seed: int = 0):
    """Per step: (the step's bool mask from transformers' sdpa_mask, [(query, key, value)] per layer), a left-padded
    batch (row i short by 3 * i tokens) generating one token a step. Built before timing."""
    from transformers.masking_utils import sdpa_mask

    b, h, hkv, d, prompt = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "prompt"))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max(1, prompt - 3 * i) for i in range(b)])
    keep = torch.arange(prompt)[None] >= (prompt - lengths)[:, None]
    steps = []
    for step in range(shape["steps"]):
        keep = torch.cat([keep, torch.ones(b, 1, dtype=torch.bool)], 1)
        kv_len = keep.shape[1]
        mask = sdpa_mask(batch_size=b, q_length=1, kv_length=kv_len, q_offset=kv_len - 1, attention_mask=keep,
                         device="cpu")
        layers = [(torch.randn(b, 1, h, d, generator=g).transpose(1, 2),  # q_proj(...).view().transpose(1, 2)
                   torch.randn(b, hkv, kv_len, d, generator=g), torch.randn(b, hkv, kv_len, d, generator=g))
                  for _ in range(shape["layers"])]
        steps.append((mask, layers))
    return steps


def measure_decode(reading: str, shape: dict = DECODE, rounds: int = 5, profile: bool = False) -> dict[str, float]:
    """us per attention call, mean over one generation's steps and layers, best of `rounds` generations."""
    import torch.nn.functional as F

    from attn_dispatch.integrations import transformers as glue

    class Attention(torch.nn.Module):  # what the function reads of transformers' attention module
        is_causal = True

    modules = [Attention().eval() for _ in range(shape["layers"])]
    scale = shape["head_dim"] ** -0.5
    steps = decode_steps(shape)
    calls = len(steps) * shape["layers"]

    def ours(module, q, k, v, mask):
        return glue.attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scale, position_ids=None,
                                      use_cache=True)

    def torch_sdpa(module, q, k, v, mask):  # transformers' sdpa_attention_forward's call, less its bookkeeping
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, enable_gqa=True)

    def generation(fn):
        start = time.perf_counter()
        for mask, layers in steps:
            for module, (q, k, v) in zip(modules, layers):
                fn(module, q, k, v, mask)
        return (time.perf_counter() - start) / calls * 1e6

    saved_engine, saved_prefer = backends._INSTANCES.get(PROVIDER), glue.prefer_padding_reading
    backends._INSTANCES[PROVIDER] = EmptyOutEngine()
    if reading == "as_padding":
        glue.prefer_padding_reading = lambda as_padding, as_given: True
    glue._DECODE_READING.clear()
    try:
        with torch.no_grad():
            fns = {"attn_dispatch": ours, "torch_sdpa": torch_sdpa}
            for fn in fns.values():
                generation(fn)
            best = {name: float("inf") for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    best[name] = min(best[name], generation(fn))
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                generation(ours)
                prof.disable()
                print(f"--- cProfile, decode steps, mask {reading}: {calls} calls ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(int(__import__("os").environ.get("NSTATS", 22)))
    finally:
        glue.prefer_padding_reading = saved_prefer
        glue._DECODE_READING.clear()
        if saved_engine is None:
            backends._INSTANCES.pop(PROVIDER, None)
        else:
            backends._INSTANCES[PROVIDER] = saved_engine
    best["attn_dispatch_minus_torch_sdpa"] = best["attn_dispatch"] - best["torch_sdpa"]
    return best


def main_decode(args) -> None:
    results = {reading: measure_decode(reading, rounds=args.repeats, profile=args.profile)
               for reading in ("as_given", "as_padding")}
    print(f"{'mask read':<12} {'attn_dispatch':>14} {'torch sdpa':>11} {'difference':>11}   (us/call, {DECODE})")
    for reading, r in results.items():
        print(f"{reading:<12} {r['attn_dispatch']:14.1f} {r['torch_sdpa']:11.1f} "
              f"{r['attn_dispatch_minus_torch_sdpa']:11.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"decode_shape": DECODE, "torch": torch.__version__, "results_us": results}, fh, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--decode", action="store_true", help="transformers' decode-step calls (see above)")
    args = parser.parse_args()
    if args.decode:
        return main_decode(args)
    results = {f"{mode}/{stand_in}": measure(mode == "training", args.calls, args.repeats, args.profile, stand_in)
               for stand_in in ("trivial", "native") for mode in ("inference", "training")}
    print(f"{'mode/engine':<18} {'module':>8} {'engine()':>9} {'engine.fwd':>11} {'module-engine':>14} "
          f"{'module(kw)-engine':>18} {'sdpa_fn-op':>11}   (us/call, min)")
    for mode, r in results.items():
        print(f"{mode:<18} {r['module']:8.2f} {r['engine_call']:9.2f} {r.get('engine_forward', float('nan')):11.2f} "
              f"{r['module_minus_engine']:14.2f} {r['module_keywords_minus_engine']:18.2f} "
              f"{r.get('sdpa_function_minus_op', float('nan')):11.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": SHAPE, "native_shape": NATIVE_SHAPE, "torch": torch.__version__,
                       "results_us": results}, fh, indent=1)


if __name__ == "__main__":
    main()
