"""The module's own host overhead, without kernel time: DotProductAttention.forward (cached path) against the
chosen engine called directly through Engine.__call__, with a trivial engine whose forward hands back
preallocated tensors. Runs on CPU (no GPU needed); min over repeats, because the machine may be shared.

    python3 benchmarks/bench_hotpath_cpu.py                 # table, us/call
    python3 benchmarks/bench_hotpath_cpu.py --profile       # plus cProfile of the module's cached path
    python3 benchmarks/bench_hotpath_cpu.py --json OUT.json

Headline: "module - engine" (us/call) in inference (eval, no_grad) and training (train, grad enabled,
inputs requiring grad); issue 8's budget is 5 us on the GPU host. "module(kw)" is the same call passing one
keyword at its default value (attn_mask_type="no_mask"): the cached path every call with keywords takes (through
nn.Module.__call__, forward and the plan cache).

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
from attn_dispatch.backends.base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult
from attn_dispatch.module import DotProductAttention

SHAPE = dict(batch=1, seqlen=128, heads=16, head_dim=64)
PROVIDER = "unfused:pytorch"  # the id the trivial engine stands in for (the module forces this family)


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


def measure(training: bool, calls: int = 2000, repeats: int = 15, profile: bool = False) -> dict[str, float]:
    b, s, h, d = SHAPE["batch"], SHAPE["seqlen"], SHAPE["heads"], SHAPE["head_dim"]
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16).requires_grad_(training) for _ in range(3))
    saved = backends._INSTANCES.get(PROVIDER)
    engine = backends._INSTANCES[PROVIDER] = TrivialEngine(q, v)
    try:
        module = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask", backend="unfused")
        module.train(training)
        cfg = AttnConfig(qkv_format="bshd", attn_mask_type="no_mask", window_size=(-1, -1),
                         softmax_scale=1.0 / d ** 0.5)
        aux = AttnAux(max_seqlen_q=s, max_seqlen_kv=s)
        with torch.set_grad_enabled(training):
            module(q, k, v)
            assert module.last_decision.chosen == PROVIDER, module.last_decision.chosen
            result = _time({"module": lambda: module(q, k, v), "engine_call": lambda: engine(q, k, v, aux, cfg),
                            "engine_forward": lambda: engine.forward(q, k, v, aux, cfg),
                            "module_keywords": lambda: module(q, k, v, attn_mask_type="no_mask")}, calls, repeats)
            if profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    module(q, k, v)
                prof.disable()
                print(f"--- cProfile, module cached path, {'training' if training else 'inference'} ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        if saved is None:
            backends._INSTANCES.pop(PROVIDER, None)
        else:
            backends._INSTANCES[PROVIDER] = saved
    result["module_minus_engine"] = result["module"] - result["engine_call"]
    result["module_keywords_minus_engine"] = result["module_keywords"] - result["engine_call"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {mode: measure(mode == "training", args.calls, args.repeats, args.profile)
               for mode in ("inference", "training")}
    print(f"{'mode':<10} {'module':>8} {'engine()':>9} {'engine.fwd':>11} {'module-engine':>14} "
          f"{'module(kw)-engine':>18}   (us/call, min)")
    for mode, r in results.items():
        print(f"{mode:<10} {r['module']:8.2f} {r['engine_call']:9.2f} {r['engine_forward']:11.2f} "
              f"{r['module_minus_engine']:14.2f} {r['module_keywords_minus_engine']:18.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": SHAPE, "torch": torch.__version__, "results_us": results}, fh, indent=1)


if __name__ == "__main__":
    main()
