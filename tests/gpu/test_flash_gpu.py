"""The FlashAttention engines on a GPU against the float64 reference (tests/reference.py): out, lse and the
gradients of q, k, v (and the learnable sink), bf16 (rel. error <= 2e-2) and fp16 (<= 3e-3).

Every engine installed on the machine runs every feature combination its constraint table declares supported
there, one test per combination; an engine that is not installed is skipped once, with the table's reason. The
combinations a table declares unsupported are run too and must be refused (an exception), never answered
wrongly. A summary is printed last and, when $OUT is set, written to $OUT/flash_gpu_results.json with the
machine, the library versions and flash-attn-4's JIT compile times.
Error metric: max |engine - reference| / max |reference| (floored at 0.1), as in tests/gpu/test_cudnn_gpu.py.
"""
from __future__ import annotations

import importlib.metadata
import math
import time
from dataclasses import replace

import pytest
import torch

from attn_dispatch import AttentionParams, EnvFlags, Platform
from attn_dispatch.backends import get_engine
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.constraints import TABLES
from gpu_common import TOL, Case, cu, layout_qkv, lse_error, padded, rel_err, write_and_print
from reference import reference_attention

pytestmark = pytest.mark.gpu
ENGINES = ("flash_attn_4:cute", "flash_attn_2:torch", "flash_attn_2:package", "flash_attn_3:interface")
INSTALL_TOPICS = ("environment", "platform", "package")
RESULTS: list[dict] = []
ENV = EnvFlags.from_environ({})


def lengths(c: Case) -> tuple[list[int], list[int]]:
    """Ragged per-sequence lengths for padding/thd; top-left masks keep q and kv lengths equal per sequence."""
    lq = [c.sq - 37 * (i % 2) for i in range(c.b)]
    lkv = lq if c.mask in ("causal", "padding_causal") else [c.skv - 21 * (i % 2) for i in range(c.b)]
    return lq, lkv


def params_of(c: Case) -> AttentionParams:
    lq, lkv = lengths(c) if padded(c) else ([c.sq], [c.skv])
    return AttentionParams(
        dtype=c.dtype, qkv_format=c.fmt, batch_size=c.b, num_heads=c.h, num_gqa_groups=c.hkv, head_dim_qk=c.dqk,
        head_dim_v=c.dv, max_seqlen_q=max(lq), max_seqlen_kv=max(lkv), attn_mask_type=c.mask,
        window_size=tuple(c.window), bias_type="alibi" if c.alibi else "no_bias",
        alibi_slopes_shape=c.alibi, dropout=c.dropout, softmax_type=c.softmax, deterministic=c.deterministic,
        is_training=c.train, pad_between_seqs=c.thd_gaps)


