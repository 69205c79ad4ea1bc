"""cuDNN fused attention on a GPU: both engines against the float64 reference (tests/reference.py), forward
(out, lse) and gradients (q, k, v, bias, sink), bf16 (rel. error <= 2e-2) and fp16 (<= 3e-3).

Run on the device machine (see the report / benchmarks/README): every case is its own test, so one failure
never hides the others; a summary table is printed last and, when $OUT is set, written to
$OUT/cudnn_gpu_results.json together with the machine and library versions.
Error metric: max |engine - reference| / max |reference| (floored at 0.1), as in tests/test_unfused_engine.py.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from attn_dispatch.backends.base import AttnAux, AttnConfig
from gpu_common import TOL, Case, layout_qkv, lse_error, padded, rel_err, write_and_print
from reference import reference_attention

pytestmark = pytest.mark.gpu
RESULTS: list[dict] = []


def _lengths(c: Case) -> tuple[list[int], list[int]]:
    lq = list(c.lens_q) or [c.sq - 37 * (i % 2) for i in range(c.b)]
    lkv = list(c.lens_kv) or [c.skv - 21 * (i % 2) for i in range(c.b)]
    if "bottom_right" in c.mask:  # cuDNN aligns per sequence; keep each sq_i <= skv_i
        lq = [min(a, b) for a, b in zip(lq, lkv)]
    return lq, lkv


def make_inputs(c: Case, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", c.dtype)

    lq, lkv = _lengths(c) if padded(c) else ([c.sq] * c.b, [c.skv] * c.b)
    q, k, v, offsets = layout_qkv(c, lq, lkv, rnd)
    aux = AttnAux(max_seqlen_q=max(lq), max_seqlen_kv=max(lkv), **offsets)
    bias_type = "no_bias"
    if c.bias != "no_bias":
        bias_type = "post_scale_bias"
        dims = {"1hss": (1, c.h), "bhss": (c.b, c.h), "b1ss": (c.b, 1), "11ss": (1, 1)}[c.bias]
        aux.bias = rnd(*dims, c.sq, c.skv).requires_grad_(c.bias_grad)
    if c.alibi is not None:
        bias_type = "alibi"
        if c.alibi != "default":
            shape = (c.h,) if c.alibi == "h" else (c.b, c.h)
            aux.alibi_slopes = (torch.rand(*shape, generator=g) * 0.3 + 0.02).cuda()
    if c.softmax == "learnable":
        aux.softmax_offset = torch.randn(c.h, generator=g).cuda().requires_grad_(True)
    for t in (q, k, v):
        t.requires_grad_(True)
    cfg = AttnConfig(qkv_format=c.fmt, attn_mask_type=c.mask, window_size=tuple(c.window),
                     softmax_scale=1.0 / math.sqrt(c.dqk), dropout_p=c.dropout, bias_type=bias_type,
                     softmax_type=c.softmax, deterministic=c.deterministic)
    if c.dropout:
        aux.extra["cudnn_rng_dump"] = torch.zeros(c.b, c.h, cfg_s(c, aux, "q"), cfg_s(c, aux, "kv"),
                                                  dtype=torch.float32, device="cuda")
    return q, k, v, aux, cfg


def cfg_s(c: Case, aux: AttnAux, side: str) -> int:
    """The S extent cuDNN's rng_dump uses: the tensor's (bshd/sbhd) or the graph's bucketed max length (thd)."""
    if c.fmt != "thd":
        return c.sq if side == "q" else c.skv
    from attn_dispatch.backends.cudnn_fused import _bucket

    return _bucket(aux.max_seqlen_q if side == "q" else aux.max_seqlen_kv)


def default_slopes(h: int) -> torch.Tensor:
    n = 2 ** math.floor(math.log2(h))
    s = [2 ** (-8 * (i + 1) / n) for i in range(n)] + [2 ** (-4 * (2 * i + 1) / n) for i in range(h - n)]
    return torch.tensor(s, dtype=torch.float64)


