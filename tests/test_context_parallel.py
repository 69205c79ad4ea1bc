"""Context parallelism over gloo: 2, 3 and 4 CPU processes against a single-process run of the whole sequence.

One spawn per world size runs every case (process groups are shared); rank 0 writes the measured errors
to JSON and the parametrised tests read them. Each case compares, on every rank, the local output and the
gradients of q, k, v (and the sink, summed over ranks) with (a) the unfused engine on the whole sequence in
one process and (b) a float64 reference written here. Error cases check that every rank raises.
"""
from __future__ import annotations

import datetime
import json
import math
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist

from attn_dispatch import context_parallel as cp
from attn_dispatch.context_parallel._comm import GroupInfo, agree, host_group
from attn_dispatch.backends import AttnAux, AttnConfig, Engine, get_engine

from reference import reference_attention
from spawn_ranks import free_port, spawn_ranks, teardown, write_gathered

FP32_TOL = 1e-5
BF16_TOL = 2e-2
SPAWN_DEADLINE_S = 240
ODD_WORLD = 3  # a ring of odd size: the p2p cases only (_odd_ring_cases), no error cases


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------
def _case(name, comm, fmt="bshd", mask="causal", h=4, hkv=4, softmax="vanilla", b=2, s=16, skv=None, d=8,
          lens=None, dtype="float32", module=False, strided=False, window=None, selected=False):
    """window: a sliding window (left, right); selected: engine None, each block's engine chosen by selection."""
    return dict(name=name, comm=comm, fmt=fmt, mask=mask, h=h, hkv=hkv, softmax=softmax, b=b, s=s,
                skv=skv or s, d=d, lens=lens, dtype=dtype, module=module, strided=strided, window=window,
                selected=selected)


def _window_cases(world: int, h: int, gqa_kv: int, lens) -> list[dict]:
    """Sliding windows: a window narrower than a chunk (p2p fetches only its keys, as all_gather does), one wider
    than a chunk (p2p keeps the ring, which stops early at 4 ranks), and a two-sided window without a causal mask."""
    cases = []
    s = 8 * world  # chunks of 4 tokens
    for comm in ("p2p", "all_gather", "a2a"):
        for fmt, mask, window in (("bshd", "causal", (3, 0)), ("sbhd", "causal", (6, 0)),
                                  ("bshd", "no_mask", (5, 2))):
            cases.append(_case(f"{comm}-{fmt}-{mask}-window{window[0]}_{window[1]}", comm, fmt, mask, h, gqa_kv,
                               s=s, window=window, selected=True))
    cases.append(_case("a2a-thd-padding_causal-window", "a2a", "thd", "padding_causal", h, gqa_kv, lens=lens,
                       window=(5, 0), selected=True))
    cases.append(_case("p2p-bshd-causal-window-learnable-sink", "p2p", "bshd", "causal", h, gqa_kv, "learnable",
                       s=s, window=(7, 0)))
    cases.append(_case("all_gather-bshd-causal-window-bf16", "all_gather", "bshd", "causal", h, gqa_kv, s=4 * s,
                       window=(9, 0), dtype="bfloat16", selected=True))
    cases.append(_case("module-all_gather-bshd-causal-window", "all_gather", "bshd", "causal", h, gqa_kv, s=s,
                       window=(5, 0), module=True))
    if world == 4:
        cases.append(_case("a2a+p2p-bshd-causal-window", "a2a+p2p", "bshd", "causal", h, gqa_kv, s=s,
                           window=(9, 0), selected=True))
        cases.append(_case("a2a+p2p-sbhd-no_mask-window", "a2a+p2p", "sbhd", "no_mask", h, gqa_kv, s=s,
                           window=(4, 4)))
    return cases


def _odd_ring_cases(world: int) -> list[dict]:
    """A ring of odd size: p2p only, every length a multiple of 2 * world."""
    h, s, lens = 2 * world, 4 * world, [2 * world, 4 * world, 6 * world]
    return [_case("p2p-bshd-causal-mha", "p2p", "bshd", "causal", h, h, s=s),
            _case("p2p-sbhd-causal-gqa", "p2p", "sbhd", "causal", h, world, s=s),
            _case("p2p-bshd-no_mask-gqa", "p2p", "bshd", "no_mask", h, world, s=s),
            _case("p2p-bshd-no_mask-cross", "p2p", "bshd", "no_mask", h, world, s=s, skv=2 * s),
            _case("p2p-bshd-causal-learnable-sink", "p2p", "bshd", "causal", h, world, "learnable", s=s),
            _case("p2p-thd-padding_causal", "p2p", "thd", "padding_causal", h, world, lens=lens),
            _case("p2p-thd-padding_causal-learnable-sink", "p2p", "thd", "padding_causal", h, world, "learnable",
                  lens=lens),
            _case("p2p-bshd-causal-bf16", "p2p", "bshd", "causal", h, world, dtype="bfloat16", s=2 * s),
            _case("p2p-bshd-causal-strided", "p2p", "bshd", "causal", h, h, "learnable", s=s, strided=True)]


