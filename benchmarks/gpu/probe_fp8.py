"""What cuDNN's per-tensor FP8 SDPA graphs accept on this machine, how accurate they are, how fast.

Run on the GPU machine with cudnn-frontend on the path (bundle a). For each configuration it builds the
forward (and, for training rows, backward) FP8 graph straight through cudnn-frontend, runs it on random data
quantized with per-tensor scales, and compares with a float32 reference computed on the dequantized FP8
inputs (the kernel's own error) and on the original bf16 inputs (the end-to-end error). The timing rows put the
FP8 forward (and fwd+bwd) kernels beside the bf16 cuDNN graphs of the same shape. Prints a table last and
writes JSON to $OUT/probe_fp8.json.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def cudnn_dtype(cudnn, dt):
    d = cudnn.data_type
    return {torch.bfloat16: d.BFLOAT16, torch.float16: d.HALF, E4M3: d.FP8_E4M3, E5M2: d.FP8_E5M2,
            torch.float32: d.FLOAT}[dt]


def quantize(x: torch.Tensor, dtype: torch.dtype, margin_amax: float | None = None):
    amax = x.abs().amax().float() if margin_amax is None else torch.tensor(margin_amax, device=x.device)
    scale = FP8_MAX[dtype] / amax.clamp(min=1e-12)
    return (x.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype), scale.reshape(1, 1, 1, 1), \
        (1.0 / scale).reshape(1, 1, 1, 1)


def reference(q, k, v, scale, causal, lens=None, bottom_right=False):
    """float32 attention on [b, s, h, d] inputs (GQA by repeat); lens: (lens_q, lens_kv) padding."""
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    mask = torch.zeros(b, 1, sq, skv, dtype=torch.bool, device=q.device)
    if causal:
        off = skv - sq if bottom_right else 0
        mask |= torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1 + off)
    if lens is not None:
        lq, lk = lens
        mask |= (torch.arange(skv, device=q.device).view(1, 1, 1, skv) >= lk.view(b, 1, 1, 1))
        rows = torch.arange(sq, device=q.device).view(1, 1, sq, 1) >= lq.view(b, 1, 1, 1)
        mask |= rows
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v).transpose(1, 2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


class Case:
    def __init__(self, name, b=2, h=8, hkv=8, sq=512, skv=None, d=128, dv=None, causal=True, bottom_right=False,
                 padding=False, ragged=False, train=True, o_dtype=E4M3, do_dtype=E5M2, dqkv_dtype=E5M2,
                 deterministic=False, layout="bshd", bwd_o_dtype=None):
        self.name, self.b, self.h, self.hkv, self.sq = name, b, h, hkv, sq
        self.skv = sq if skv is None else skv
        self.d, self.dv = d, d if dv is None else dv
        self.causal, self.bottom_right, self.padding, self.ragged = causal, bottom_right, padding, ragged
        self.train, self.o_dtype, self.do_dtype, self.dqkv_dtype = train, o_dtype, do_dtype, dqkv_dtype
        self.deterministic, self.layout = deterministic, layout
        self.bwd_o_dtype = o_dtype if bwd_o_dtype is None else bwd_o_dtype


def strides_bhsd(x: torch.Tensor, layout: str):
    """[b, h, s, d] dims and strides of a bshd / sbhd tensor."""
    if layout == "bshd":
        v = x.permute(0, 2, 1, 3)
    else:
        v = x.permute(1, 2, 0, 3)
    return list(v.shape), list(v.stride())


def alloc(shape_bshd, dtype, layout, device="cuda"):
    b, s, h, d = shape_bshd
    if layout == "bshd":
        return torch.empty(b, s, h, d, dtype=dtype, device=device)
    return torch.empty(s, b, h, d, dtype=dtype, device=device).transpose(0, 1)  # a bshd view of sbhd memory


def build(cudnn, handle, graph):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def run_case(cudnn, handle, c: Case, check=True):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(hash(c.name) % 2**31)
    qb = torch.randn(c.b, c.sq, c.h, c.d, device=dev, generator=g).to(torch.bfloat16)
    kb = torch.randn(c.b, c.skv, c.hkv, c.d, device=dev, generator=g).to(torch.bfloat16)
    vb = torch.randn(c.b, c.skv, c.hkv, c.dv, device=dev, generator=g).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(c.d)
    q8, q_s, q_ds = quantize(qb, E4M3)
    k8, k_s, k_ds = quantize(kb, E4M3)
    v8, v_s, v_ds = quantize(vb, E4M3)
    if c.layout == "sbhd":
        q8 = alloc(q8.shape, E4M3, "sbhd").copy_(q8)
        k8 = alloc(k8.shape, E4M3, "sbhd").copy_(k8)
        v8 = alloc(v8.shape, E4M3, "sbhd").copy_(v8)
    lens = None
    if c.padding or c.ragged:
        lq = torch.randint(c.sq // 2, c.sq + 1, (c.b,), device=dev, generator=g, dtype=torch.int32)
        lq[0] = c.sq
        lk = lq.clone() if c.sq == c.skv else torch.randint(c.skv // 2, c.skv + 1, (c.b,), device=dev,
                                                              generator=g, dtype=torch.int32)
        lens = (lq, lk)
    ones = lambda x: torch.ones(1, 1, 1, 1, device=dev, dtype=torch.float32) * x  # noqa: E731
    s_scale, s_descale = ones(FP8_MAX[E4M3]), ones(1.0 / FP8_MAX[E4M3])
    if check:
        o_ref_deq = reference(q8.float() * q_ds.view(1), k8.float() * k_ds.view(1), v8.float() * v_ds.view(1),
                              scale, c.causal, lens, c.bottom_right)
        o_ref_bf16 = reference(qb, kb, vb, scale, c.causal, lens, c.bottom_right)
        o_amax = float(o_ref_deq.abs().max())
    else:
        o_amax = 4.0
    o_scale = ones(FP8_MAX[c.o_dtype] / o_amax) if c.o_dtype in FP8_MAX else ones(1.0)
    o_descale = 1.0 / o_scale

    f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    G = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    T = {}

    def tensor(name, x=None, dims=None, strides=None, dtype=None):
        if x is not None:
            dims, strides = strides_bhsd(x, c.layout)
            dtype = cudnn_dtype(cudnn, x.dtype)
        T[name] = G.tensor(name=name, dim=dims, stride=strides, data_type=dtype)
        return T[name]

    scalar = lambda n: tensor(n, dims=[1, 1, 1, 1], strides=[1, 1, 1, 1], dtype=f32)  # noqa: E731
    o = alloc((c.b, c.sq, c.h, c.dv), c.o_dtype, c.layout)
    stats = torch.empty(c.b, c.h, c.sq, 1, device=dev, dtype=torch.float32)
    amax_s = torch.full((1, 1, 1, 1), float("nan"), device=dev)
    amax_o = torch.full((1, 1, 1, 1), float("nan"), device=dev)
    kw = dict(q=tensor("q", q8), k=tensor("k", k8), v=tensor("v", v8), descale_q=scalar("dq_"), descale_k=scalar("dk_"),
              descale_v=scalar("dv_"), descale_s=scalar("ds_"), scale_s=scalar("ss_"), scale_o=scalar("so_"),
              attn_scale=scale, generate_stats=True)
    if c.causal and c.bottom_right:
        kw["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        kw["right_bound"] = 0
    elif c.causal:
        kw["use_causal_mask"] = True
    if lens is not None:
        kw["use_padding_mask"] = True
        kw["seq_len_q"] = tensor("lq", dims=[c.b, 1, 1, 1], strides=[1, 1, 1, 1], dtype=i32)
        kw["seq_len_kv"] = tensor("lk", dims=[c.b, 1, 1, 1], strides=[1, 1, 1, 1], dtype=i32)
    out = G.sdpa_fp8(**kw)
    o_t, stats_t, amax_s_t, amax_o_t = out
    dims, strides = strides_bhsd(o, c.layout)
    o_t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn_dtype(cudnn, c.o_dtype))
    stats_t.set_output(True).set_dim([c.b, c.h, c.sq, 1]).set_stride([c.h * c.sq, c.sq, 1, 1]).set_data_type(f32)
    for t in (amax_s_t, amax_o_t):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    t0 = time.perf_counter()
    build(cudnn, handle, G)
    build_s = time.perf_counter() - t0
    ws = torch.empty(max(G.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    pack = {T["q"]: q8, T["k"]: k8, T["v"]: v8, T["dq_"]: q_ds, T["dk_"]: k_ds, T["dv_"]: v_ds, T["ds_"]: s_descale,
            T["ss_"]: s_scale, T["so_"]: o_scale, o_t: o, stats_t: stats, amax_s_t: amax_s, amax_o_t: amax_o}
    if lens is not None:
        pack[T["lq"]], pack[T["lk"]] = lens[0].view(-1, 1, 1, 1), lens[1].view(-1, 1, 1, 1)
    o.fill_(float("nan")) if c.o_dtype not in FP8_MAX else None
    G.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()
    o_deq = o.float() * o_descale.view(1)
    plan_name = getattr(G, "get_plan_name_at_index", lambda i: "")(0)
    res = {"case": c.name, "fwd_build_s": round(build_s, 3), "plan": str(plan_name)}
    valid = torch.ones(c.b, c.sq, 1, 1, dtype=torch.bool, device=dev)
    if lens is not None:
        valid = (torch.arange(c.sq, device=dev).view(1, -1, 1, 1) < lens[0].view(-1, 1, 1, 1))
    o_deq = o_deq * valid
    fwd_fn = lambda: G.execute(pack, ws, handle=handle)  # noqa: E731
    if not check:
        return res, fwd_fn, (_backward(cudnn, handle, c, locals(), check) if c.train else None)
    res["fwd_err_vs_deq_ref"] = rel(o_deq, o_ref_deq * valid)
    res["fwd_err_vs_bf16_ref"] = rel(o_deq, o_ref_bf16 * valid)
    res["amax_s"], res["amax_o"], res["amax_o_ref"] = float(amax_s), float(amax_o), o_amax
    res["o_nan"] = bool(torch.isnan(o_deq).any())
    if not c.train:
        return res, fwd_fn, None
    return res, fwd_fn, _backward(cudnn, handle, c, locals(), check)


def _backward(cudnn, handle, c, env, check):
    """Builds and runs the FP8 backward graph of case c (forward state in env); fills env['res']."""
    dev, g, scale, lens, valid, res = "cuda", env["g"], env["scale"], env["lens"], env["valid"], env["res"]
    q8, k8, v8, qb, kb, vb = (env[n] for n in ("q8", "k8", "v8", "qb", "kb", "vb"))
    q_ds, k_ds, v_ds, o, o_descale, stats = (env[n] for n in ("q_ds", "k_ds", "v_ds", "o", "o_descale", "stats"))
    s_scale, s_descale, ones, f32, i32 = (env[n] for n in ("s_scale", "s_descale", "ones", "f32", "i32"))
    dob = torch.randn(c.b, c.sq, c.h, c.dv, device=dev, generator=g).to(torch.bfloat16) * valid
    do8, do_s, do_ds = quantize(dob, c.do_dtype)
    if c.layout == "sbhd":
        do8 = alloc(do8.shape, c.do_dtype, "sbhd").copy_(do8)
    # float32 reference gradients on the dequantized inputs
    if check:
        qr, kr, vr = (x.float().mul(s.view(1)).requires_grad_() for x, s in ((q8, q_ds), (k8, k_ds), (v8, v_ds)))
        ref = reference(qr, kr, vr, scale, c.causal, lens, c.bottom_right)
        ref.backward(do8.float() * do_ds.view(1))
        qb2, kb2, vb2 = (x.float().requires_grad_() for x in (qb, kb, vb))
        ref2 = reference(qb2, kb2, vb2, scale, c.causal, lens, c.bottom_right)
        ref2.backward(dob.float())
        amax = {n: float(x.grad.abs().max()) for n, x in (("dq", qr), ("dk", kr), ("dv", vr))}
        # dP = dO V^T: its amax sets the scale a recipe would carry (cuDNN reports the real one)
        vrep = vr.detach().repeat_interleave(c.h // c.hkv, 2)
        dP_amax = float(torch.einsum("bqhd,bkhd->bhqk", do8.float() * do_ds.view(1), vrep).abs().max())
    else:
        amax, dP_amax = {"dq": 64.0, "dk": 64.0, "dv": 64.0}, 64.0
    B = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    T2 = {}

    def tensor2(name, x=None, dims=None, strides=None, dtype=None):
        if x is not None:
            dims, strides = strides_bhsd(x, c.layout)
            dtype = cudnn_dtype(cudnn, x.dtype)
        T2[name] = B.tensor(name=name, dim=dims, stride=strides, data_type=dtype)
        return T2[name]

    scalar2 = lambda n: tensor2(n, dims=[1, 1, 1, 1], strides=[1, 1, 1, 1], dtype=f32)  # noqa: E731
    o_for_bwd = o if c.bwd_o_dtype == c.o_dtype else (o.float() * o_descale.view(1)).to(c.bwd_o_dtype)
    if c.layout == "sbhd" and o_for_bwd is not o:
        o_for_bwd = alloc(o_for_bwd.shape, c.bwd_o_dtype, "sbhd").copy_(o_for_bwd)
    o_bwd_descale = o_descale if c.bwd_o_dtype in FP8_MAX else ones(1.0)
    kw = dict(q=tensor2("q", q8), k=tensor2("k", k8), v=tensor2("v", v8), o=tensor2("o", o_for_bwd),
              dO=tensor2("do", do8),
              stats=tensor2("stats", dims=[c.b, c.h, c.sq, 1], strides=[c.h * c.sq, c.sq, 1, 1], dtype=f32),
              descale_q=scalar2("dq_"), descale_k=scalar2("dk_"), descale_v=scalar2("dv_"),
              descale_o=scalar2("do_"), descale_dO=scalar2("ddo_"), descale_s=scalar2("ds_"),
              descale_dP=scalar2("ddp_"), scale_s=scalar2("ss_"), scale_dQ=scalar2("sdq_"),
              scale_dK=scalar2("sdk_"), scale_dV=scalar2("sdv_"), scale_dP=scalar2("sdp_"), attn_scale=scale,
              use_deterministic_algorithm=c.deterministic)
    if c.causal and c.bottom_right:
        kw["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        kw["right_bound"] = 0
    elif c.causal:
        kw["use_causal_mask"] = True
    if lens is not None:
        kw["use_padding_mask"] = True
        kw["seq_len_q"] = tensor2("lq", dims=[c.b, 1, 1, 1], strides=[1, 1, 1, 1], dtype=i32)
        kw["seq_len_kv"] = tensor2("lk", dims=[c.b, 1, 1, 1], strides=[1, 1, 1, 1], dtype=i32)
    dq_t, dk_t, dv_t, a_dq, a_dk, a_dv, a_dp = B.sdpa_fp8_backward(**kw)
    grads = {}
    for name, t, x in (("dq", dq_t, q8), ("dk", dk_t, k8), ("dv", dv_t, v8)):
        buf = alloc(x.shape, c.dqkv_dtype, c.layout)
        dims, strides = strides_bhsd(buf, c.layout)
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn_dtype(cudnn, c.dqkv_dtype))
        grads[name] = (t, buf)
    amaxes = {}
    for name, t in (("dq", a_dq), ("dk", a_dk), ("dv", a_dv), ("dp", a_dp)):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        amaxes[name] = (t, torch.full((1, 1, 1, 1), float("nan"), device=dev))
    t0 = time.perf_counter()
    build(cudnn, handle, B)
    res["bwd_build_s"] = round(time.perf_counter() - t0, 3)
    fp8_out = c.dqkv_dtype in FP8_MAX
    scales = {n: ones(FP8_MAX[c.dqkv_dtype] / amax[n]) if fp8_out else ones(1.0) for n in ("dq", "dk", "dv")}
    pack2 = {T2["q"]: q8, T2["k"]: k8, T2["v"]: v8, T2["o"]: o_for_bwd, T2["do"]: do8, T2["stats"]: stats,
             T2["dq_"]: q_ds, T2["dk_"]: k_ds, T2["dv_"]: v_ds, T2["do_"]: o_bwd_descale, T2["ddo_"]: do_ds,
             T2["ds_"]: s_descale, T2["ddp_"]: ones(dP_amax / FP8_MAX[c.do_dtype]),
             T2["ss_"]: s_scale, T2["sdq_"]: scales["dq"], T2["sdk_"]: scales["dk"], T2["sdv_"]: scales["dv"],
             T2["sdp_"]: ones(FP8_MAX[c.do_dtype] / dP_amax)}
    for name, (t, buf) in grads.items():
        pack2[t] = buf
    for name, (t, buf) in amaxes.items():
        pack2[t] = buf
    if lens is not None:
        pack2[T2["lq"]], pack2[T2["lk"]] = lens[0].view(-1, 1, 1, 1), lens[1].view(-1, 1, 1, 1)
    ws2 = torch.empty(max(B.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    B.execute(pack2, ws2, handle=handle)
    torch.cuda.synchronize()
    res["amax_dp"], res["amax_dp_ref"] = float(amaxes["dp"][1]), dP_amax
    bwd_fn = lambda: B.execute(pack2, ws2, handle=handle)  # noqa: E731
    if not check:
        return bwd_fn
    for name, x, x2 in (("dq", qr, qb2), ("dk", kr, kb2), ("dv", vr, vb2)):
        got = grads[name][1].float() / scales[name].view(1)
        res[f"{name}_err_vs_deq_ref"] = rel(got, x.grad)
        res[f"{name}_err_vs_bf16_ref"] = rel(got, x2.grad)
        res[f"{name}_amax_ratio"] = float(amaxes[name][1]) / max(amax[name], 1e-12)
    return bwd_fn


def bf16_graphs(cudnn, handle, b, h, s, d, causal):
    """bf16 cuDNN fwd and bwd graphs of the same shape (the baseline), as (fwd_fn, bwd_fn)."""
    dev = "cuda"
    f32 = cudnn.data_type.FLOAT
    bf = cudnn.data_type.BFLOAT16
    q, k, v, o, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(5))
    stats = torch.empty(b, h, s, 1, device=dev)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    dims, strides = list(q.permute(0, 2, 1, 3).shape), list(q.permute(0, 2, 1, 3).stride())

    def graph():
        return cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    F = graph()
    tq, tk, tv = (F.tensor(name=n, dim=dims, stride=strides, data_type=bf) for n in "qkv")
    kw = dict(attn_scale=1.0 / math.sqrt(d), generate_stats=True)
    if causal:
        kw.update(use_causal_mask=True)
    to, ts = F.sdpa(q=tq, k=tk, v=tv, **kw)
    to.set_output(True).set_dim(dims).set_stride(strides).set_data_type(bf)
    ts.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
    build(cudnn, handle, F)
    wsf = torch.empty(max(F.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    packf = {tq: q, tk: k, tv: v, to: o, ts: stats}
    B = graph()
    bq, bk, bv, bo, bdo = (B.tensor(name=n, dim=dims, stride=strides, data_type=bf) for n in ("q", "k", "v", "o", "do"))
    bs = B.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=f32)
    kw = dict(attn_scale=1.0 / math.sqrt(d))
    if causal:
        kw.update(use_causal_mask=True)
    gq, gk, gv = B.sdpa_backward(q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bs, **kw)
    for t in (gq, gk, gv):
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(bf)
    build(cudnn, handle, B)
    wsb = torch.empty(max(B.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    F.execute(packf, wsf, handle=handle)
    packb = {bq: q, bk: k, bv: v, bo: o, bdo: do, bs: stats, gq: dq, gk: dk, gv: dv}
    return (lambda: F.execute(packf, wsf, handle=handle)), (lambda: B.execute(packb, wsb, handle=handle))


def time_interleaved(fns: dict, rounds: int = 30, inner: int = 5, warm_s: float = 0.3):
    """Median ms per call of each fn, alternating call by call (CUDA events); the order rotates each round and
    reverses every other one, so no fn always follows the same one."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    warm_end = time.perf_counter() + warm_s
    while time.perf_counter() < warm_end:
        for fn in fns.values():
            fn()
    samples = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order = order[::-1]
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fns[name]()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / inner)
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