def run_reference(c: Case, q, k, v, aux: AttnAux, cfg: AttnConfig, keep):
    leaf = lambda t: None if t is None else t.detach().cpu().double().requires_grad_(t.requires_grad)  # noqa: E731
    rq, rk, rv = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    rbias, rsink = leaf(aux.bias), leaf(aux.softmax_offset)
    slopes = aux.alibi_slopes.detach().cpu().double() if aux.alibi_slopes is not None else (
        default_slopes(c.h) if c.alibi == "default" else None)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    out, lse = reference_attention(
        rq, rk, rv, qkv_format=c.fmt, attn_mask_type=c.mask, window_size=tuple(c.window),
        cu_seqlens_q=cpu(aux.cu_seqlens_q), cu_seqlens_kv=cpu(aux.cu_seqlens_kv),
        cu_seqlens_q_padded=cpu(aux.cu_seqlens_q_padded), cu_seqlens_kv_padded=cpu(aux.cu_seqlens_kv_padded),
        bias_type=cfg.bias_type, bias=rbias, alibi_slopes=slopes, softmax_type=c.softmax, softmax_offset=rsink,
        softmax_scale=cfg.softmax_scale, dropout_p=c.dropout, dropout_keep=keep)
    return out, lse, (rq, rk, rv, rbias, rsink)


def get(provider: str):
    from attn_dispatch.backends import get_engine

    return get_engine(f"cudnn_fused:{provider}")


def check(c: Case, seed: int = 0) -> dict:
    """Run one case; return {quantity: rel error} (asserted by the caller)."""
    engine = get(c.provider)
    q, k, v, aux, cfg = make_inputs(c, seed)
    out, lse, _ = engine(q, k, v, aux, cfg)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to("cuda", out.dtype)
    out.backward(dout)
    torch.cuda.synchronize()
    keep = None
    if c.dropout:
        dump = aux.extra["cudnn_rng_dump"].cpu()
        keep = dump[:, :, :max(_lengths(c)[0]) if c.fmt == "thd" else c.sq, :]
    ref_out, ref_lse, (rq, rk, rv, rbias, rsink) = run_reference(c, q, k, v, aux, cfg, keep)
    ref_out.backward(dout.detach().cpu().double())
    errors = {"out": rel_err(out, ref_out)}
    errors["lse"] = lse_error(lse, ref_lse)
    for name, mine, ref in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
        errors[name] = rel_err(mine.grad, ref.grad)
    if aux.bias is not None and aux.bias.requires_grad:
        errors["dbias"] = rel_err(aux.bias.grad, rbias.grad) if aux.bias.grad is not None else math.inf
    if aux.softmax_offset is not None and aux.softmax_offset.requires_grad:
        grad = aux.softmax_offset.grad
        errors["dsink"] = rel_err(grad, rsink.grad) if grad is not None else math.inf
    return errors


def record(c: Case, errors: dict | None, error: str | None, seconds: float, extra: dict | None = None) -> None:
    tol = TOL[c.dtype]
    ok = error is None and errors is not None and all(e <= tol for e in errors.values())
    RESULTS.append({"case": c.name, "provider": c.provider, "dtype": str(c.dtype).removeprefix("torch."),
                    "ok": ok, "errors": errors or {}, "error": error, "tolerance": tol,
                    "seconds": round(seconds, 3), **(extra or {})})


def table_verdict(c: Case) -> str:
    """What the constraint table says about this case on the live machine (recorded, not asserted)."""
    from attn_dispatch import AttentionParams, EnvFlags, Platform
    from attn_dispatch.constraints import TABLES

    lq, lkv = _lengths(c) if (c.mask.startswith("padding") or c.fmt == "thd") else ([c.sq], [c.skv])
    shape = c.bias if c.bias != "no_bias" else None
    try:
        p = AttentionParams(
            dtype=c.dtype, qkv_format=c.fmt, batch_size=c.b, num_heads=c.h, num_gqa_groups=c.hkv,
            head_dim_qk=c.dqk, head_dim_v=c.dv, max_seqlen_q=max(lq), max_seqlen_kv=max(lkv), attn_mask_type=c.mask,
            window_size=tuple(c.window), bias_type="alibi" if c.alibi else ("post_scale_bias" if shape else "no_bias"),
            bias_shape=shape, bias_requires_grad=c.bias_grad,
            alibi_slopes_shape=("bh" if c.alibi == "bh" else "h") if c.alibi else None, dropout=c.dropout,
            softmax_type=c.softmax, deterministic=c.deterministic)
    except ValueError as exc:
        return f"unrepresentable: {exc}"
    v = TABLES[f"cudnn_fused:{c.provider}"].evaluate(p, Platform.detect(), EnvFlags.from_environ({}))
    return "eligible" if v.eligible else "rejected: " + "; ".join(r.code for r in v.reasons)


def run_and_assert(c: Case) -> None:
    start = time.perf_counter()
    verdict = table_verdict(c)
    try:
        errors = check(c)
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised for pytest
        record(c, None, f"{type(exc).__name__}: {str(exc)[:400]}", time.perf_counter() - start, {"table": verdict})
        raise
    record(c, errors, None, time.perf_counter() - start, {"table": verdict})
    tol = TOL[c.dtype]
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{c.name}: errors above {tol}: {bad} (all: {errors})"