def make_inputs(c: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", c.dtype)

    lq, lkv = lengths(c) if padded(c) else ([c.sq] * c.b, [c.skv] * c.b)
    q, k, v, offsets = layout_qkv(c, lq, lkv, rnd)
    aux = AttnAux(max_seqlen_q=max(lq), max_seqlen_kv=max(lkv), **offsets)
    if c.alibi:
        shape = (c.h,) if c.alibi == "h" else (c.b, c.h)
        aux.alibi_slopes = (torch.rand(*shape, generator=g) * 0.3 + 0.02).cuda()
    if c.softmax == "learnable":
        aux.softmax_offset = torch.randn(c.h, generator=g).cuda().requires_grad_(c.train)
    for t in (q, k, v):
        t.requires_grad_(c.train)
    cfg = AttnConfig(qkv_format=c.fmt, attn_mask_type=c.mask, window_size=params_of(c).window_size,
                     softmax_scale=1.0 / math.sqrt(c.dqk), dropout_p=c.dropout,
                     bias_type="alibi" if c.alibi else "no_bias", softmax_type=c.softmax,
                     deterministic=c.deterministic)
    return q, k, v, aux, cfg


def run_reference(q, k, v, aux: AttnAux, cfg: AttnConfig, keep=None):
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    rq, rk, rv = (t.detach().cpu().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    sink = None if aux.softmax_offset is None else aux.softmax_offset.detach().cpu().double().requires_grad_(
        aux.softmax_offset.requires_grad)
    out, lse = reference_attention(
        rq, rk, rv, qkv_format=cfg.qkv_format, attn_mask_type=cfg.attn_mask_type, window_size=cfg.window_size,
        cu_seqlens_q=cpu(aux.cu_seqlens_q), cu_seqlens_kv=cpu(aux.cu_seqlens_kv),
        cu_seqlens_q_padded=cpu(aux.cu_seqlens_q_padded), cu_seqlens_kv_padded=cpu(aux.cu_seqlens_kv_padded),
        bias_type=cfg.bias_type, alibi_slopes=cpu(aux.alibi_slopes), softmax_type=cfg.softmax_type,
        softmax_offset=sink, softmax_scale=cfg.softmax_scale, dropout_p=cfg.dropout_p, dropout_keep=keep)
    return out, lse, (rq, rk, rv, sink)


def compare(out, lse, ref_out, ref_lse) -> dict[str, float]:
    return {"out": rel_err(out, ref_out), "lse": lse_error(lse, ref_lse)}


def check(provider: str, c: Case, seed: int = 0) -> dict[str, float]:
    engine = get_engine(provider)
    q, k, v, aux, cfg = make_inputs(c, seed)
    out, lse, _ = engine(q, k, v, aux, cfg)
    ref_out, ref_lse, (rq, rk, rv, rsink) = run_reference(q, k, v, aux, cfg)
    errors = compare(out, lse, ref_out, ref_lse)
    if c.train:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to("cuda", out.dtype)
        out.backward(dout)
        ref_out.backward(dout.cpu().double())
        for name, mine, ref in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
            errors[name] = rel_err(mine.grad, ref.grad)
        if rsink is not None:
            grad = aux.softmax_offset.grad
            errors["dsink"] = rel_err(grad, rsink.grad) if grad is not None else math.inf
    torch.cuda.synchronize()
    return errors


def record(provider: str, case: str, dtype, errors: dict | None, error: str | None, seconds: float,
           **extra) -> bool:
    tol = TOL.get(dtype, 2e-2)
    ok = error is None and errors is not None and all(e <= tol for e in errors.values())
    RESULTS.append({"provider": provider, "case": case, "dtype": str(dtype).removeprefix("torch."), "ok": ok,
                    "errors": errors or {}, "error": error, "tolerance": tol, "seconds": round(seconds, 3), **extra})
    return ok


# --------------------------------------------------------------------------------------------------------------
# What is installed, and which combinations each table declares supported on this machine
# --------------------------------------------------------------------------------------------------------------
def _platform() -> Platform:
    return Platform.detect()


def install_reasons(provider: str) -> list[str]:
    """The table's reasons on the platform/package topics (the load check excluded: a broken import must fail)."""
    table = TABLES[provider]
    topics = {c.code: c.topic for c in table.checks}
    verdict = table.evaluate(params_of(Case("probe")), _platform(), ENV)
    return [f"[{r.code}] {r.message}" for r in verdict.reasons
            if topics.get(r.code) in INSTALL_TOPICS and not r.code.endswith("_loads")]


def declared(provider: str, c: Case) -> tuple[bool, list[str]]:
    verdict = TABLES[provider].evaluate(params_of(c), _platform(), ENV)
    return verdict.eligible, [r.code for r in verdict.reasons]


F16 = torch.float16
CASES = [
    Case("bshd"), Case("sbhd", fmt="sbhd"),
    Case("bshd_causal", mask="causal"), Case("sbhd_causal", fmt="sbhd", mask="causal"),
    Case("causal_br_cross", mask="causal_bottom_right", sq=128, skv=256),
    Case("causal_br_empty_rows", mask="causal_bottom_right", sq=256, skv=128),
    Case("causal_br_odd", mask="causal_bottom_right", sq=100, skv=173),
    Case("causal_topleft_cross", mask="causal", sq=128, skv=256),          # declared unsupported: must be refused
    Case("no_mask_cross_odd", sq=77, skv=201),
    Case("padding", mask="padding"), Case("padding_causal", mask="padding_causal"),
    Case("padding_causal_br", mask="padding_causal_bottom_right", sq=128, skv=192),
    Case("sbhd_padding_causal", fmt="sbhd", mask="padding_causal"),
    Case("thd_padding", fmt="thd", mask="padding"),
    Case("thd_padding_causal", fmt="thd", mask="padding_causal"),
    Case("thd_padding_causal_br", fmt="thd", mask="padding_causal_bottom_right", sq=96, skv=160),
    Case("thd_gqa", fmt="thd", mask="padding_causal", h=8, hkv=2),
    Case("thd_gaps", fmt="thd", mask="padding", thd_gaps=True),              # declared unsupported
    Case("gqa", mask="causal", h=8, hkv=2), Case("mqa", h=8, hkv=1),
    Case("d128_causal", mask="causal", dqk=128, dv=128), Case("d96", dqk=96, dv=96),
    Case("d256_causal", mask="causal", dqk=256, dv=256, sq=256, skv=256),
    Case("dqk192_dv128", mask="causal", dqk=192, dv=128), Case("dqk128_dv64", dqk=128, dv=64),
    Case("dqk64_dv128", mask="causal_bottom_right", dqk=64, dv=128, sq=96, skv=160),  # sm90: backward too big
    Case("dqk64_dv128_inference", mask="causal_bottom_right", dqk=64, dv=128, sq=96, skv=160, train=False),
    Case("dqk128_dv192_causal", mask="causal", dqk=128, dv=192),   # sm90 backward: 231424 of 232448 bytes
    Case("dqk128_dv256", dqk=128, dv=256),                         # sm90: backward too big
    Case("dqk128_dv256_inference", dqk=128, dv=256, train=False),
    Case("dqk256_dv128", dqk=256, dv=128),
    Case("gqa_dqk128_dv64", h=8, hkv=2, dqk=128, dv=64),          # sm90: GQA backward needs equal head dims
    Case("d72", dqk=72, dv=72),                                    # sm90: dQ padding mismatch, refused
    Case("d72_inference", dqk=72, dv=72, train=False),
    Case("seq_1000_causal", mask="causal", sq=1000, skv=1000, b=1, h=2, hkv=2),
    Case("window_causal", mask="causal", window=(32, 0), sq=256, skv=256),
    Case("window_causal_br_cross", mask="causal_bottom_right", window=(32, 0), sq=128, skv=256),
    Case("window_two_sided", window=(16, 16), sq=192, skv=192),
    Case("window_two_sided_cross", window=(16, 8), sq=96, skv=160),
    Case("window_padding", mask="padding", window=(16, 16), sq=192, skv=192),
    Case("thd_window_causal_br", fmt="thd", mask="padding_causal_bottom_right", window=(24, 0), sq=96, skv=160),
    Case("alibi_causal", mask="causal", alibi="h"),
    Case("alibi_bh_br_cross", mask="causal_bottom_right", alibi="bh", sq=128, skv=256),
    Case("alibi_inference", alibi="h", train=False),
    Case("thd_alibi", fmt="thd", mask="padding_causal", alibi="bh"),
    Case("off_by_one", softmax="off-by-one"),
    Case("learnable_sink_causal", mask="causal", softmax="learnable"),
    Case("learnable_sink_br_empty_rows", mask="causal_bottom_right", softmax="learnable", sq=192, skv=128),
    Case("thd_learnable_sink", fmt="thd", mask="padding_causal_bottom_right", softmax="learnable", sq=96, skv=160),
    Case("deterministic_gqa", mask="causal", deterministic=True, h=8, hkv=2),
    Case("inference", mask="causal", train=False),
    Case("dropout_refused_where_absent", dropout=0.1),                       # dropout itself: its own test
    Case("fp16", dtype=F16), Case("fp16_causal", mask="causal", dtype=F16),
    Case("fp16_thd", fmt="thd", mask="padding_causal", dtype=F16),
    Case("fp16_gqa_window", mask="causal", window=(32, 0), h=8, hkv=4, dtype=F16),
]


def _installed() -> list[str]:
    return [p for p in ENGINES if not install_reasons(p)]


def _pairs(supported: bool) -> list[tuple[str, Case]]:
    pairs = []
    for provider in _installed():
        for c in CASES:
            if c.dropout and supported:
                continue  # dropout runs in test_dropout_against_reference (it needs the engine's mask)
            if declared(provider, c)[0] == supported:
                pairs.append((provider, c))
    return pairs


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    _write_and_print(request.config)


@pytest.mark.parametrize("provider", ENGINES)
def test_engine_loads_where_installed(provider):
    reasons = install_reasons(provider)
    if reasons:
        record(provider, "installed", None, None, "not installed: " + "; ".join(reasons), 0.0, skipped=True)
        pytest.skip(f"{provider} is not installed here: " + "; ".join(reasons))
    start = time.perf_counter()
    get_engine(provider)  # an installed engine must load: EngineUnavailableError fails the test
    record(provider, "loads", None, {"load": 0.0}, None, time.perf_counter() - start)


@pytest.mark.parametrize("provider, case", _pairs(True), ids=lambda x: x if isinstance(x, str) else x.name)
def test_against_reference(provider, case):
    start = time.perf_counter()
    try:
        errors = check(provider, case)
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised for pytest
        record(provider, case.name, case.dtype, None, f"{type(exc).__name__}: {str(exc)[:500]}",
               time.perf_counter() - start)
        raise
    ok = record(provider, case.name, case.dtype, errors, None, time.perf_counter() - start)
    assert ok, f"{provider} {case.name}: errors above {TOL[case.dtype]}: {errors}"


@pytest.mark.parametrize("provider, case", _pairs(False), ids=lambda x: x if isinstance(x, str) else x.name)
def test_declared_unsupported_is_refused(provider, case):
    """A combination the table rejects must raise when the engine is called anyway, never answer wrongly."""
    _, reasons = declared(provider, case)
    start = time.perf_counter()
    try:
        errors = check(provider, case)
    except Exception as exc:  # noqa: BLE001 - refusing is the expected outcome
        record(provider, case.name, case.dtype, {"refused": 0.0}, None, time.perf_counter() - start,
               declared_unsupported=reasons, refusal=f"{type(exc).__name__}: {str(exc)[:300]}")
        return
    ok = record(provider, case.name, case.dtype, errors, None, time.perf_counter() - start,
                declared_unsupported=reasons, ran_anyway=True)
    # Ran and matched: the table may be too strict (recorded as 'ran_anyway'); ran and wrong: a silent failure.
    assert ok, f"{provider} {case.name} (declared unsupported: {reasons}) ran and answered wrongly: {errors}"


# --------------------------------------------------------------------------------------------------------------
# Dropout, determinism, the global lse, JIT
# --------------------------------------------------------------------------------------------------------------
DROPOUT_CASES = [Case("dropout", dropout=0.1, sq=64, skv=64, dqk=128, dv=128),
                 Case("dropout_causal_gqa", mask="causal", dropout=0.2, sq=64, skv=64, dqk=128, dv=128, h=8, hkv=2)]


def _with_identity_values(v: torch.Tensor, skv: int) -> torch.Tensor:
    """v[..., :skv] = identity per key: the output's first skv columns are then the dropped-out probabilities."""
    v = v.detach().clone()
    v[..., :skv] = torch.eye(skv, device=v.device, dtype=v.dtype)[None, :, None, :]
    return v.requires_grad_()


@pytest.mark.parametrize("provider", ENGINES)
def test_dropout_against_reference(provider):
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    for c in DROPOUT_CASES:
        if not declared(provider, c)[0]:
            record(provider, c.name, c.dtype, {"declared_unsupported": 0.0}, None, 0.0, dropout="no dropout")
            continue
        start = time.perf_counter()
        q, k, v, aux, cfg = make_inputs(c, seed=11)
        v = _with_identity_values(v, c.skv)
        torch.manual_seed(1234)
        out, lse, _ = get_engine(provider)(q, k, v, aux, cfg)
        probs = out[..., :c.skv].detach().float().permute(0, 2, 1, 3)          # [b, h, sq, skv]
        keep = (probs != 0).cpu()
        ref_out, ref_lse, (rq, rk, rv, _) = run_reference(q, k, v, aux, cfg, keep=keep)
        errors = compare(out, lse, ref_out, ref_lse)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to("cuda", out.dtype)
        out.backward(dout)
        ref_out.backward(dout.cpu().double())
        for name, mine, ref in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
            errors[name] = rel_err(mine.grad, ref.grad)
        kept = keep[_allowed(c).expand_as(keep)].float().mean().item()  # among the entries the mask lets through
        errors["keep_rate"] = abs(kept - (1 - c.dropout))
        torch.manual_seed(1234)
        again, _, _ = get_engine(provider)(q, k, v, aux, cfg)
        other, _, _ = get_engine(provider)(q, k, v, aux, cfg)
        errors["seeded_repeat"] = 0.0 if torch.equal(out, again) else 1.0
        errors["fresh_per_call"] = 0.0 if not torch.equal(again, other) else 1.0
        ok = record(provider, c.name, c.dtype, errors, None, time.perf_counter() - start)
        assert ok, f"{provider} {c.name}: {errors}"


def _allowed(c: Case) -> torch.Tensor:
    i, j = torch.arange(c.sq)[:, None], torch.arange(c.skv)[None, :]
    return ((j <= i) if "causal" in c.mask else torch.ones(c.sq, c.skv, dtype=torch.bool))[None, None]


@pytest.mark.parametrize("provider", ENGINES)
def test_deterministic_backward_is_bitwise_repeatable(provider):
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    c = Case("deterministic_repeat", mask="causal", h=8, hkv=2, sq=512, skv=512, deterministic=True)
    if not declared(provider, c)[0]:
        record(provider, c.name, c.dtype, {"declared_unsupported": 0.0}, None, 0.0)
        return
    grads = []
    for _ in range(2):
        q, k, v, aux, cfg = make_inputs(c, seed=3)
        out, _, _ = get_engine(provider)(q, k, v, aux, cfg)
        out.backward(torch.ones_like(out))
        grads.append([t.grad.clone() for t in (q, k, v)])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    record(provider, c.name, c.dtype, {"bitwise_diff": 0.0 if same else 1.0}, None, 0.0)
    assert same


@pytest.mark.parametrize("provider", ENGINES)
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_backward_takes_the_global_out_and_lse(provider, fmt):
    """Context parallelism's contract: forward per key block, merge (out, lse), backward per block with the merged
    pair; dq summed over blocks and dk/dv per block equal the gradients of whole attention."""
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    c = Case(f"global_lse_{fmt}", fmt=fmt, mask="padding" if fmt == "thd" else "no_mask", sq=128, skv=256,
             h=8, hkv=2, b=2)
    if not declared(provider, c)[0]:
        record(provider, c.name, c.dtype, {"declared_unsupported": 0.0}, None, 0.0)
        return
    engine = get_engine(provider)
    q, k, v, aux, cfg = make_inputs(c, seed=21)
    if fmt == "thd":  # split every sequence's keys in two: block j holds the j-th half of each sequence
        lkv = aux.cu_seqlens_kv.diff().tolist()
        starts = aux.cu_seqlens_kv[:-1].tolist()
        halves = [[(s, n // 2) for s, n in zip(starts, lkv)], [(s + n // 2, n - n // 2) for s, n in zip(starts, lkv)]]
        blocks = []
        for part in halves:
            index = torch.cat([torch.arange(s, s + n) for s, n in part]).cuda()
            block_aux = replace(aux, cu_seqlens_kv=cu([n for _, n in part]), max_seqlen_kv=max(n for _, n in part))
            blocks.append((index, block_aux))
        kv_of = lambda t, index: t.detach()[index]  # noqa: E731
    else:
        blocks = [(torch.arange(0, 128, device="cuda"), aux), (torch.arange(128, 256, device="cuda"), aux)]
        kv_of = lambda t, index: t.detach()[:, index]  # noqa: E731
    parts = [engine.forward(q.detach(), kv_of(k, i), kv_of(v, i), a, cfg) for i, a in blocks]
    lse = torch.logaddexp(parts[0].lse, parts[1].lse)
    weight = lambda p: torch.exp(p.lse - lse).nan_to_num(0.0)  # noqa: E731
    if fmt == "thd":
        out = sum(p.out * weight(p).t()[..., None] for p in parts)
    else:
        out = sum(p.out * weight(p).transpose(1, 2)[..., None] for p in parts)
    out = out.to(q.dtype)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to("cuda", out.dtype)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for (index, block_aux), part in zip(blocks, parts):
        g = engine.backward(dout, q.detach(), kv_of(k, index), kv_of(v, index), out, lse, part.state, block_aux, cfg)
        dq += g.dq.float()
        if fmt == "thd":
            dk[index], dv[index] = g.dk.float(), g.dv.float()
        else:
            dk[:, index], dv[:, index] = g.dk.float(), g.dv.float()
    ref_out, ref_lse, (rq, rk, rv, _) = run_reference(q, k, v, aux, cfg)
    ref_out.backward(dout.cpu().double())
    errors = compare(out, lse, ref_out, ref_lse)
    errors.update(dq=rel_err(dq, rq.grad), dk=rel_err(dk, rk.grad), dv=rel_err(dv, rv.grad))
    ok = record(provider, c.name, c.dtype, errors, None, 0.0)
    assert ok, f"{provider} {c.name}: {errors}"


def test_flash_attn_4_jit_is_measured_and_cached():
    provider = "flash_attn_4:cute"
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    engine = get_engine(provider)
    c = Case("jit_probe", mask="causal", dqk=128, dv=128, h=8, hkv=8, sq=512, skv=512)
    q, k, v, aux, cfg = make_inputs(c, seed=9)
    before = len(engine.jit_events)
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        out, _, _ = engine(q, k, v, aux, cfg)
        out.sum().backward()
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    compiled_now = engine.jit_events[before:]
    events = engine.jit_events
    summary = {"events": len(events), "total_s": round(sum(e["seconds"] for e in events), 2),
               "max_s": round(max((e["seconds"] for e in events), default=0.0), 2),
               "second_call_s": round(timings[1], 4), "first_call_s": round(timings[0], 2),
               "compiled_on_first_call": len(compiled_now)}
    RESULTS.append({"provider": provider, "case": "jit", "ok": True, "errors": {}, "error": None, "jit": summary,
                    "jit_events": events, "dtype": "bfloat16", "tolerance": None, "seconds": 0.0})
    # every earlier flash-attn-4 test compiled kernels; a configuration compiled once costs nothing the second time
    assert events and all(e["seconds"] > 0 for e in events)
    assert timings[1] < 1.0


REPLAY_CASES = [Case("replay_d128", dqk=128, dv=128, h=8, hkv=8, sq=512, skv=512, train=False),
                Case("replay_gqa_causal", mask="causal", dqk=64, dv=64, h=8, hkv=2, sq=384, skv=384),
                Case("replay_window_sbhd", fmt="sbhd", mask="causal", window=(128, 0), dqk=128, dv=128, sq=640,
                     skv=640),
                Case("replay_sq_ne_skv", dqk=128, dv=128, sq=256, skv=768, train=False)]


@pytest.mark.parametrize("c", REPLAY_CASES, ids=lambda c: c.name)
def test_flash_attn_4_replay_is_used_and_matches_the_interface(c, monkeypatch):
    """Repeat calls of one signature replay the compiled launches (backends/_fa4_replay.py): each call against the
    float64 reference (gradients too in training: the backward replayed as well), the replay checked and used, the
    forward bit for bit what the interface gives on the same inputs, and capturable in a CUDA graph."""
    provider = "flash_attn_4:cute"
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    from attn_dispatch.backends._fa4_replay import ENV_SWITCH

    monkeypatch.setenv(ENV_SWITCH, "1")  # the default, whatever the environment set
    engine = get_engine(provider)
    engine.__dict__.pop("_replays_by_kind", None)  # made again, reading the switch
    replays = engine._replays("fwd")
    assert replays.enabled
    for seed in range(4):
        errors = check(provider, c, seed=seed)
        assert all(e <= TOL[c.dtype] for e in errors.values()), errors
    checked = [r for r in replays.entries.values() if r is not None and r.checked]
    assert checked, "no signature of these calls was replayed"
    if c.train:
        backward = engine._replays("bwd").entries.values()
        assert any(r is not None and r.checked for r in backward), "no backward was replayed"
    q, k, v, aux, cfg = make_inputs(replace(c, train=False), seed=11)
    with torch.no_grad():
        for _ in range(2):  # an inference signature: recorded, then checked
            engine(q, k, v, aux, cfg)
        replayed = engine(q, k, v, aux, cfg)[0]
        before = dict(replays.entries)
        replays.enabled = False
        try:
            direct = engine(q, k, v, aux, cfg)[0]
        finally:
            replays.enabled = True
        assert replays.entries == before
        assert torch.equal(replayed, direct)
        static = [t.clone() for t in (q, k, v)]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            engine(*static, aux, cfg)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = engine(*static, aux, cfg)[0]
        for t, src in zip(static, make_inputs(replace(c, train=False), seed=12)[:3]):
            t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, engine(*static, aux, cfg)[0])


# (head_dim_qk, head_dim_v, causal, phase): pairs on both sides of the sm90 limits flash_attn_4_sm90 derives
# (shared memory: forward and backward; backward layouts: the dO swizzle, the swapped dK/dV M axis). The kernels
# are launched directly (the engine refuses what the model rejects), with random out/lse for the backward: only
# whether the launch goes through is checked. Forward pairs whose output tile would overrun sQ's storage are not
# launched (an out-of-bounds shared-memory write could break the CUDA context for the tests after it).
SM90_PAIRS = [(128, 192, True, "bwd"), (128, 192, False, "bwd"), (96, 192, False, "bwd"), (160, 256, False, "bwd"),
              (256, 192, False, "bwd"), (128, 80, False, "bwd"), (96, 144, False, "fwd"), (96, 160, False, "fwd"),
              (192, 256, False, "fwd")]


def _launch(iface, d: int, dv: int, causal: bool, phase: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(d * 1000 + dv)
    q, k = (torch.randn(1, 128, 2, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v, out, dout = (torch.randn(1, 128, 2, dv, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    if phase == "fwd":
        iface._flash_attn_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, return_lse=True)
    else:
        lse = torch.randn(1, 2, 128, device="cuda", generator=g) + 5.0
        iface._flash_attn_bwd(q, k, v, out, dout, lse, d ** -0.5, causal)
    torch.cuda.synchronize()


def test_flash_attn_4_sm90_limits_match_the_kernels():
    """attn_dispatch.constraints.flash_attn_4_sm90 predicts which head-dim pairs launch; the kernels must agree."""
    from attn_dispatch.constraints import flash_attn_4_sm90 as sm90

    provider = "flash_attn_4:cute"
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the model covers the sm90 kernels")
    iface = get_engine(provider)._iface
    disagreements = []
    for d, dv, causal, phase in SM90_PAIRS:
        window = (-1, 0) if causal else (-1, -1)
        if phase == "fwd":
            problem = sm90.forward_problem(d, dv, window)
            need = sm90.fwd_footprint(d, dv, causal, False).total
        else:
            problem = sm90.backward_problem(d, dv, window, 1)
            need = sm90.bwd_smem_bytes(d, dv, causal)
        start = time.perf_counter()
        try:
            _launch(iface, d, dv, causal, phase)
            outcome, error = "launched", None
        except Exception as exc:  # noqa: BLE001 - the outcome is the datum
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            smem = any(w in str(exc) for w in ("shared memory", "LAUNCH_INVALID_CONFIG", "cudaErrorInvalidValue"))
            outcome = "smem_launch_failure" if smem else "other_failure"
        agrees = (outcome == "launched") == (problem is None)
        if not agrees:
            disagreements.append((d, dv, causal, phase, need, outcome, error))
        RESULTS.append({"provider": provider, "case": f"sm90_{phase}_{d}_{dv}{'_causal' if causal else ''}",
                        "dtype": "bfloat16", "ok": agrees, "errors": {}, "error": error, "tolerance": None,
                        "seconds": round(time.perf_counter() - start, 3), "model_smem_bytes": need,
                        "model_problem": problem[0] if problem else None, "outcome": outcome})
    assert not disagreements, f"the sm90 model disagrees with the kernels: {disagreements}"


def test_flash_attn_4_sm90_dq_padding_model_matches_the_kernels():
    """flash_attn_4_sm90.dq_accumulator_mismatch names the head dims whose sm90 backward returns a wrong dQ
    (kernel tile padded to 16, dQ accumulator to 32); flash_attn_func itself, not the engine (which refuses them),
    is compared with the float64 reference, one case each side of the rule."""
    from attn_dispatch.constraints import flash_attn_4_sm90 as sm90

    provider = "flash_attn_4:cute"
    if install_reasons(provider):
        pytest.skip(f"{provider} is not installed here")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the rule covers the sm90 backward")
    from flash_attn.cute import flash_attn_func

    disagreements = []
    for d in (40, 72, 96):
        c = Case(f"sm90_dq_padding_{d}", dqk=d, dv=d, b=1, h=2, hkv=2, sq=256, skv=256)
        start = time.perf_counter()
        q, k, v, aux, cfg = make_inputs(c, seed=d)
        out = flash_attn_func(q, k, v, softmax_scale=cfg.softmax_scale)[0]
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(d)).to("cuda", out.dtype)
        out.backward(dout)
        ref_out, _, (rq, rk, rv, _) = run_reference(q, k, v, aux, cfg)
        ref_out.backward(dout.cpu().double())
        errors = {"out": rel_err(out, ref_out), "dq": rel_err(q.grad, rq.grad), "dk": rel_err(k.grad, rk.grad),
                  "dv": rel_err(v.grad, rv.grad)}
        dq_wrong = errors["dq"] > TOL[c.dtype]
        others_right = all(errors[n] <= TOL[c.dtype] for n in ("out", "dk", "dv"))
        agrees = dq_wrong == sm90.dq_accumulator_mismatch(d) and others_right
        if not agrees:
            disagreements.append((d, errors))
        RESULTS.append({"provider": provider, "case": c.name, "dtype": "bfloat16", "ok": agrees, "errors": errors,
                        "error": None, "tolerance": TOL[c.dtype], "seconds": round(time.perf_counter() - start, 3),
                        "model_dq_wrong": sm90.dq_accumulator_mismatch(d), "dq_wrong": dq_wrong})
    assert not disagreements, f"the sm90 dQ padding rule disagrees with the kernels: {disagreements}"


# --------------------------------------------------------------------------------------------------------------
def _versions() -> dict:
    meta = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "flash-attn", "flash-attn-3", "quack-kernels",
                 "apache-tvm-ffi"):
        try:
            meta[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            meta[dist] = None
    meta["installed_engines"] = _installed()
    meta["not_installed"] = {p: install_reasons(p) for p in ENGINES if install_reasons(p)}
    return meta


def _write_and_print(config) -> None:
    if not RESULTS or not torch.cuda.is_available():
        return
    meta = _versions()
    lines = [f"\nFlashAttention GPU tests on {meta['device']} (torch {meta['torch']}, flash-attn-4 "
             f"{meta['flash-attn-4']}, cutlass-dsl {meta['nvidia-cutlass-dsl']})",
             f"{'provider':24} {'case':32} {'dtype':9} {'ok':3} {'max err':>9}  note"]
    for r in RESULTS:
        worst = max(r["errors"].values()) if r["errors"] else float("nan")
        note = r.get("error") or r.get("refusal") or ("ran anyway" if r.get("ran_anyway") else "")
        if r.get("jit"):
            note = f"JIT {r['jit']}"
        lines.append(f"{r['provider']:24} {r['case']:32} {r['dtype']:9} {'yes' if r['ok'] else 'NO':3} "
                     f"{worst:9.2e}  {str(note)[:100]}")
    checked = [r for r in RESULTS if not r.get("skipped")]
    lines.append(f"{sum(r['ok'] for r in checked)} of {len(checked)} checks passed")
    write_and_print(config, RESULTS, meta, "flash_gpu_results.json", lines)