def _cases(world: int) -> list[dict]:
    if world == ODD_WORLD:
        return _odd_ring_cases(world)
    h = 2 * world          # a2a needs heads divisible by the group size
    cases = []
    for comm in ("p2p", "all_gather", "a2a"):
        for fmt in ("bshd", "sbhd"):
            for mask in ("causal", "no_mask"):
                for hkv in (h, h // 2 if comm != "a2a" or world == 2 else world):
                    gqa = "gqa" if hkv != h else "mha"
                    cases.append(_case(f"{comm}-{fmt}-{mask}-{gqa}", comm, fmt, mask, h, hkv))
    gqa_kv = world  # divisible by world, and a GQA ratio of 2
    for comm in ("p2p", "all_gather", "a2a"):
        cases.append(_case(f"{comm}-bshd-causal-learnable-sink", comm, "bshd", "causal", h, gqa_kv, "learnable"))
    cases.append(_case("p2p-sbhd-causal-off-by-one", "p2p", "sbhd", "causal", h, gqa_kv, "off-by-one"))
    cases.append(_case("a2a-sbhd-no_mask-learnable-sink", "a2a", "sbhd", "no_mask", h, gqa_kv, "learnable"))
    for comm in ("p2p", "all_gather"):  # cross attention: kv twice as long as q
        cases.append(_case(f"{comm}-bshd-no_mask-cross", comm, "bshd", "no_mask", h, gqa_kv, skv=32))
    lens = [4 * world, 8 * world, 2 * world * 3]  # every sequence a multiple of 2 * cp_size
    for comm in ("p2p", "a2a"):
        cases.append(_case(f"{comm}-thd-padding_causal", comm, "thd", "padding_causal", h, gqa_kv, lens=lens))
        cases.append(_case(f"{comm}-thd-padding", comm, "thd", "padding", h, gqa_kv, lens=lens))
    cases.append(_case("p2p-thd-padding_causal-learnable-sink", "p2p", "thd", "padding_causal", h, gqa_kv,
                       "learnable", lens=lens))
    cases.append(_case("p2p-bshd-causal-bf16", "p2p", "bshd", "causal", h, gqa_kv, dtype="bfloat16", s=32))
    for comm in ("p2p", "all_gather", "a2a"):  # q/k/v views of one fused tensor; an engine with bhsd-major outputs
        cases.append(_case(f"{comm}-bshd-causal-strided", comm, "bshd", "causal", h, h, "learnable", strided=True))
    cases.append(_case("module-p2p-bshd-causal-learnable", "p2p", "bshd", "causal", h, gqa_kv, "learnable",
                       module=True))
    cases.append(_case("module-a2a-sbhd-no_mask", "a2a", "sbhd", "no_mask", h, gqa_kv, module=True))
    cases.append(_case("module-p2p-thd-padding_causal", "p2p", "thd", "padding_causal", h, gqa_kv, lens=lens,
                       module=True))
    cases += _window_cases(world, h, gqa_kv, lens)
    if world == 4:
        for fmt, mask, softmax in (("bshd", "causal", "vanilla"), ("sbhd", "no_mask", "vanilla"),
                                   ("bshd", "causal", "learnable"), ("thd", "padding_causal", "vanilla")):
            cases.append(_case(f"a2a+p2p-{fmt}-{mask}-{softmax}", "a2a+p2p", fmt, mask, h, gqa_kv, softmax,
                               lens=lens if fmt == "thd" else None))
    return cases


ERROR_CASES = ("group_of_one", "seq_mismatch", "a2a_heads", "one_rank_bad_window", "thd_window_p2p", "unsupported_mask",
               "list_group_for_p2p", "module_one_rank_bad_arg", "one_rank_unknown_comm", "scale_mismatch",
               "host_channel_disagree")
FROM_RANK_0 = ("one_rank_bad_window", "module_one_rank_bad_arg", "one_rank_unknown_comm")


# ----------------------------------------------------------------------------------------------
# Float64 reference (independent of the engine): softmax(q k^T * scale [+ causal mask]) v, with a sink
# ----------------------------------------------------------------------------------------------
def _ref_bhsd(q, k, v, causal, scale, sink):
    """q [b, h, sq, d], k/v [b, hkv, skv, d] in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


def _reference(q, k, v, fmt, causal, scale, sink, cu_q=None, cu_kv=None):
    if fmt == "thd":
        outs = []
        for i in range(len(cu_q) - 1):
            qi, ki, vi = (t[a:b].unsqueeze(0) for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_kv[i], cu_kv[i + 1]),
                                                               (v, cu_kv[i], cu_kv[i + 1])))
            outs.append(_reference(qi, ki, vi, "bshd", causal, scale, sink)[0])
        return torch.cat(outs)
    perm = (0, 2, 1, 3) if fmt == "bshd" else (1, 2, 0, 3)
    out = _ref_bhsd(*(t.permute(*perm) for t in (q, k, v)), causal, scale, sink)
    return out.permute(0, 2, 1, 3) if fmt == "bshd" else out.permute(2, 0, 1, 3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------
# Worker
# ----------------------------------------------------------------------------------------------
class Groups:
    def __init__(self, world: int):
        self.world = dist.new_group(list(range(world)))
        self.singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        self.a2a = self.p2p = None
        if world == 4:  # a2a groups {0,1},{2,3}; p2p groups {0,2},{1,3}: layout rank = p2p_rank * 2 + a2a_rank
            a2a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            p2p = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            rank = dist.get_rank()
            self.a2a, self.p2p = a2a[rank // 2], p2p[rank % 2]

    def for_comm(self, comm):
        return [self.a2a, self.p2p] if comm == "a2a+p2p" else self.world


def _inputs(case, gen):
    dt = getattr(torch, case["dtype"])
    b, s, skv, h, hkv, d, fmt = (case[k] for k in ("b", "s", "skv", "h", "hkv", "d", "fmt"))
    if fmt == "thd":
        cu = torch.tensor([0, *torch.tensor(case["lens"]).cumsum(0).tolist()], dtype=torch.int32)
        shapes = [(int(cu[-1]), h, d), (int(cu[-1]), hkv, d), (int(cu[-1]), hkv, d), (int(cu[-1]), h, d)]
    else:
        cu = None
        lay = (lambda n, heads: (b, n, heads, d)) if fmt == "bshd" else (lambda n, heads: (n, b, heads, d))
        shapes = [lay(s, h), lay(skv, hkv), lay(skv, hkv), lay(s, h)]
    q, k, v, dout = (torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt) for shape in shapes)
    sink = torch.randn(h, generator=gen, dtype=torch.float64).float() if case["softmax"] == "learnable" else None
    return q, k, v, dout, sink, cu


def _whole_sequence(case, engine, q, k, v, dout, sink, cu, scale):
    """The single-process run of the whole sequence, through the engine's autograd wrapper."""
    fmt = case["fmt"]
    window = case["window"] or ((-1, 0) if "causal" in case["mask"] else (-1, -1))
    cfg = AttnConfig(qkv_format=fmt, attn_mask_type=case["mask"], window_size=window, softmax_scale=scale,
                     softmax_type=case["softmax"])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    if fmt == "thd":
        longest = int((cu[1:] - cu[:-1]).max())
        aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                      softmax_offset=sink_leaf)
    else:
        aux = AttnAux(max_seqlen_q=case["s"], max_seqlen_kv=case["skv"], softmax_offset=sink_leaf)
    out, _, _ = engine(*leaves, aux, cfg)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves] + [sink_leaf.grad if sink_leaf is not None else None], cfg


