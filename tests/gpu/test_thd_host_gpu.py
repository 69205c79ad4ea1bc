"""thd calls as DotProductAttention runs them (the host facts of AttnAux.packed, the cached cu_seqlens-derived
tensors) on a GPU, for every thd-capable provider installed, against the float64 reference (tests/reference.py):
out, lse and the q, k, v gradients, bf16 (rel. error <= 2e-2), with and without rows past the last sequence. Rows
past cu_seqlens[-1] must be exactly 0 (out, dq, dk, dv) with lse -inf. A second call with the same cu_seqlens
(the cached path a model's later layers take) must give the same results.

The engine is called with the plan and aux the module's own _prepare makes (what forward runs), so that lse is
seen too; the module's output is compared with it. Combinations a provider's table declares unsupported are
skipped with the table's reasons (tests/gpu/test_flash_gpu.py and test_cudnn_gpu.py check those are refused).
Rows without keys (a sequence with more queries than keys, bottom-right) run on the FlashAttention providers only:
cuDNN's per-sequence bottom-right alignment is only covered for sq_i <= skv_i (tests/gpu/test_cudnn_gpu.py).
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from attn_dispatch import DotProductAttention
from attn_dispatch.call_args import CallArgs
from gpu_common import TOL, cu, lse_error, rel_err, write_and_print
from reference import reference_attention

pytestmark = pytest.mark.gpu
PROVIDERS = ("flash_attn_4:cute", "flash_attn_2:torch", "flash_attn_2:package", "flash_attn_3:interface",
             "cudnn_fused:frontend")
H, HKV, D = 8, 4, 64
RESULTS: list[dict] = []

# name: (mask, window, query lengths, key lengths, rows past the end (q, kv), flash only)
CASES = {
    "padding": ("padding", None, [96, 37, 128], [96, 37, 128], (0, 0), False),
    "padding_tail": ("padding", None, [96, 37, 128], [80, 64, 17], (7, 5), False),
    "causal": ("padding_causal", None, [128, 59, 1], [128, 59, 1], (0, 0), False),
    "causal_tail": ("padding_causal", None, [128, 59, 1], [128, 59, 1], (13, 13), False),
    "causal_br": ("padding_causal_bottom_right", None, [40, 27, 96], [64, 50, 128], (0, 0), False),
    "causal_br_window_tail": ("padding_causal_bottom_right", (24, 0), [40, 27, 96], [64, 50, 128], (3, 0), False),
    "keyless_rows": ("padding_causal_bottom_right", None, [64, 30, 96], [20, 30, 128], (0, 0), True),
    "keyless_rows_tail": ("padding_causal_bottom_right", None, [64, 0, 96], [20, 9, 128], (6, 2), True),
}


def _inputs(name: str, seed: int = 0):
    mask, window, lq, lkv, (tail_q, tail_kv), _ = CASES[name]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16).requires_grad_()

    q = rnd(sum(lq) + tail_q, H, D)
    k, v = rnd(sum(lkv) + tail_kv, HKV, D), rnd(sum(lkv) + tail_kv, HKV, D)
    kwargs = dict(cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lkv), max_seqlen_q=max(lq), max_seqlen_kv=max(lkv))
    return q, k, v, kwargs, mask, window


def _module(provider: str, mask: str, window) -> DotProductAttention:
    return DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd", attn_mask_type=mask, window_size=window,
                               backend=provider)


def _run(provider: str, name: str) -> dict[str, float]:
    q, k, v, kwargs, mask, window = _inputs(name)
    m = _module(provider, mask, window)
    family, prov = provider.split(":")
    verdict = m.explain(q, k, v, **kwargs).verdict(family, prov)
    if not verdict.eligible:
        pytest.skip(f"{provider} declares {name} unsupported: " + "; ".join(r.code for r in verdict.reasons))
    plan, aux = m._prepare(q, k, v, CallArgs(**kwargs))
    end_q, end_kv = int(kwargs["cu_seqlens_q"][-1]), int(kwargs["cu_seqlens_kv"][-1])
    assert aux.packed is not None and (aux.packed.end_q, aux.packed.end_kv) == (end_q, end_kv)
    out, lse, _ = plan.engine(q, k, v, aux, plan.cfg)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to("cuda", out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rq, rk, rv = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    cpu = {n: t.cpu() for n, t in kwargs.items() if n.startswith("cu_")}
    ref_out, ref_lse = reference_attention(rq, rk, rv, qkv_format="thd", attn_mask_type=mask, window_size=window,
                                           softmax_scale=1 / math.sqrt(D), **cpu)
    ref_grads = torch.autograd.grad(ref_out, (rq, rk, rv), dout.cpu().double())
    errors = {"out": rel_err(out, ref_out), "lse": lse_error(lse, ref_lse)}
    errors.update({n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)})
    # rows past the last sequence: exactly 0 and -inf (1.0 marks a failure)
    tails = [out[end_q:], grads[0][end_q:], grads[1][end_kv:], grads[2][end_kv:]]
    errors["tail_zero"] = 0.0 if all(bool((t == 0).all()) for t in tails) else 1.0
    errors["tail_lse"] = 0.0 if bool(torch.isneginf(lse[:, end_q:]).all()) else 1.0
    # the module's own forward, and a second call with the same cu_seqlens (cached facts and derived tensors)
    with torch.no_grad():
        again = m(q, k, v, **kwargs)
    errors["module_repeat"] = rel_err(again, out.detach().flatten(-2))
    return errors


def _pairs():
    return [(p, n) for p in PROVIDERS for n in CASES if not (CASES[n][5] and p.startswith("cudnn"))]


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    import importlib.metadata

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for dist in ("flash-attn-4", "nvidia-cudnn-frontend", "flash-attn"):
        try:
            meta[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    lines = ["", f"{'provider':24s} {'case':24s} {'ok':3s} errors"]
    lines += [f"{r['provider']:24s} {r['case']:24s} {'yes' if r['ok'] else 'NO':3s} "
              f"{r['error'] or {k: round(e, 4) for k, e in r['errors'].items()}}" for r in RESULTS]
    write_and_print(request.config, RESULTS, meta, "thd_host_gpu_results.json", lines)


@pytest.mark.parametrize("provider, name", _pairs())
def test_thd_through_the_module_matches_the_reference(provider, name):
    from attn_dispatch.backends import EngineUnavailableError

    start = time.perf_counter()
    try:
        errors = _run(provider, name)
    except EngineUnavailableError as exc:
        pytest.skip(f"{provider} is not installed here: {exc}")
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised for pytest
        RESULTS.append({"provider": provider, "case": name, "ok": False, "errors": {},
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}", "seconds": time.perf_counter() - start})
        raise
    tol = TOL[torch.bfloat16]
    ok = all(e <= tol for e in errors.values())
    RESULTS.append({"provider": provider, "case": name, "ok": ok, "errors": errors, "error": None,
                    "seconds": round(time.perf_counter() - start, 3)})
    assert ok, f"{provider} {name}: {errors}"



@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_captured_thd_call_follows_the_cu_seqlens_of_each_replay(provider):
    """CUDA graphs: the call is captured with one set of lengths and replayed after others are copied into the same
    cu_seqlens tensor (a tail appears): the graph must derive lengths, offsets and the tail from the replay's
    contents, not from host facts read at capture."""
    mask, lengths = "padding_causal", ([96, 37, 128], [50, 120, 40])
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(261 + 8, h, D, generator=g).to("cuda", torch.bfloat16) for h in (H, HKV, HKV))
    cu_seqlens = cu(lengths[0])
    kwargs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=128, max_seqlen_kv=128)
    m = _module(provider, mask, None).eval()
    family, prov = provider.split(":")
    verdict = m.explain(q, k, v, **kwargs).verdict(family, prov)
    if not verdict.eligible:
        pytest.skip(f"{provider} declares this call unsupported: " + "; ".join(r.code for r in verdict.reasons))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # warm-up: validation, plan, kernels compiled
            m(q, k, v, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = m(q, k, v, **kwargs)
    errors = {}
    for i, lens in enumerate(lengths):
        cu_seqlens.copy_(cu(lens))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference_attention(*(t.cpu().double() for t in (q, k, v)), qkv_format="thd", attn_mask_type=mask,
                                     cu_seqlens_q=cu_seqlens.cpu(), cu_seqlens_kv=cu_seqlens.cpu(),
                                     softmax_scale=1 / math.sqrt(D))
        errors[f"replay{i}"] = rel_err(out, ref.flatten(-2))
        errors[f"replay{i}_tail_zero"] = 0.0 if bool((out[sum(lens):] == 0).all()) else 1.0
    ok = all(e <= TOL[torch.bfloat16] for e in errors.values())
    RESULTS.append({"provider": provider, "case": "cuda_graph_replay", "ok": ok, "errors": errors, "error": None,
                    "seconds": 0.0})
    assert ok, f"{provider}: {errors}"