# --------------------------------------------------------------------------------------------
# The cases: every feature the frontend engine implements, one or two at a time
# --------------------------------------------------------------------------------------------
FRONTEND_CASES = [
    Case("bshd"), Case("sbhd", fmt="sbhd"),
    Case("bshd_causal", mask="causal"), Case("sbhd_causal", fmt="sbhd", mask="causal"),
    Case("causal_cross_topleft", mask="causal", sq=128, skv=256),
    Case("causal_bottom_right", mask="causal_bottom_right", sq=128, skv=256),
    Case("causal_bottom_right_odd", mask="causal_bottom_right", sq=100, skv=173),
    Case("padding", mask="padding"), Case("padding_causal", mask="padding_causal"),
    Case("padding_causal_br", mask="padding_causal_bottom_right", sq=128, skv=192),
    Case("sbhd_padding_causal", fmt="sbhd", mask="padding_causal"),
    Case("thd_padding", fmt="thd", mask="padding"),
    Case("thd_padding_causal", fmt="thd", mask="padding_causal"),
    Case("thd_padding_causal_br", fmt="thd", mask="padding_causal_bottom_right", sq=96, skv=160),
    Case("thd_gqa", fmt="thd", mask="padding_causal", h=8, hkv=2),
    Case("thd_gaps", fmt="thd", mask="padding_causal", thd_gaps=True),
    Case("thd_dqk_ne_dv", fmt="thd", mask="padding", dqk=128, dv=64),
    Case("gqa", mask="causal", h=8, hkv=2), Case("mqa", h=8, hkv=1),
    Case("dqk128_dv64", dqk=128, dv=64), Case("dqk64_dv128", mask="causal", dqk=64, dv=128),
    Case("d128", mask="causal", dqk=128, dv=128), Case("d256", mask="causal", dqk=256, dv=256),
    Case("d256_bshd", dqk=256, dv=256, sq=256, skv=256),
    Case("seq_odd", sq=77, skv=201), Case("seq_1000_causal", mask="causal", sq=1000, skv=1000, b=1, h=2, hkv=2),
    Case("window_causal", mask="causal", window=(32, 0), sq=256, skv=256),
    Case("window_causal_br", mask="causal_bottom_right", window=(32, 0), sq=128, skv=256),
    Case("window_two_sided_padding", mask="padding", window=(16, 16), sq=192, skv=192),
    Case("window_padding_causal", mask="padding_causal", window=(24, 0)),
    Case("bias_1hss_grad", bias="1hss", bias_grad=True),
    Case("bias_1hss_grad_causal", mask="causal", bias="1hss", bias_grad=True),
    Case("bias_bhss", bias="bhss"), Case("bias_b1ss", bias="b1ss"), Case("bias_11ss", bias="11ss"),
    Case("alibi_builtin", mask="causal", alibi="default"),
    Case("alibi_slopes", mask="causal", alibi="h"),
    Case("alibi_slopes_nomask", alibi="h"),
    Case("alibi_slopes_bh_cross", mask="causal", alibi="bh", sq=128, skv=256),  # bottom-right: refused
    Case("dropout", dropout=0.1), Case("dropout_causal_gqa", mask="causal", dropout=0.2, h=8, hkv=2),
    Case("off_by_one", softmax="off-by-one"), Case("learnable_sink", mask="causal", softmax="learnable"),
    Case("deterministic", mask="causal", deterministic=True, h=8, hkv=2),
    Case("fp16", dtype=torch.float16), Case("fp16_causal", mask="causal", dtype=torch.float16),
    Case("fp16_thd", fmt="thd", mask="padding_causal", dtype=torch.float16),
    Case("fp16_bias_grad", bias="1hss", bias_grad=True, dtype=torch.float16),
    Case("fp16_gqa_window", mask="causal", window=(32, 0), h=8, hkv=4, dtype=torch.float16),
]
TORCH_CASES = [
    Case("torch_bshd", provider="torch"), Case("torch_causal", mask="causal", provider="torch"),
    Case("torch_sbhd_causal", fmt="sbhd", mask="causal", provider="torch"),
    Case("torch_gqa", mask="causal", h=8, hkv=2, provider="torch"),
    Case("torch_dqk_ne_dv", dqk=128, dv=64, provider="torch"),
    Case("torch_bias", bias="1hss", provider="torch"), Case("torch_bias_bhss", bias="bhss", provider="torch"),
    Case("torch_d256", mask="causal", dqk=256, dv=256, provider="torch"),
    Case("torch_cross", mask="causal", sq=128, skv=256, provider="torch"),
    Case("torch_fp16", mask="causal", dtype=torch.float16, provider="torch"),
]


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    _write_and_print(request.config)