def _float64_reference(case, q, k, v, dout, sink, cu, scale):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.double().requires_grad_() if sink is not None else None
    if case["softmax"] == "off-by-one":
        sink_leaf = torch.zeros(case["h"], dtype=torch.float64)
    cu_list = cu.tolist() if cu is not None else None
    if case["window"]:  # tests/reference.py, written independently of every engine, knows windows
        out, _ = reference_attention(*leaves, qkv_format=case["fmt"], attn_mask_type=case["mask"],
                                     window_size=case["window"], cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     softmax_type=case["softmax"], softmax_offset=sink_leaf, softmax_scale=scale)
    else:
        out = _reference(*leaves, case["fmt"], "causal" in case["mask"], scale, sink_leaf, cu_list, cu_list)
    out.backward(dout.double())
    grads = [t.grad for t in leaves]
    grads.append(sink_leaf.grad if case["softmax"] == "learnable" else None)
    return out.detach(), grads


class _StridedEngine(Engine):
    """The unfused engine, returning out/dq/dk/dv as [b, s, h, d] views of [b, h, s, d] memory (as torch's cuDNN op
    does), to check that context parallelism copes with whatever strides an engine hands back."""

    def __init__(self, inner):
        self.inner = inner

    @staticmethod
    def _bhsd_major(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    def forward(self, q, k, v, aux, cfg):
        res = self.inner.forward(q, k, v, aux, cfg)
        return res._replace(out=self._bhsd_major(res.out))

    def backward(self, dout, q, k, v, out, lse, state, aux, cfg):
        g = self.inner.backward(dout, q, k, v, out, lse, state, aux, cfg)
        return g._replace(dq=self._bhsd_major(g.dq), dk=self._bhsd_major(g.dk), dv=self._bhsd_major(g.dv))


def _run_case(case, groups: Groups):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    engine = get_engine("unfused:pytorch")
    q, k, v, dout, sink, cu = _inputs(case, gen)
    fmt, comm = case["fmt"], case["comm"]
    scale = 1.0 / math.sqrt(case["d"])
    out_w, grads_w, cfg = _whole_sequence(case, engine, q, k, v, dout, sink, cu, scale)
    out_r, grads_r = _float64_reference(case, q, k, v, dout, sink, cu, scale)
    cp_group = groups.for_comm(comm)
    size, rank = cp.cp_size_of(cp_group), cp.cp_rank_of(cp_group)

    def local(x):
        return cp.shard(x, fmt, size, rank, cu_seqlens=cu)
    leaves = [local(t).requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    if case["strided"]:  # q, k, v: non-contiguous views of one fused [b, s, 3, h, d] leaf
        fused = torch.stack([t.detach() for t in leaves], dim=2).requires_grad_()
        aux = AttnAux(softmax_offset=sink_leaf)
        out = cp.attention(_StridedEngine(engine), *fused.unbind(2), aux, cfg, cp_group=cp_group, cp_comm_type=comm)
        out.backward(local(dout))
        for leaf, grad in zip(leaves, fused.grad.unbind(2)):
            leaf.grad = grad
        sink_grad = sink_leaf.grad
    elif case["module"]:
        out, sink_grad = _run_module(case, leaves, sink, cu, cp_group, dout, local)
    else:
        aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, softmax_offset=sink_leaf)
        out = cp.attention(None if case["selected"] else engine, *leaves, aux, cfg, cp_group=cp_group,
                           cp_comm_type=comm)
        out.backward(local(dout))
        sink_grad = sink_leaf.grad if sink_leaf is not None else None
    metrics = {}
    for label, ref_out, ref_grads in (("engine", out_w, grads_w), ("float64", out_r, grads_r)):
        metrics[f"out_vs_{label}"] = _rel(out, local(ref_out).reshape(out.shape))
        for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_grads):
            metrics[f"{name}_vs_{label}"] = _rel(got.grad, local(want))
        if case["softmax"] == "learnable":
            total = sink_grad.clone()
            dist.all_reduce(total, group=groups.world)  # per-rank sink gradients sum to the whole one
            metrics[f"dsink_vs_{label}"] = _rel(total, ref_grads[3])
    return metrics