def plan_survey(cudnn, handle, s=4096, b=16, h=16, d=128):
    """Every engine config cuDNN offers for the causal FP8 forward and backward graphs, each timed: whether a plan
    faster than the heuristic's first choice exists (the FP8 causal backward ran 2x slower than bf16's)."""
    out = []
    for phase in ("fwd", "bwd"):
        c = Case(f"survey {phase}", b=b, h=h, hkv=h, sq=s, d=d, causal=True)
        orig_build = build

        def build_all(cudnn_, handle_, graph):
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn_.heur_mode.A, cudnn_.heur_mode.B, cudnn_.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans(cudnn_.build_plan_policy.ALL)
            return graph

        globals()["build"] = build_all
        try:
            _, fwd, bwd = run_case(cudnn, handle, c, check=False)
        finally:
            globals()["build"] = orig_build
        fn = fwd if phase == "fwd" else bwd
        graph = fn.__closure__ and next((cell.cell_contents for cell in fn.__closure__
                                         if hasattr(cell.cell_contents, "get_execution_plan_count")), None)
        if graph is None:
            out.append({"phase": phase, "error": "graph not found"})
            continue
        pack = next(cell.cell_contents for cell in fn.__closure__ if isinstance(cell.cell_contents, dict))
        ws = next(cell.cell_contents for cell in fn.__closure__ if isinstance(cell.cell_contents, torch.Tensor))
        n = graph.get_execution_plan_count()
        row = {"phase": phase, "plans": n, "times_ms": []}
        for i in range(n):
            try:
                size = graph.get_workspace_size_plan_at_index(i)
                w = ws if ws.numel() >= size else torch.empty(size, dtype=torch.uint8, device="cuda")
                t = time_interleaved({"p": lambda: graph.execute_plan_at_index(pack, w, i, handle=handle)},
                                     rounds=5, inner=2)
                row["times_ms"].append((i, str(graph.get_plan_name_at_index(i)), round(t["p"], 4)))
            except Exception as exc:  # noqa: BLE001
                row["times_ms"].append((i, "error", f"{type(exc).__name__}: {str(exc)[:80]}"))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