@pytest.mark.parametrize("case", FRONTEND_CASES, ids=lambda c: c.name)
def test_frontend_against_reference(case):
    run_and_assert(case)


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.name)
def test_torch_provider_against_reference(case):
    run_and_assert(case)


def test_deterministic_backward_is_bitwise_repeatable():
    c = Case("deterministic_repeat", mask="causal", h=8, hkv=2, sq=512, skv=512, deterministic=True)
    grads = []
    for _ in range(2):
        q, k, v, aux, cfg = make_inputs(c, seed=3)
        out, _, _ = get("frontend")(q, k, v, aux, cfg)
        out.backward(torch.ones_like(out))
        grads.append([t.grad.clone() for t in (q, k, v)])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    record(c, {"bitwise_diff": 0.0 if same else 1.0}, None, 0.0)
    assert same


def test_dropout_mask_is_reused_in_backward_and_fresh_per_call():
    c = Case("dropout_rng", dropout=0.25)
    engine = get("frontend")
    q, k, v, aux, cfg = make_inputs(c, seed=5)
    torch.manual_seed(0)
    a, _, _ = engine(q, k, v, aux, cfg)
    b, _, _ = engine(q, k, v, aux, cfg)
    torch.manual_seed(0)
    a2, _, _ = engine(q, k, v, aux, cfg)
    differs, repeat = not torch.equal(a, b), torch.equal(a, a2)
    kept = aux.extra["cudnn_rng_dump"].mean().item()
    record(c, {"fresh_per_call": 0.0 if differs else 1.0, "seeded_repeat": 0.0 if repeat else 1.0,
               "keep_rate_error": abs(kept - 0.75)}, None, 0.0)
    assert differs and repeat and abs(kept - 0.75) < 0.02