def _run_module(case, leaves, sink, cu, cp_group, dout, local):
    """DotProductAttention with cp_group, through its own forward."""
    from attn_dispatch import DotProductAttention

    fmt, h, hkv, d = case["fmt"], case["h"], case["hkv"], case["d"]
    module = DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format=fmt, attn_mask_type=case["mask"],
                                 softmax_type=case["softmax"], cp_group=cp_group, cp_comm_type=case["comm"],
                                 window_size=case["window"])
    if sink is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(sink)
    kwargs = {}
    if fmt == "thd":
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = module(*leaves, **kwargs)
    assert module.last_decision is not None and module.last_decision.chosen == "unfused:pytorch", \
        module.last_decision
    asked = module.explain(*leaves, **kwargs)  # the answer is what ran, notes included
    assert asked.notes == module.last_decision.notes, (asked.notes, module.last_decision.notes)
    ring = [n for n in asked.notes if n.startswith("ring hops:")]
    if case["comm"] in ("p2p", "a2a+p2p") and tuple(case["window"] or (-1, -1))[0] == -1:
        assert ring == ["ring hops: gloo's send/recv"], asked.notes
    elif case["comm"] in ("all_gather", "a2a"):
        assert not ring, asked.notes
    out.backward(local(dout).reshape(out.shape))
    return out.unflatten(-1, (h, -1)), module.softmax_offset.grad if sink is not None else None


def _expect_error(fn, *needles):
    """Run fn; return {'raised': type, 'message': ...}; record whether every needle is in the message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        msg = str(exc)
        return {"raised": type(exc).__name__, "message": msg[:600], "needles_found": all(n in msg for n in needles)}
    return {"raised": None, "message": "", "needles_found": False}


def _error_cases(groups: Groups, world: int) -> dict:
    rank = dist.get_rank()
    engine = get_engine("unfused:pytorch")
    causal = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=0.3)
    h = 2 * world

    def qkv(s, heads=h, hkv=h):
        g = torch.Generator().manual_seed(rank)
        return (torch.randn(2, s, heads, 8, generator=g), torch.randn(2, s, hkv, 8, generator=g),
                torch.randn(2, s, hkv, 8, generator=g))
    res = {}
    res["group_of_one"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), causal, cp_group=groups.singles[rank]),
        "size 1", "at least 2")
    res["seq_mismatch"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8 if rank == 0 else 6), AttnAux(), causal, cp_group=groups.world),
        "disagree", "sq=8", "sq=6")
    odd = 2 * world - 1
    res["a2a_heads"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8, odd, odd), AttnAux(), causal, cp_group=groups.world, cp_comm_type="a2a"),
        f"num_heads={odd}", f"divisible by {world}")
    windowed = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(2, 0), softmax_scale=0.3)
    res["one_rank_bad_window"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), windowed if rank == 0 else causal, cp_group=groups.world),
        "window_size=(2, 0)")
    cu = torch.tensor([0, 8 * world], dtype=torch.int32)
    thd_window = AttnConfig(qkv_format="thd", attn_mask_type="padding_causal", window_size=(3, 0))
    res["thd_window_p2p"] = _expect_error(
        lambda: cp.attention(engine, *(t[0, :4 * 2] for t in qkv(8)), AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu),
                             thd_window, cp_group=groups.world),
        "window_size=(3, 0)", "not supported under cp_comm_type='p2p'", "'a2a'")
    padding = AttnConfig(qkv_format="bshd", attn_mask_type="padding_causal", window_size=(-1, 0))
    res["unsupported_mask"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), padding, cp_group=groups.world),
        "attn_mask_type='padding_causal'", "not supported")
    res["list_group_for_p2p"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), causal, cp_group=[groups.world, groups.world]),
        "only cp_comm_type='a2a+p2p'")

    res["one_rank_unknown_comm"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), causal, cp_group=groups.world,
                             cp_comm_type="ring" if rank == 0 else "p2p"),
        "cp_comm_type='ring'")
    rescaled = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=0.5)
    res["scale_mismatch"] = _expect_error(
        lambda: cp.attention(engine, *qkv(8), AttnAux(), rescaled if rank == 1 else causal, cp_group=groups.world),
        "disagree", "softmax_scale=0.5", "softmax_scale=0.3")

    def module_call():
        from attn_dispatch import DotProductAttention
        module = DotProductAttention(h, 8, qkv_format="bshd", attn_mask_type="causal", cp_group=groups.world)
        module(*qkv(8), checkpoint_core_attention=(rank == 0))
    res["module_one_rank_bad_arg"] = _expect_error(module_call, "checkpoint_core_attention")

    # A group that is not gloo compares calls over a gloo companion made once for it (no GPU sync).
    class _NotGloo(GroupInfo):
        @property
        def backend(self) -> str:
            return "nccl"
    info = _NotGloo(groups.world, world, rank, tuple(range(world)))
    companion = host_group(info)
    assert companion is not groups.world and host_group(info) is companion
    assert dist.get_process_group_ranks(companion) == list(range(world))
    agree(info, [7, 8], lambda row: f"row={row}", None)  # equal calls pass
    res["host_channel_disagree"] = _expect_error(
        lambda: agree(info, [7, rank], lambda row: f"row={row}", None), "disagree", "row=[7, 0]", "row=[7, 1]")
    return res


class _RecordingEngine(Engine):
    """The unfused engine, logging each call as (phase, src, q rows, k rows, mask): src is the rank whose K/V shard
    the call's k is (all of it, or its first half), found by comparing values."""

    def __init__(self, inner, k_shards, local_len, events):
        self.inner, self.k_shards, self.local_len, self.events = inner, k_shards, local_len, events

    def _log(self, phase, q, k, cfg):
        half = self.local_len // 2
        src, k_rows = next(((j, rows) for j, shard in enumerate(self.k_shards)
                            for rows, keys in (("all", shard), ("first", shard[:, :half])) if torch.equal(k, keys)),
                           (None, "unknown keys"))
        q_rows = "all" if q.shape[1] == self.local_len else "second"
        self.events.append([phase, src, q_rows, k_rows, cfg.attn_mask_type])

    def forward(self, q, k, v, aux, cfg):
        self._log("fwd", q, k, cfg)
        return self.inner.forward(q, k, v, aux, cfg)

    def backward(self, dout, q, k, v, out, lse, state, aux, cfg):
        self._log("bwd", q, k, cfg)
        return self.inner.backward(dout, q, k, v, out, lse, state, aux, cfg)


