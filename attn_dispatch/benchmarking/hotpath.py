"""Hot-path checks: what a cached DotProductAttention.forward adds over calling the chosen engine
directly, and whether the module works inside CUDA graph capture and torch.compile without recompiling per call.

Host time is measured two profiler-free ways at a small shape (where host time shows):
- loop: N calls back to back, synchronising only before and after, divided by N (min and median of repeats);
- per call: time.perf_counter_ns around each call (no synchronisation; the launch cost as the caller sees it),
  median; plus time.thread_time (this thread's CPU time) over the loop, divided by N.
Headline figures: module minus engine on the loop minimum (the least disturbed repeat) and on the 10th
percentile, over many short repeats (a shared host's neighbours slow single loops by up to 2x, so short
loops give more chances of a quiet one); the median of paired differences is reported beside them.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
from ..params import AttentionParams
from ..synthetic import make_call
from ..module import DotProductAttention
from ..backends import AttnAux, AttnConfig, get_engine

SMALL_SHAPE = dict(batch=1, seqlen=128, heads=16, head_dim=64)


def make_inputs(device: torch.device, dtype: torch.dtype, *, batch: int, seqlen: int, heads: int, head_dim: int,
                requires_grad: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bshd q, k, v of the small shape (attn_dispatch.synthetic draws them)."""
    params = AttentionParams(dtype="fp32", batch_size=batch, num_heads=heads, head_dim_qk=head_dim,
                             max_seqlen_q=seqlen, qkv_format="bshd", device_type=device.type)
    call = make_call(params, device=device, seed=seed, requires_grad=requires_grad, dtype=dtype)
    return call.q, call.k, call.v


def make_module(heads: int, head_dim: int, device: torch.device, *, backend: str | None = None,
                mask: str = "no_mask") -> torch.nn.Module:

    return DotProductAttention(heads, head_dim, qkv_format="bshd", attn_mask_type=mask, backend=backend).to(device)