THD_CASES = [  # (name, sequence lengths, kv heads, causal, head dim, gaps between sequences)
    ("thd causal 4 seqs", [700, 129, 1024, 64], 8, True, 128, False),
    ("thd nomask 4 seqs", [700, 129, 1024, 64], 8, False, 128, False),
    ("thd causal GQA 8/2", [2048, 1000, 31], 2, True, 128, False),
    ("thd causal gaps", [700, 129, 1024, 64], 8, True, 128, True),
    ("thd causal d64", [512, 333, 900], 8, True, 64, False),
    ("thd causal 16 x ~1k", [1024 - 37 * i for i in range(16)], 8, True, 128, False),
]


def thd_cases(emit=print) -> list[dict]:
    """FP8 on packed sequences (thd) through attn-dispatch's FP8 engine, which declares ragged offsets for q, k, v,
    O and the stats. Forward: accuracy per sequence against float32 attention on the bf16 inputs and on the
    dequantized FP8 inputs (the kernel's own error). Backward: whether cuDNN builds the ragged FP8 backward graph
    (cudnn-frontend 1.32 refuses it on Hopper: 'sdpa fp8 backward with THD is not supported on Hopper')."""
    from attn_dispatch.backends import cudnn_fused as cd
    from attn_dispatch.backends.base import AttnAux, AttnConfig
    from attn_dispatch.backends.cudnn_fused_fp8 import CudnnFP8Engine, FP8Call
    from attn_dispatch.fp8 import Float8CurrentScaling, FP8ScalingState
    from attn_dispatch.fp8 import quantize as fp8q

    engine = CudnnFP8Engine()
    rows = []
    for name, lens, hkv, causal, d, gaps in THD_CASES:
        row = {"case": name, "lens": lens, "hkv": hkv, "causal": causal, "d": d, "gaps": gaps}
        try:
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n + (37 if gaps else 0))
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            cu_pad = torch.tensor(starts, dtype=torch.int32, device="cuda")
            t, h = starts[-1], 8
            g = torch.Generator(device="cuda").manual_seed(len(rows))
            q, k, v = (torch.randn(t, n, d, device="cuda", generator=g).to(torch.bfloat16) for n in (h, hkv, hkv))
            mask = "padding_causal" if causal else "padding"
            cfg = AttnConfig(qkv_format="thd", attn_mask_type=mask, window_size=(-1, 0) if causal else (-1, -1),
                             softmax_scale=1.0 / math.sqrt(d))
            aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            state = FP8ScalingState(Float8CurrentScaling(fp8_dpa=True))
            aux.extra["fp8"] = FP8Call(state)
            with torch.no_grad():
                engine(q, k, v, aux, cfg)  # the O scale of the second call comes from this call's amax
                out, lse, _ = engine(q, k, v, aux, cfg)
            torch.cuda.synchronize()
            deq = [fp8q.quantize(x, state.scale_of(n), torch.float8_e4m3fn).float() / state.scale_of(n)
                   for n, x in (("q", q), ("k", k), ("v", v))]
            errs_bf16, errs_deq = [], []
            for a, n in zip(starts[:-1], lens):
                seq = slice(a, a + n)
                for inputs, errs in (((q, k, v), errs_bf16), (deq, errs_deq)):
                    ref = reference(*(x[None, seq] for x in inputs), 1.0 / math.sqrt(d), causal)[0]
                    errs.append(rel(out[seq], ref))
            row["fwd_err_vs_bf16_ref_max"] = round(max(errs_bf16), 4)
            row["fwd_err_vs_deq_ref_max"] = round(max(errs_deq), 4)
            row["lse_finite"] = bool(torch.isfinite(lse[:, cu_pad[0]:cu_pad[0] + lens[0]]).all())
            row["fwd"] = "ran"
        except Exception as exc:  # noqa: BLE001 - what cuDNN said is the result
            row["fwd"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            call = cd._prepare(q, k, v, aux, cfg)
            key = engine._key("bwd", call, cfg, torch.cuda.current_device(), aux.extra["fp8"])
            engine.graph(key, ("probe", name))
            row["bwd_graph"] = "built"
        except Exception as exc:  # noqa: BLE001
            row["bwd_graph"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        emit(json.dumps(row))
    return rows


def print_thd(rows: list[dict]) -> None:
    print("\n== FP8 thd (ragged) through attn-dispatch's engine: worst per-sequence rel. L2 error vs float32")
    for r in rows:
        fwd = (f"fwd {r['fwd_err_vs_deq_ref_max']:.4f} (deq) | {r['fwd_err_vs_bf16_ref_max']:.4f} (bf16)"
               if r["fwd"] == "ran" else f"fwd REFUSED {r['fwd'][:90]}")
        print(f"{r['case']:<24} {fwd}; bwd graph: {r['bwd_graph'][:90]}")


def main():
    import cudnn
    if "--thd" in sys.argv:  # only the thd cases (benchmarks/gpu/check_fp8_cp_thd.py runs them too)
        rows = thd_cases()
        out_dir = os.environ.get("OUT", "/tmp/out")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "probe_fp8_thd.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print_thd(rows)
        return 0
    if "--survey" in sys.argv:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        rows = plan_survey(cudnn, handle)
        with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "fp8_plan_survey.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0

    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    meta = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": cudnn.backend_version(),
            "cudnn_frontend": cudnn.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(meta, flush=True)
    cases = [
        Case("d128 causal O=e4m3"),
        Case("d128 causal O=bf16", o_dtype=torch.bfloat16, bwd_o_dtype=torch.bfloat16),
        Case("d128 causal O=e4m3, bwd O bf16", bwd_o_dtype=torch.bfloat16),
        Case("d128 causal dQKV=bf16", dqkv_dtype=torch.bfloat16),
        Case("d128 nomask", causal=False),
        Case("d128 causal dO=e4m3 dQKV=e4m3", do_dtype=E4M3, dqkv_dtype=E4M3),
        Case("d128 GQA 8/2", hkv=2),
        Case("d128 padding causal", padding=True),
        Case("d128 padding nomask", padding=True, causal=False),
        Case("d128 s=1000 causal", sq=1000),
        Case("d128 sbhd", layout="sbhd"),
        Case("d128 bottom-right sq256 skv512", sq=256, skv=512, bottom_right=True),
        Case("d128 deterministic", deterministic=True),
        Case("d64 inference", d=64, train=False),
        Case("d64 training", d=64),
        Case("d256 inference", d=256, train=False),
        Case("d256 training", d=256),
        Case("d192/128 inference", d=192, dv=128, train=False),
        Case("d80 inference", d=80, train=False),
        Case("d128 s=1 decode", sq=1, skv=512, causal=False, train=False),
    ]
    results = []
    for c in cases:
        try:
            res, _, _ = run_case(cudnn, handle, c)
        except Exception as exc:  # noqa: BLE001 - each case reports what cuDNN said
            res = {"case": c.name, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            if not isinstance(exc, (RuntimeError, ValueError)) and "cudnn" not in type(exc).__module__:
                res["trace"] = traceback.format_exc()[-800:]
        results.append(res)
        print(json.dumps(res), flush=True)
    timings = []
    for s in (4096, 8192, 16384):
        for causal in (True, False):
            b, h, d = max(1, 32768 // s) * 2, 16, 128
            row = {"b": b, "h": h, "s": s, "d": d, "causal": causal}
            try:
                c = Case(f"time s{s} causal={causal}", b=b, h=h, hkv=h, sq=s, d=d, causal=causal,
                         o_dtype=E4M3, dqkv_dtype=E5M2)
                _, f8, b8 = run_case(cudnn, handle, c, check=False)
                c2 = Case(f"time s{s} causal={causal} O=bf16", b=b, h=h, hkv=h, sq=s, d=d, causal=causal,
                          o_dtype=torch.bfloat16, bwd_o_dtype=torch.bfloat16, dqkv_dtype=torch.bfloat16)
                _, f8b, b8b = run_case(cudnn, handle, c2, check=False)
                fb, bb = bf16_graphs(cudnn, handle, b, h, s, d, causal)
                fns = {"fp8_fwd": f8, "fp8_fwd_obf16": f8b, "bf16_fwd": fb, "fp8_bwd": b8, "fp8_bwd_bf16out": b8b,
                       "bf16_bwd": bb}
                t = time_interleaved(rounds=15 if s > 8192 else 30, inner=3 if s > 8192 else 5, fns=fns)
                flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                row.update({k: round(v, 4) for k, v in t.items()})
                row["fp8_fwd_tflops"] = round(flops / t["fp8_fwd"] / 1e9, 1)
                row["bf16_fwd_tflops"] = round(flops / t["bf16_fwd"] / 1e9, 1)
                row["fwd_speedup"] = round(t["bf16_fwd"] / t["fp8_fwd"], 3)
                row["fwdbwd_speedup"] = round((t["bf16_fwd"] + t["bf16_bwd"]) / (t["fp8_fwd"] + t["fp8_bwd"]), 3)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            timings.append(row)
            print(json.dumps(row), flush=True)
    thd = thd_cases()
    with open(os.path.join(out_dir, "probe_fp8.json"), "w") as f:
        json.dump({"meta": meta, "cases": results, "timings": timings, "thd": thd}, f, indent=1)
    print("\n== FP8 graph probe (rel. L2 error vs float32 on dequantized inputs | vs bf16 inputs)")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<38} ERROR {r['error'][:150]}")
        else:
            bwd = "" if "dq_err_vs_deq_ref" not in r else \
                " bwd dq %.3f|%.3f dk %.3f|%.3f dv %.3f|%.3f" % tuple(
                    r[f"{n}_err_vs_{w}_ref"] for n in ("dq", "dk", "dv") for w in ("deq", "bf16"))
            print(f"{r['case']:<38} fwd {r['fwd_err_vs_deq_ref']:.4f}|{r['fwd_err_vs_bf16_ref']:.4f}{bwd}")
    print_thd(thd)
    print("\n== timings (ms, median interleaved)")
    for r in timings:
        print({k: v for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