def _record_p2p_schedule(groups: Groups, world: int) -> list:
    """One causal p2p call, forward and backward, logging in order each engine call and each ring transfer started
    (["start", sends, receives, to, from]) or waited for (["wait", transfers])."""
    from attn_dispatch.context_parallel._comm import Ring

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 4 * world, 2, 4, generator=gen) for _ in range(4))
    local = [cp.shard(k, "bshd", world, j) for j in range(world)]
    events: list = []
    engine = _RecordingEngine(get_engine("unfused:pytorch"), local, 4, events)
    start, wait = Ring.start, Ring.wait

    def logged_start(self, sends, recvs, *, send_to=None, recv_from=None):
        events.append(["start", len(sends), len(recvs), self.info.next_global if send_to is None else send_to,
                       self.info.prev_global if recv_from is None else recv_from])
        return start(self, sends, recvs, send_to=send_to, recv_from=recv_from)

    def logged_wait(works):
        events.append(["wait", len(works)])
        wait(works)
    Ring.start, Ring.wait = logged_start, staticmethod(logged_wait)
    try:
        cfg = AttnConfig(qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0), softmax_scale=0.5)
        leaves = [cp.shard(t, "bshd", world, rank).requires_grad_() for t in (q, k, v)]
        out = cp.attention(engine, *leaves, AttnAux(), cfg, cp_group=groups.world)
        events.append(["backward"])
        out.backward(cp.shard(dout, "bshd", world, rank))
    finally:
        Ring.start, Ring.wait = start, staticmethod(wait)
    return events


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        groups = Groups(world)
        results: dict = {}
        for case in _cases(world):
            start = time.perf_counter()
            try:
                results[case["name"]] = _run_case(case, groups)
            except Exception:  # noqa: BLE001 - reported per case
                results[case["name"]] = {"error": traceback.format_exc()[-3000:]}
            results[case["name"]]["seconds"] = time.perf_counter() - start
        try:
            results["p2p_schedule"] = _record_p2p_schedule(groups, world)
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            results["p2p_schedule"] = {"error": traceback.format_exc()[-3000:]}
        if world != ODD_WORLD:
            for name, value in _error_cases(groups, world).items():
                results["error:" + name] = value
            # the group still works after the errors: one more case on the same group
            results["after_errors"] = _run_case(_case("after_errors", "p2p", h=2 * world, hkv=world), groups)
        write_gathered(results, world, rank, out_path)
    finally:
        teardown()


_RESULTS: dict[int, list] = {}


def _results(world: int, tmp_path_factory) -> list[dict]:
    """Spawn once per world size (a failed or hung spawn is not retried by the next test)."""
    if world not in _RESULTS:
        _RESULTS[world] = _spawn(world, str(tmp_path_factory.mktemp(f"cp{world}") / "results.json"))
    if isinstance(_RESULTS[world], str):
        pytest.fail(_RESULTS[world])
    return _RESULTS[world]


def _spawn(world: int, out_path: str):
    return spawn_ranks(_worker, (world, free_port(), out_path), world, out_path,
                       f"context-parallel (world={world})", SPAWN_DEADLINE_S)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
def _params(world):
    return [pytest.param(world, c["name"], id=f"cp{world}-{c['name']}") for c in _cases(world)]