def test_graph_cache_and_strided_views_without_copies():
    """A packed qkv tensor [b, s, 3, h, d] is consumed through strides; the second call reuses the graph."""
    engine = get("frontend")
    qkv = torch.randn(2, 128, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    cfg = AttnConfig(attn_mask_type="causal", softmax_scale=0.125)
    before = dict(engine.stats)
    out, lse, _ = engine(q, k, v, AttnAux(), cfg)
    out2, _, _ = engine(q, k, v, AttnAux(), cfg)
    built, hits = engine.stats["builds"] - before["builds"], engine.stats["hits"] - before["hits"]
    rq, rk, rv = (t.detach().cpu().double() for t in (q, k, v))
    ref, _ = reference_attention(rq, rk, rv, attn_mask_type="causal", softmax_scale=0.125)
    err = rel_err(out, ref)
    record(Case("packed_qkv_cache"), {"out": err}, None, 0.0, {"graph_builds": built, "cache_hits": hits})
    # two graphs: the forward, and the backward the first (grad-requiring) forward builds ahead
    assert err <= 2e-2 and torch.equal(out, out2) and built == 2 and hits >= 1


def test_raw_launch_matches_cudnn_frontends_own_execute():
    """The lean launch (data pointers straight to the backend) against cudnn-frontend's execute, bitwise:
    dense and ragged, forward and (deterministic) backward."""
    from attn_dispatch.backends.cudnn_fused import CudnnFrontendEngine

    ours, theirs = get("frontend"), CudnnFrontendEngine(execute_path="ordered")
    same, paths = {}, set()
    for c in (Case("raw_vs_ordered_bshd", mask="causal", h=8, hkv=2, deterministic=True),
              Case("raw_vs_ordered_thd", fmt="thd", mask="padding_causal", thd_gaps=True, deterministic=True)):
        results = []
        for engine in (ours, theirs, ours):  # ours twice: the second call takes the cached signature's path
            q, k, v, aux, cfg = make_inputs(c, seed=11)
            out, lse, _ = engine(q, k, v, aux, cfg)
            out.backward(torch.ones_like(out))
            results.append([out, lse, q.grad, k.grad, v.grad])
        same[c.name] = all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    paths = sorted({comp.path for comp in ours._graphs.values()})
    record(Case("raw_vs_ordered"), {n: 0.0 if ok else 1.0 for n, ok in same.items()}, None, 0.0,
           {"paths": paths, "plans": sorted({comp.plan for comp in ours._graphs.values()})})
    assert all(same.values()) and "raw" in paths and {comp.path for comp in theirs._graphs.values()} == {"ordered"}


REFUSED = [  # (case, what cuDNN says); the table must reject each (cudnn_fused.diagonal_band / backward_single_token)
    (Case("refused_br_alibi_bh", mask="causal_bottom_right", alibi="bh", sq=128, skv=256), "Bottom right causal"),
    (Case("refused_br_bias", mask="causal_bottom_right", bias="1hss", sq=128, skv=256), "Bottom right causal"),
    (Case("refused_br_dropout", mask="causal_bottom_right", dropout=0.1, sq=128, skv=256), "Bottom right causal"),
    (Case("refused_padding_br_bias", mask="padding_causal_bottom_right", bias="11ss", sq=128, skv=192),
     "Bottom right causal"),
    (Case("refused_single_token_bwd", sq=1, skv=1), ""),  # backward: 's_q = s_kv = 1 is not supported.'
]


@pytest.mark.parametrize("case, words", REFUSED, ids=[c.name for c, _ in REFUSED])
def test_cudnn_refuses_what_the_table_rejects(case, words):
    """The table's cuDNN-validation rules, held to cuDNN itself: the call raises CudnnGraphError from the forward
    (the backward graph is built ahead when inputs require grad) and the live table rejects the configuration."""
    from attn_dispatch.backends.cudnn_fused import CudnnGraphError

    verdict = table_verdict(case)
    error = None
    try:
        q, k, v, aux, cfg = make_inputs(case)
        get("frontend")(q, k, v, aux, cfg)
    except CudnnGraphError as exc:
        error = exc
    record(case, {"refused": 0.0 if error else 1.0}, None, 0.0,
           {"table": verdict, "cudnn_message": error.cudnn_message[:200] if error else None})
    assert error is not None and words in error.cudnn_message, error
    assert verdict.startswith("rejected") and ("diagonal_band" in verdict or "backward_single_token" in verdict)


def test_unsupported_graph_is_reported_not_crashed():
    """A backward cuDNN cannot build (head dim 264) raises CudnnGraphError carrying cuDNN's message; the table on
    the live platform then reports it (or already rejected it)."""
    from attn_dispatch import AttentionParams, EnvFlags, Platform
    from attn_dispatch.backends.cudnn_fused import CudnnGraphError
    from attn_dispatch.constraints import TABLES

    c = Case("unsupported_d264_bwd", dqk=264, dv=264)
    q, k, v, aux, cfg = make_inputs(c)
    engine = get("frontend")
    error = None
    try:
        out, _, _ = engine(q, k, v, aux, cfg)
        out.sum().backward()
    except CudnnGraphError as exc:
        error = exc
    p = AttentionParams(dtype="bf16", batch_size=2, num_heads=4, head_dim_qk=264, max_seqlen_q=128)
    verdict = TABLES["cudnn_fused:frontend"].evaluate(p, Platform.detect(), EnvFlags.from_environ({}))
    record(c, {"raised": 0.0 if error else 1.0}, None, 0.0,
           {"cudnn_message": error.cudnn_message[:300] if error else None,
            "table": [r.code for r in verdict.reasons]})
    assert error is not None and error.cudnn_message
    assert not verdict.eligible


def _write_and_print(config) -> None:
    if not RESULTS:
        return
    meta = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn_runtime": torch.backends.cudnn.version()}
    try:
        import cudnn

        meta["cudnn_frontend"] = cudnn.__version__
        meta["cudnn_backend"] = cudnn.backend_version_string()
    except Exception as exc:  # noqa: BLE001
        meta["cudnn_frontend"] = f"unavailable: {exc}"
    lines = [f"\ncuDNN GPU tests on {meta['device']} (torch {meta['torch']}, cuDNN FE {meta.get('cudnn_frontend')}, "
             f"backend {meta.get('cudnn_backend')})",
             f"{'case':32} {'prov':8} {'dtype':8} {'ok':3} {'max err':>9}  table / error"]
    for r in RESULTS:
        worst = max(r["errors"].values()) if r["errors"] else float("nan")
        note = r["error"] or r.get("table", "")
        lines.append(f"{r['case']:32} {r['provider']:8} {r['dtype']:8} {'yes' if r['ok'] else 'NO':3} "
                     f"{worst:9.2e}  {str(note)[:90]}")
    passed = sum(r["ok"] for r in RESULTS)
    lines.append(f"{passed} of {len(RESULTS)} cases within tolerance")
    write_and_print(config, RESULTS, meta, "cudnn_gpu_results.json", lines)