def direct_engine_calls(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> tuple[str, Callable[[], Any], Callable[[], Any]]:
    """The engine the module chose for these inputs, called directly: through its autograd wrapper (what the
    module calls) and through its bare functional forward."""
    decision = module.explain(q, k, v)
    engine = get_engine(decision.chosen)
    cfg = AttnConfig(qkv_format="bshd", attn_mask_type="no_mask", window_size=(-1, -1),
                     softmax_scale=1.0 / math.sqrt(q.shape[-1]))
    aux = AttnAux(max_seqlen_q=q.shape[1], max_seqlen_kv=k.shape[1])
    return decision.chosen, (lambda: engine(q, k, v, aux, cfg)), (lambda: engine.forward(q, k, v, aux, cfg))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_times(fns: dict[str, Callable[[], Any]], device: torch.device, *, calls: int = 200,
               repeats: int = 101, settle_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Microseconds per call for each function, repeats interleaved in rotating order (so drift hits all
    alike): the loop figure
    (sync at the ends only) and thread CPU time as min and median over repeats, the per-call perf_counter as the
    median over every sample."""
    settle_until = time.perf_counter() + settle_s  # a fresh process on a shared host starts slow: let it settle
    while True:
        for fn in fns.values():
            for _ in range(20):
                fn()
        _sync(device)
        if time.perf_counter() >= settle_until:
            break
    loops = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    per_call = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no function always goes first
            fn = fns[name]
            _sync(device)
            start, cpu_start = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            _sync(device)
            loops[name].append((time.perf_counter() - start) / calls * 1e6)
            cpu[name].append((time.thread_time() - cpu_start) / calls * 1e6)
            for _ in range(min(calls, 50)):
                t0 = time.perf_counter_ns()
                fn()
                per_call[name].append((time.perf_counter_ns() - t0) / 1e3)
            _sync(device)
    return {name: {"loop_us_min": min(loops[name]), "loop_us_p10": _percentile(loops[name], 10),
                   "loop_us_median": statistics.median(loops[name]),
                   "loop_us": [round(x, 3) for x in loops[name]],
                   "per_call_us_median": statistics.median(per_call[name]),
                   "thread_cpu_us_min": min(cpu[name]), "thread_cpu_us_median": statistics.median(cpu[name])}
            for name in fns}


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def overhead(device: torch.device, dtype: torch.dtype, *, backend: str | None = None, grad: bool = False,
             calls: int = 200, repeats: int = 101, shape: dict | None = None,
             settle_s: float = 3.0) -> dict[str, Any]:
    """Cached module.forward vs the chosen engine called directly, same inputs; in inference (no_grad) or with
    autograd recording (grad=True)."""
    shape = shape or SMALL_SHAPE
    module = make_module(shape["heads"], shape["head_dim"], device, backend=backend)
    module.train(grad)
    q, k, v = make_inputs(device, dtype, **shape, requires_grad=grad)
    chosen, engine_call, engine_forward = direct_engine_calls(module, q, k, v)
    variants = {"module": lambda: module(q, k, v), "engine_call": engine_call}
    if not grad:
        variants["engine_forward"] = engine_forward
    with torch.set_grad_enabled(grad):
        results = host_times(variants, device, calls=calls, repeats=repeats, settle_s=settle_s)
    added = {m: results["module"][m] - results["engine_call"][m] for m in results["module"] if m != "loop_us"}
    added["paired_loop_us_median"] = statistics.median(
        m - e for m, e in zip(results["module"]["loop_us"], results["engine_call"]["loop_us"]))
    return {"chosen": chosen, "grad": grad, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
            "calls": calls, "repeats": repeats, "settle_s": settle_s, "results_us": results,
            "module_over_engine_us": added}


def check_cuda_graph(device: torch.device, dtype: torch.dtype, *, backend: str | None = None,
                     shape: dict | None = None) -> dict[str, Any]:
    """Capture module.forward in a CUDA graph (inference), replay on new inputs, compare with eager; then
    torch.cuda.make_graphed_callables for forward+backward."""
    shape = shape or SMALL_SHAPE
    result: dict[str, Any] = {"backend": backend}
    module = make_module(shape["heads"], shape["head_dim"], device, backend=backend).eval()
    q, k, v = make_inputs(device, dtype, **shape)
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    module(q, k, v)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = module(q, k, v)
            result["chosen"] = module.last_decision.chosen if module.last_decision else None
            new = make_inputs(device, dtype, **shape, seed=1)
            for static, fresh in zip((q, k, v), new):
                static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            eager = module(*new)
            result["inference"] = {"ok": bool(torch.allclose(static_out.float(), eager.float(), atol=1e-2, rtol=1e-2)),
                                   "max_abs_diff": float((static_out.float() - eager.float()).abs().max())}
    except Exception as exc:  # noqa: BLE001 - the check reports what broke
        result["inference"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    try:
        train_module = make_module(shape["heads"], shape["head_dim"], device, backend=backend).train()
        sample = make_inputs(device, dtype, **shape, requires_grad=True, seed=2)
        graphed = torch.cuda.make_graphed_callables(train_module, sample)
        qg, kg, vg = make_inputs(device, dtype, **shape, requires_grad=True, seed=3)
        graphed(qg, kg, vg).float().square().sum().backward()
        # make_graphed_callables replaces train_module.forward: the eager reference is a twin module
        reference = make_module(shape["heads"], shape["head_dim"], device, backend=backend).train()
        qe, ke, ve = (t.detach().clone().requires_grad_() for t in (qg, kg, vg))
        reference(qe, ke, ve).float().square().sum().backward()
        diff = max(float((a.grad.float() - b.grad.float()).abs().max()) for a, b in ((qg, qe), (kg, ke), (vg, ve)))
        result["fwd_bwd"] = {"ok": diff < 5e-2, "max_abs_grad_diff": diff}
    except Exception as exc:  # noqa: BLE001
        result["fwd_bwd"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    return result


def check_compile(device: torch.device, dtype: torch.dtype, *, backend: str | None = None,
                  compiler: str = "inductor", calls: int = 10, grad: bool = True, shape: dict | None = None,
                  factory: Callable[[], torch.nn.Module] | None = None) -> dict[str, Any]:
    """torch.compile(module): output matches eager, and calls after the first (same shape, fresh tensors)
    compile nothing new (counted by wrapping the compiler backend; graph breaks from torch._dynamo's counters).
    `factory` builds another module taking (q, k, v), to check the check itself. Rerun with
    TORCH_LOGS=recompiles to see why something recompiles."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    shape = shape or SMALL_SHAPE
    result: dict[str, Any] = {"backend": backend, "compiler": compiler, "calls": calls, "grad": grad}
    compiles = 0
    inner = lookup_backend(compiler)

    def counting(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return inner(gm, example_inputs)

    try:
        torch._dynamo.reset()
        counters.clear()
        module = factory() if factory else make_module(shape["heads"], shape["head_dim"], device, backend=backend)
        module.train(grad)
        compiled = torch.compile(module, backend=counting)
        with torch.set_grad_enabled(grad):
            q, k, v = make_inputs(device, dtype, **shape, requires_grad=grad)
            out = compiled(q, k, v)
            if grad:
                out.float().sum().backward()
            first = compiles
            for i in range(calls):
                q2, k2, v2 = make_inputs(device, dtype, **shape, requires_grad=grad, seed=10 + i)
                out2 = compiled(q2, k2, v2)
                if grad:
                    out2.float().sum().backward()
            eager = module(q2, k2, v2)
        result.update({
            "chosen": module.last_decision.chosen if getattr(module, "last_decision", None) else None,
            "graphs_first_call": first, "graphs_after_first_call": compiles - first,
            "graph_breaks": sum(counters["graph_break"].values()),
            "dynamo_unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_break_reasons": sorted(counters["graph_break"])[:5],
            "matches_eager": bool(torch.allclose(out2.float(), eager.float(), atol=2e-2, rtol=2e-2)),
        })
        result["ok"] = result["matches_eager"] and result["graphs_after_first_call"] == 0
    except Exception as exc:  # noqa: BLE001 - the check reports what broke
        result.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
    finally:
        torch._dynamo.reset()
    return result