@pytest.mark.parametrize("world,name", _params(2) + _params(ODD_WORLD) + _params(4) +
                         [pytest.param(w, "after_errors", id=f"cp{w}-after_errors") for w in (2, 4)])
def test_matches_whole_sequence(world, name, tmp_path_factory):
    per_rank = _results(world, tmp_path_factory)
    case = next((c for c in _cases(world) if c["name"] == name), None)
    tol = BF16_TOL if case and case["dtype"] == "bfloat16" else FP32_TOL
    for rank, results in enumerate(per_rank):
        metrics = results[name]
        assert "error" not in metrics, f"rank {rank}:\n{metrics.get('error')}"
        worst = {k: v for k, v in metrics.items() if k != "seconds" and v > tol}
        assert not worst, f"rank {rank}: relative errors above {tol}: {worst}"
        expected = {"out_vs_engine", "dq_vs_engine", "dk_vs_engine", "dv_vs_engine", "out_vs_float64"}
        assert expected <= metrics.keys()
        if case and case["softmax"] == "learnable":
            assert {"dsink_vs_engine", "dsink_vs_float64"} <= metrics.keys()


@pytest.mark.parametrize("world", [2, ODD_WORLD, 4])
def test_p2p_backward_runs_the_ring_reversed_ending_on_the_diagonal(world, tmp_path_factory):
    """The backward computes the forward's blocks (the same kinds) in reverse order, K/V moving to the previous
    rank: first the block the forward ended on (nothing received before it), last the rank's own diagonal block,
    after which no transfer starts (the last dK/dV hop ran under it)."""
    for rank, results in enumerate(_results(world, tmp_path_factory)):
        events = results["p2p_schedule"]
        assert "error" not in events, f"rank {rank}:\n{events}"
        split = events.index(["backward"])
        calls = {phase: [e[1:] for e in events if e[0] == phase] for phase in ("fwd", "bwd")}
        assert [c[0] for c in calls["fwd"]] == [(rank - i) % world for i in range(world)], (rank, calls)
        assert calls["bwd"] == calls["fwd"][::-1], (rank, calls)
        assert calls["bwd"][-1] == [rank, "all", "all", "causal"], (rank, calls)
        backward = events[split + 1:]
        engine_steps = [i for i, e in enumerate(backward) if e[0] == "bwd"]
        assert not any(e[0] == "wait" and e[1] for e in backward[:engine_steps[0]]), (rank, backward)
        assert all(e[0] == "wait" for e in backward[engine_steps[-1] + 1:]), (rank, backward)
        starts = [e for e in backward if e[0] == "start"]
        prev, nxt = (rank - 1) % world, (rank + 1) % world
        assert starts and all(e[3:] == [prev, nxt] for e in starts), (rank, starts)
        assert not [e for e in starts if e[1] != e[2]], (rank, starts)  # every send matched by a receive


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_setups_raise_on_every_rank(world, name, tmp_path_factory):
    per_rank = _results(world, tmp_path_factory)
    for rank, results in enumerate(per_rank):
        outcome = results["error:" + name]
        assert outcome["raised"] in ("ValueError",), f"rank {rank}: {outcome}"
        if name in FROM_RANK_0 and rank != 0:
            # the other ranks learn of rank 0's problem through the collective check
            assert "rank 0" in outcome["message"] and outcome["needles_found"], f"rank {rank}: {outcome}"
        else:
            assert outcome["needles_found"], f"rank {rank}: {outcome}"


# ----------------------------------------------------------------------------------------------
# Single-process tests: sharding helpers and the support table
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(fmt, cp_size):
    lens = [2 * cp_size * n for n in (1, 3, 2)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    x = {"bshd": torch.randn(2, total, 3, 4), "sbhd": torch.randn(total, 2, 3, 4), "thd": torch.randn(total, 3, 4)}[fmt]
    shards = [cp.shard(x, fmt, cp_size, r, cu_seqlens=cu if fmt == "thd" else None) for r in range(cp_size)]
    assert all(s.shape == shards[0].shape for s in shards)
    back = cp.unshard(shards, fmt, cu_seqlens=cu if fmt == "thd" else None)
    assert torch.equal(back, x)


def test_load_balanced_layout_matches_transformer_engine():
    """Rank r holds chunks r and 2*cp-1-r of 2*cp chunks."""
    x = torch.arange(16).view(1, 16, 1, 1).float()
    got = [cp.shard(x, "bshd", 4, r).flatten().tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    t = torch.arange(24).view(24, 1, 1).float()
    assert cp.shard(t, "thd", 2, 0, cu_seqlens=cu).flatten().tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert cp.local_cu_seqlens(cu, 2).tolist() == [0, 4, 12]


def test_rank_order_round_trip():
    x = torch.randn(2, 24, 3, 4)
    shards = [cp.shard(x, "bshd", 3, r) for r in range(3)]
    order = cp.RankOrder("bshd", 3, x.device)
    rank_cat = torch.cat(shards, 1)
    assert torch.equal(order.to_natural(rank_cat), x)
    assert torch.equal(order.to_ranks(x), rank_cat)


def test_shard_errors_name_the_problem():
    with pytest.raises(ValueError, match="sequence length=10 is not divisible by 4"):
        cp.shard(torch.randn(1, 10, 1, 1), "bshd", 2, 0)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        cp.shard(torch.randn(8, 1, 1), "thd", 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 must be in"):
        cp.shard(torch.randn(1, 8, 1, 1), "bshd", 2, 2)


def test_support_table_and_params_failures():
    from attn_dispatch import AttentionParams

    ok = AttentionParams(dtype="bf16", num_heads=8, num_gqa_groups=2, max_seqlen_q=4096, attn_mask_type="causal",
                         cp_size=4, cp_comm_type="p2p", softmax_type="learnable")
    assert cp.params_failures(ok) == []
    a2a = ok.replace(cp_comm_type="a2a", num_heads=6, num_gqa_groups=6)
    (code, message, fix), = cp.params_failures(a2a)
    assert code == "cp_heads" and "num_heads=6" in message and fix
    thd_ag = ok.replace(qkv_format="thd", attn_mask_type="padding_causal", cp_comm_type="all_gather")
    assert any("qkv_format='thd'" in m for _, m, _ in cp.params_failures(thd_ag))
    assert cp.params_failures(ok.replace(window_size=(128, 0))) == []  # bshd windows: every comm type
    thd_window = ok.replace(qkv_format="thd", attn_mask_type="padding_causal", window_size=(128, 0))
    assert any("sliding windows" in m and "'a2a'" in m for _, m, _ in cp.params_failures(thd_window))
    assert cp.params_failures(thd_window.replace(cp_comm_type="a2a", num_gqa_groups=4)) == []
    biased = ok.replace(bias_type="post_scale_bias", bias_shape="1hss", dropout=0.1)
    messages = " ".join(m for _, m, _ in cp.params_failures(biased))
    assert "post_scale_bias" in messages and "attention_dropout=0.1" in messages
    blocks = cp.engine_block_params(ok)
    assert [(b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type) for b in blocks] == \
        [(4096, 4096, "causal"), (4096, 2048, "no_mask"), (2048, 4096, "no_mask")]
    assert all(b.cp_size == 1 and b.softmax_type == "vanilla" for b in blocks)
    gathered = cp.engine_block_params(ok.replace(cp_comm_type="all_gather"))
    assert [(b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type) for b in gathered[:2]] == \
        [(2048, 2048, "causal"), (2048, 2048, "no_mask")]
    assert max(b.max_seqlen_kv for b in gathered) == 7 * 2048


def test_collective_checks_env_is_validated(monkeypatch):
    from attn_dispatch.context_parallel._comm import checks_enabled

    monkeypatch.setenv("ATTN_DISPATCH_CP_CHECKS", "yes")
    with pytest.raises(ValueError, match="ATTN_DISPATCH_CP_CHECKS='yes'"):
        checks_enabled()


def test_a_collective_failure_leaves_no_cycle_holding_the_call(monkeypatch):
    """fail_collectively re-raises the caller's error; its frame must not keep that error (and through its
    traceback the call's tensors and process groups) in a reference cycle, which only the cyclic GC frees: a gloo
    group freed that late, at interpreter exit, aborts the process."""
    import gc
    import weakref

    from attn_dispatch.context_parallel.api import fail_collectively

    class Refusal(ValueError):  # a Python subclass: weakly referenceable, as ValueError itself is not
        pass

    monkeypatch.setenv("ATTN_DISPATCH_CP_CHECKS", "0")  # no group to tell: the error is raised here only
    gc.disable()
    try:
        error = Refusal("a refusal on this rank")
        alive = weakref.ref(error)
        try:
            fail_collectively(error, cp_group=None)
        except ValueError as exc:
            assert exc is error
        del error
        assert alive() is None
    finally:
        gc.enable()


def test_gpu_benchmark_dry_run_on_cpu(tmp_path):
    """benchmarks/bench_cp.py runs its whole pipeline (spawn, checks, timings, JSON, table) over gloo."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cp.py"
    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--out", str(out), "--world-size", "2",
                           "--seqlens", "256", "--comm", "p2p,a2a", "--iters", "2", "--warmup", "1",
                           "--check-seqlen", "128", "--a2a-head-groups", "1,2", "--window", "0", "--profile",
                           "--heads", "4", "--head-dim", "32"],  # the pipeline, not the numerics: small heads
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks_ok"] is True
    assert {(p["world_size"], p["comm"], p.get("a2a_head_groups")) for p in report["summary"]} == \
        {(1, "none", None), (2, "p2p", None), (2, "a2a", 1), (2, "a2a", 2)}
    assert all(p["efficiency"] is not None for p in report["summary"])
    assert {c["a2a_head_groups"] for c in report["runs"][1]["checks"] if c["comm"] == "a2a"} == {1, 2}
    assert all(len(p["profile"]) == 2 for p in report["summary"] if p["world_size"] == 2)
    assert report["machine"]["date"] and report["machine"]["attn_dispatch"]
    assert "| GPUs | S | comm |" in proc.stdout and "compute idle ms" in proc.stdout


def test_window_blocks_declared_for_selection():
    """Windowed CP calls declare trimmed band blocks. A window within the neighbouring chunks fetches only its keys
    under p2p, all_gather and a2a alike (one band per query chunk, every head); a wider one keeps p2p's ring."""
    from attn_dispatch import AttentionParams

    p = AttentionParams(dtype="bf16", num_heads=8, max_seqlen_q=4096, attn_mask_type="causal", cp_size=4,
                        cp_comm_type="p2p", window_size=(511, 0), device_type="cpu")
    blocks = {(b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type, b.window_size, b.num_heads)
              for b in cp.block_params(p)}
    # chunks of 2048: chunk 0 sees its own keys (causal, window 511); every other chunk the previous chunk's last
    # 511 keys and its own (bottom-right aligned)
    assert blocks == {(2048, 2048, "causal", (511, 0), 8), (2048, 2048 + 511, "causal_bottom_right", (511, 0), 8)}
    for comm in ("all_gather", "a2a"):
        assert {(b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type, b.window_size, b.num_heads)
                for b in cp.block_params(p.replace(cp_comm_type=comm))} == blocks
    # wider than a chunk: the ring's per-pair bands (the previous chunk's last 952 rows' keys, trimmed)
    ring = {(b.max_seqlen_q, b.max_seqlen_kv, b.attn_mask_type, b.window_size)
            for b in cp.block_params(p.replace(window_size=(3000, 0)))}
    assert ring == {(2048, 2048, "causal", (-1, 0)), (2048, 2048, "no_mask", (952, -1)), (952, 952, "no_mask", (0, -1))}
    heads = cp.block_params(p.replace(cp_comm_type="a2a+p2p", cp_size=8, cp_a2a_size=4))
    assert {b.num_heads for b in heads} == {2}  # the a2a group size is a parameter, not assumed 2
    with pytest.raises(ValueError, match="cp_a2a_size=3 must divide cp_size=8"):
        p.replace(cp_comm_type="a2a+p2p", cp_size=8, cp_a2a_size=3)


def test_bands_match_a_brute_force_mask():
    from attn_dispatch.constraints.cp_bands import band

    for n_q, n_k, delta, left, right in [(4, 4, d, lft, r) for d in range(-9, 10) for lft in (-1, 0, 2, 5)
                                         for r in (-1, 0, 3)] + [(3, 7, 2, 4, -1), (6, 2, -5, 3, 1)]:
        want = {(i, j) for i in range(n_q) for j in range(n_k)
                if (left < 0 or delta + j - i >= -left) and (right < 0 or delta + j - i <= right)}
        b = band(n_q, n_k, delta, left, right)
        got = set()
        if b is not None:
            off = 0 if b.mask == "causal" else b.k_len - b.q_len
            lo, hi = b.window
            got = {(i + b.q_start, j + b.k_start) for i in range(b.q_len) for j in range(b.k_len)
                   if (lo < 0 or j >= i + off - lo) and (hi < 0 or j <= i + off + hi)}
        assert got == want, (n_q, n_k, delta, left, right, b)


def test_windowed_cp_selection_composes_per_block_calls():
    """selection evaluates each engine's table on the declared per-block calls; no table calls selection."""
    from attn_dispatch import AttentionParams, Platform, explain

    p = AttentionParams(dtype="bf16", num_heads=8, max_seqlen_q=4096, attn_mask_type="causal", cp_size=2,
                        cp_comm_type="all_gather", window_size=(511, 0))
    d = explain(p, Platform.parse("h100-cudnn9"))
    assert d.chosen is not None
    torch_cudnn = next(v for v in d.verdicts if v.id == "cudnn_fused:torch")
    assert not torch_cudnn.eligible  # torch's cuDNN op takes no window: its own table says so, for the blocks
    thd = p.replace(qkv_format="thd", attn_mask_type="padding_causal", cp_comm_type="p2p")
    assert all(v.has(f"{v.backend}.cp_support") for v in explain(thd, Platform.parse("h100-cudnn9")).verdicts)


def test_per_block_engine_goes_through_selection(monkeypatch):
    """SelectedPerBlock asks selection.select (default policy, the module's forced backend) for each block's own
    params, once per block signature, and runs the engine it names."""
    from attn_dispatch import selection

    asked = []
    real = selection.select

    def spy(params, *a, **kw):
        asked.append((params, kw.get("force")))
        return real(params, *a, **kw)
    monkeypatch.setattr(selection, "select", spy)
    per_block = cp.SelectedPerBlock(force="unfused", is_training=True)
    q, k, v = (torch.randn(2, 12, 4, 8, dtype=torch.float64) for _ in range(3))
    cfg = AttnConfig(qkv_format="bshd", attn_mask_type="causal_bottom_right", window_size=(3, 0), softmax_scale=0.3)
    aux = AttnAux(max_seqlen_q=8, max_seqlen_kv=12)
    for _ in range(2):
        res = per_block.forward(q[:, :8], k, v, aux, cfg)
    ((params, force),) = asked  # cached after the first call
    assert force == "unfused" and params.max_seqlen_q == 8 and params.max_seqlen_kv == 12
    assert params.attn_mask_type == "causal_bottom_right" and params.window_size == (3, 0)
    assert list(per_block.choices.values()) == ["unfused:pytorch"]
    direct = get_engine("unfused:pytorch").forward(q[:, :8], k, v, aux, cfg)
    assert torch.equal(res.out, direct.out)
    g = per_block.backward(torch.ones_like(res.out), q[:, :8], k, v, res.out, res.lse, res.state, aux, cfg)
    assert g.dq.shape == (2, 8, 4, 8) and torch.isfinite(g.dk).all()
