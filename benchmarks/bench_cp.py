"""Context parallelism on one multi-GPU host: correctness against one GPU, then throughput and scaling efficiency.

No torchrun: the script spawns one process per GPU (torch.multiprocessing, NCCL) for each world size asked for,
world size 1 being the single-GPU baseline (the engine on the whole sequence, no CP).
  1. Checks (world size > 1): for each comm type, bf16 causal / no_mask / learnable sink / causal with a sliding
     window (--window) at --check-seqlen, each rank's output and dq/dk/dv against (a) the engine selection picks
     for the whole sequence on one GPU and (b) the unfused engine in float32 on the whole sequence; plus float32
     CP with the unfused engine against (b), where NCCL must be exact (rel. error <= 1e-5).
  2. Throughput: bf16, D=128, causal, total sequence S in --seqlens, forward and forward+backward (median of
     timings, slowest rank), tokens/s = batch * S / time, and scaling efficiency
     = tokens/s(P GPUs) / (P * tokens/s(1 GPU, the engine selection picks for the whole sequence)); plus, for
     --window-comm at the longest S, causal with the sliding window (against one GPU with the same window).
Each block's engine is chosen by attn_dispatch's selection on the block's own parameters (the default policy,
as a single-GPU call; the rows list the picks), or forced with --engine. NVLink multicast stays off (device README):
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set before torch is imported.
JSON goes to --out; the table is printed last. --device cpu runs the same code over gloo with tiny shapes.

  python3 benchmarks/bench_cp.py --out $OUT/cp.json                       # world sizes 1, 2, 4, ... (all GPUs)
  python3 benchmarks/bench_cp.py --out $OUT/cp.json --world-size 1,2 --seqlens 32768
  # 2 GPUs in under 8 minutes: windows checked, every comm type at 32k and 128k, all_gather windowed
  python3 benchmarks/bench_cp.py --out $OUT/cp_2gpu.json --world-size 1,2 --comm p2p,all_gather,a2a \
      --window 4096 --budget-s 4 --iters 8
  # 2 GPUs in about 5 minutes: p2p and a2a (1 and 4 head groups) at 32k and 128k, both windowed (4096, 0) at 128k,
  # with a per-rank profile of each timed point (attention, NCCL and merge kernels, idle gaps on the compute stream)
  python3 benchmarks/bench_cp.py --out $OUT/cp_h200x2.json --world-size 1,2 --comm p2p,a2a --a2a-head-groups 1,4 \
      --window 4096 --window-comm p2p,a2a --unchecked-comm '' --budget-s 3 --iters 8 --profile
--a2a-head-groups: cp_a2a_head_groups for a2a (comma list; 'default' = the package's choice); --a2a-size: the a2a
group size of a2a+p2p. --profile: after each timed point, two more fwd+bwd steps under torch.profiler; each rank's
kernel time by kind, the compute stream's idle time and the NCCL time not hidden under compute go into the row.
"""
from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # before any NCCL initialisation (and before torch is imported)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attn_dispatch import AttentionParams, Platform, context_parallel as cp, explain, select  # noqa: E402
from attn_dispatch.context_parallel import _row_copy, copy_engine, copy_engine_a2a, head_groups  # noqa: E402
from attn_dispatch.context_parallel._comm import GroupInfo, group_info  # noqa: E402
from attn_dispatch._version import __version__ as attn_dispatch_version  # noqa: E402
from attn_dispatch.backends import AttnAux, AttnConfig, get_engine  # noqa: E402

# What long-context training needs of CP (fwd+bwd against one GPU); each is met by the best row that matches it.
TARGETS = [{"comm": c, "world_size": w, "seqlen": s, "window": win, "efficiency": e} for c, w, s, win, e in (
    ("p2p", 2, 32768, None, 0.92), ("a2a", 2, 32768, None, 0.90),
    ("p2p", 2, 131072, None, 0.96), ("a2a", 2, 131072, None, 0.96),
    ("p2p", 4, 32768, None, 0.80), ("p2p", 4, 131072, None, 0.93), ("a2a", 4, 32768, None, 0.85),
    ("p2p", 2, 131072, [4096, 0], 0.85), ("a2a", 2, 131072, [4096, 0], 0.85),
    ("p2p", 4, 131072, [4096, 0], 0.85), ("a2a", 4, 131072, [4096, 0], 0.85))]
BF16_TOL, FP32_TOL = 2e-2, 1e-5


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--world-size", default=None,
                    help="comma list of world sizes (1 = single-GPU baseline); default 1,2,4,... up to all GPUs")
    ap.add_argument("--seqlens", default="32768,131072", help="total sequence lengths (comma list)")
    ap.add_argument("--comm", default="p2p,all_gather,a2a,a2a+p2p",
                    help="comm types (a2a+p2p runs where the world size is >= 4 and even)")
    ap.add_argument("--engine", default=None, help="force a provider, e.g. cudnn_fused:torch or flash_attn_2:torch")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="num_gqa_groups (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--check-seqlen", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=20.0, help="cap on timed seconds per point")
    ap.add_argument("--chain", type=int, default=1,
                    help="calls run back to back in each timed sample, as a model's layers run (no sync or barrier "
                         "between them, so the host may run ahead of the GPU); times are per call. 1: each call "
                         "starts from an idle GPU after a barrier")
    ap.add_argument("--window", type=int, default=4096,
                    help="left sliding window for the windowed checks and timings (0: none)")
    ap.add_argument("--window-comm", default="all_gather", help="comm types timed with the window (comma list)")
    ap.add_argument("--unchecked-comm", default="p2p",
                    help="comm types timed once more with ATTN_DISPATCH_CP_CHECKS=0 (no per-call agreement check: "
                         "one small all-gather and a host sync), to show that check's share (comma list)")
    ap.add_argument("--a2a-head-groups", default="default",
                    help="cp_a2a_head_groups values timed for a2a (comma list of integers or 'default')")
    ap.add_argument("--a2a-size", type=int, default=2, help="a2a+p2p: ranks per a2a group (consecutive ranks)")
    ap.add_argument("--profile", action="store_true",
                    help="profile two more fwd+bwd steps of each timed CP point; per-rank summaries go into the JSON")
    ap.add_argument("--trace-dir", default=None,
                    help="with --profile: each rank's kernels and CP ranges (name, stream, start, duration) of every "
                         "profiled point, one gzipped JSON file per rank and point")
    ap.add_argument("--transports", default="auto",
                    help="ring transports (ATTN_DISPATCH_CP_TRANSPORT) to check and time the ring comm types with, "
                         "comma list of auto, nccl, copy_engine; rows name the one that ran")
    ap.add_argument("--skip-checks", action="store_true",
                    help="time only (the correctness checks are for the recorded runs; this is for diagnostics)")
    ap.add_argument("--passes", action="store_true",
                    help="time a2a's memory passes alone on one GPU (no attention, no transfer: peers' rows in local "
                         "memory): one rank's pack, unpack, send-back and place, forward and backward, at each "
                         "--seqlens for each --world-size above 1 (ranks simulated, default 2) and --a2a-head-groups, "
                         "with each of --copies; bit-for-bit checks between them")
    ap.add_argument("--copies", default="pieces,torch,auto",
                    help=f"with --passes: {_row_copy.COPIES_ENV} modes timed (comma list of "
                         f"{', '.join(_row_copy.COPY_MODES)}); pieces is the per-chunk path a2a ran before")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout-s", type=int, default=120, help="collective timeout (a failed rank cannot hang us)")
    args = ap.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.chain < 1:
        ap.error(f"--chain {args.chain}: expected a positive number of calls per sample")
    args.seqlens = [int(s) for s in args.seqlens.split(",")]
    args.comm = [c for c in args.comm.split(",") if c]
    args.window_comm = [c for c in args.window_comm.split(",") if c and c in args.comm]
    args.unchecked_comm = [c for c in args.unchecked_comm.split(",") if c and c in args.comm]
    args.transports = [t for t in args.transports.split(",") if t]
    for t in args.transports:
        if t not in copy_engine.TRANSPORTS:
            ap.error(f"--transports {t!r}: expected some of {', '.join(copy_engine.TRANSPORTS)}")
    try:
        args.a2a_head_groups = [None if g == "default" else int(g) for g in args.a2a_head_groups.split(",") if g]
    except ValueError:
        ap.error(f"--a2a-head-groups {args.a2a_head_groups!r}: expected a comma list of integers or 'default'")
    if args.a2a_size < 2:
        ap.error(f"--a2a-size {args.a2a_size}: an a2a group needs at least 2 ranks")
    for c in args.comm:
        if c not in cp.COMM_TYPES:
            ap.error(f"--comm {c!r}: expected some of {', '.join(cp.COMM_TYPES)}")
    available = torch.cuda.device_count() if args.device == "cuda" else 4
    if args.device == "cuda" and available == 0:
        ap.error("--device cuda but no GPU is visible (use --device cpu for a dry run)")
    args.copies = [c for c in args.copies.split(",") if c]
    for c in args.copies:
        if c not in _row_copy.COPY_MODES:
            ap.error(f"--copies {c!r}: expected some of {', '.join(_row_copy.COPY_MODES)}")
    if args.passes:  # one process, ranks simulated: any count
        args.world_sizes = sorted({int(s) for s in (args.world_size or "2").split(",") if int(s) > 1}) or [2]
        if args.device == "cpu":
            args.seqlens = [s for s in args.seqlens if s <= 4096] or [512]
        return args
    if args.world_size is None:
        sizes, n = [1], 2
        while n <= available:
            sizes.append(n)
            n *= 2
        if available not in sizes:
            sizes.append(available)
    else:
        sizes = sorted({int(s) for s in args.world_size.split(",")})
    for w in sizes:
        if not 1 <= w <= available:
            ap.error(f"--world-size {w}: this machine has {available} {'GPUs' if args.device == 'cuda' else 'slots'}")
    args.world_sizes = sizes
    if args.device == "cpu":  # a dry run of the same code: gloo, float32-friendly tiny shapes
        args.seqlens = [s for s in args.seqlens if s <= 4096] or [512]
        args.check_seqlen = min(args.check_seqlen, 256)
        args.heads, args.kv_heads, args.head_dim = 4, min(args.kv_heads, 4), 32
        args.window = min(args.window, 24)
    return args


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def dtype_for(args) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def make_params(args, seqlen_local: int, mask: str, cp_size: int, comm: str, softmax: str = "vanilla",
                dtype=None, window=None) -> AttentionParams:
    return AttentionParams(
        dtype=dtype or dtype_for(args), qkv_format="bshd", batch_size=args.batch, num_heads=args.heads,
        num_gqa_groups=args.kv_heads, head_dim_qk=args.head_dim, max_seqlen_q=seqlen_local,
        attn_mask_type=mask, window_size=window, softmax_type=softmax, cp_size=cp_size, cp_comm_type=comm,
        cp_a2a_size=args.a2a_size if comm == "a2a+p2p" else None, device_type=args.device)


def whole_engine(args, seqlen: int, window=None) -> str:
    """The provider a single-GPU user gets for the whole sequence (selection's default policy), or --engine."""
    if args.engine:
        return args.engine
    return select(make_params(args, seqlen, "causal", 1, "p2p", window=window)).chosen


def cp_engine(args, params: AttentionParams):
    """(engine for cp.attention, error): --engine forces one Engine for every block; otherwise None, and each
    block's engine is chosen by selection (cp.SelectedPerBlock). The CP call's own decision must be eligible."""
    decision = explain(params, force=args.engine)
    if decision.chosen is None:
        return None, "; ".join(f"{v.id}: {v.reasons[0].message}" for v in decision.verdicts if v.reasons)[:1500]
    if args.engine:
        return get_engine(args.engine), None
    return cp.SelectedPerBlock(force=None, is_training=True), None


def engine_label(engine) -> str:
    if isinstance(engine, cp.SelectedPerBlock):
        return ",".join(sorted(set(engine.choices.values()))) or "per-block"
    return f"{engine.family}:{engine.provider}"


def config(mask: str, softmax: str, d: int, window=None) -> AttnConfig:
    plain = (-1, 0) if mask == "causal" else (-1, -1)
    return AttnConfig(qkv_format="bshd", attn_mask_type=mask, window_size=window or plain,
                      softmax_scale=1.0 / math.sqrt(d), softmax_type=softmax)


_GROUPS: dict = {}


def groups_for(comm: str, world: int, rank: int, a2a_size: int = 2):
    """cp_group for the comm type; a2a+p2p: a2a groups of a2a_size consecutive ranks, p2p groups across them
    (created once: new_group is collective, every rank creates every group in the same order)."""
    if comm != "a2a+p2p":
        return dist.group.WORLD
    if "a2a+p2p" not in _GROUPS:
        n = a2a_size
        a2a = [dist.new_group(list(range(n * g, n * g + n))) for g in range(world // n)]
        p2p = [dist.new_group(list(range(a, world, n))) for a in range(n)]
        _GROUPS["a2a+p2p"] = [a2a[rank // n], p2p[rank % n]]
    return _GROUPS["a2a+p2p"]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, args, device: str, grads=()) -> float:
    """Median over iterations of the slowest rank's milliseconds per call (fn runs on every rank; args.chain calls
    back to back per iteration)."""
    def chained(one_call=fn, chain=args.chain):
        for _ in range(chain):
            one_call()
    fn, chain = chained, args.chain
    for _ in range(args.warmup):
        fn()
        for t in grads:
            t.grad = None
    sync(device)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    sync(device)
    one = time.perf_counter() - start
    iters = max(2, min(args.iters, int(args.budget_s / max(one, 1e-6))))
    if dist.is_initialized():  # every rank must run the same number of iterations
        n = torch.tensor([iters], device=device if device == "cuda" else "cpu")
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        iters = int(n.item())
    times = []
    for _ in range(iters):
        for t in grads:
            t.grad = None
        if dist.is_initialized():
            dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    ms = sorted(times)[len(times) // 2] / chain
    if dist.is_initialized():
        t = torch.tensor([ms], device=device if device == "cuda" else "cpu", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t.item())
    return ms


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------
def whole_sequence(engine, q, k, v, dout, cfg: AttnConfig, sink):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.detach().clone().requires_grad_() if sink is not None else None
    aux = AttnAux(max_seqlen_q=q.shape[1], max_seqlen_kv=k.shape[1], softmax_offset=sink_leaf)
    out, _, _ = engine(*leaves, aux, cfg)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves], sink_leaf.grad if sink_leaf is not None else None


def check_point(args, comm: str, mask: str, softmax: str, dtype: torch.dtype, engine, world: int, rank: int,
                device: str, window=None, head_groups=None) -> dict:
    s, b, h, hkv, d = args.check_seqlen, args.batch, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(1234)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (h, hkv, hkv, h))
    sink = torch.randn(h, generator=gen) if softmax == "learnable" else None
    q, k, v, dout = (t.to(device=device, dtype=dtype) for t in (q, k, v, dout))
    sink = sink.to(device) if sink is not None else None
    cfg = config(mask, softmax, d, window)
    group = groups_for(comm, world, rank, args.a2a_size)
    size, cp_rank = cp.cp_size_of(group), cp.cp_rank_of(group)
    leaves = [cp.shard(t, "bshd", size, cp_rank).requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    out = cp.attention(engine, *leaves, AttnAux(softmax_offset=sink_leaf), cfg, cp_group=group, cp_comm_type=comm,
                       cp_a2a_head_groups=head_groups)
    out.backward(cp.shard(dout, "bshd", size, cp_rank))
    row = {"comm": comm, "mask": mask, "softmax": softmax, "window": list(window) if window else None,
           "dtype": str(dtype).removeprefix("torch."), "engine": engine_label(engine), "seqlen": s,
           "a2a_head_groups": head_groups}
    refs = {"fp32_unfused": ("unfused:pytorch", torch.float32)}
    if dtype != torch.float32:
        whole = explain(make_params(args, s, mask, 1, "p2p", softmax, dtype, window), force=args.engine).chosen
        if whole:
            refs["whole_sequence"] = (whole, dtype)
            row["whole_sequence_engine"] = whole
    for label, (ref_provider, ref_dtype) in refs.items():
        try:
            ref_out, ref_grads, ref_dsink = whole_sequence(
                get_engine(ref_provider), *(t.to(ref_dtype) for t in (q, k, v, dout)), cfg, sink)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine has no sink on the whole sequence: skip (b)
            row[f"vs_{label}"] = f"skipped: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        errs = {"out": rel(out, cp.shard(ref_out, "bshd", size, cp_rank))}
        for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_grads):
            errs[name] = rel(got.grad, cp.shard(want, "bshd", size, cp_rank))
        if sink_leaf is not None:
            total = sink_leaf.grad.clone()
            dist.all_reduce(total)  # per-rank sink gradients add up to the whole one
            errs["dsink"] = rel(total, ref_dsink)
        t = torch.tensor([max(errs.values())], device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row[f"vs_{label}"] = {"max_rel_err_all_ranks": float(t.item()), "rank0": errs if rank == 0 else None}
    row["engine"] = engine_label(engine)  # after the run: the per-block picks
    truth = row.get("vs_fp32_unfused")
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    row["tolerance"] = tol
    row["ok"] = isinstance(truth, dict) and truth["max_rel_err_all_ranks"] <= tol
    return row


# ----------------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------------
def baseline_point(args, seqlen: int, provider: str, device: str, window=None) -> dict:
    b, h, hkv, d, dt = args.batch, args.heads, args.kv_heads, args.head_dim, dtype_for(args)
    q, k, v = (torch.randn(b, seqlen, n, d, device=device, dtype=dt, requires_grad=True) for n in (h, hkv, hkv))
    dout = torch.randn(b, seqlen, h, d, device=device, dtype=dt)
    engine, cfg = get_engine(provider), config("causal", "vanilla", d, window)
    aux = AttnAux(max_seqlen_q=seqlen, max_seqlen_kv=seqlen)
    fwd = lambda: engine(q, k, v, aux, cfg)[0]  # noqa: E731
    ms_f = timed_ms(lambda: torch.no_grad()(fwd)(), args, device)
    ms_fb = timed_ms(lambda: fwd().backward(dout), args, device, grads=(q, k, v))
    return {"world_size": 1, "seqlen": seqlen, "comm": "none", "window": list(window) if window else None,
            "engine": provider, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "tokens_per_s": b * seqlen / (ms_fb * 1e-3),
            "peak_mem_gb": peak_mem(device)}


def cp_point(args, seqlen: int, comm: str, engine, world: int, rank: int, device: str, stream, window=None,
             head_groups=None) -> dict:
    b, h, hkv, d, dt = args.batch, args.heads, args.kv_heads, args.head_dim, dtype_for(args)
    local = seqlen // world
    group = groups_for(comm, world, rank, args.a2a_size)
    q, k, v = (torch.randn(b, local, n, d, device=device, dtype=dt, requires_grad=True) for n in (h, hkv, hkv))
    dout = torch.randn(b, local, h, d, device=device, dtype=dt)
    cfg = config("causal", "vanilla", d, window)
    kwargs = dict(cp_group=group, cp_comm_type=comm, cp_stream=stream, cp_a2a_head_groups=head_groups)
    fwd = lambda: cp.attention(engine, q, k, v, AttnAux(), cfg, **kwargs)  # noqa: E731
    ms_f = timed_ms(lambda: torch.no_grad()(fwd)(), args, device)
    ms_fb = timed_ms(lambda: fwd().backward(dout), args, device, grads=(q, k, v))
    row = {"world_size": world, "seqlen": seqlen, "comm": comm, "window": list(window) if window else None,
           "a2a_head_groups": head_groups, "engine": engine_label(engine), "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb,
           "tokens_per_s": b * seqlen / (ms_fb * 1e-3), "peak_mem_gb": peak_mem(device)}
    if args.profile:
        trace = None
        if args.trace_dir:
            label = f"w{world}_s{seqlen}_{comm}_{os.environ.get(copy_engine.TRANSPORT_ENV, 'auto')}" + \
                (f"_g{head_groups}" if head_groups else "") + \
                (f"_win{window[0]}" if window else "") + ("" if os.environ.get("ATTN_DISPATCH_CP_CHECKS") != "0"
                                                         else "_unchecked")
            trace = os.path.join(args.trace_dir, f"{label}_r{rank}.json.gz")
        mine = profile_steps(lambda: fwd().backward(dout), (q, k, v), device, trace)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        row["profile"] = everyone
    return row


# ----------------------------------------------------------------------------------------------
# Profile: where a rank's step goes
# ----------------------------------------------------------------------------------------------
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa|cudnn|fprop|bprop|dgrad|softmax", re.I)
PROFILED_STEPS = 2


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs, ys) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise_trace(events: list[dict]) -> dict:
    """Kernel time by kind on this rank (ms over the profiled steps, divided by the step count), from a Chrome trace's
    events: attention kernels, NCCL kernels, the CP merge kernel, everything else; the compute stream (the one with
    the most non-NCCL kernel time), its idle time between its first and last kernel, and the NCCL time that no
    compute-stream kernel overlaps (transfers not hidden). Host ranges of the CP all-to-all waits too."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_kind = {"attention_ms": 0.0, "nccl_ms": 0.0, "merge_ms": 0.0, "other_kernels_ms": 0.0}
    per_stream: dict = {}
    nccl = []
    for e in kernels:
        name, start, dur = e.get("name", ""), float(e["ts"]), float(e["dur"])
        stream = (e.get("args") or {}).get("stream")
        if "nccl" in name.lower():
            kind = "nccl_ms"
            nccl.append((start, start + dur))
        elif "merge_kernel" in name:
            kind = "merge_ms"
        elif ATTENTION_KERNEL.search(name):
            kind = "attention_ms"
        else:
            kind = "other_kernels_ms"
        by_kind[kind] += dur / 1e3
        if kind != "nccl_ms":
            per_stream.setdefault(stream, []).append((start, start + dur))
    summary = {k: v / PROFILED_STEPS for k, v in by_kind.items()}
    summary["kernels"] = len(kernels)
    if per_stream:
        stream, busy = max(per_stream.items(), key=lambda kv: _length(kv[1]))
        busy = _union(busy)
        span = busy[-1][1] - busy[0][0]
        summary.update(compute_stream=stream, compute_span_ms=span / 1e3 / PROFILED_STEPS,
                       compute_busy_ms=_length(busy) / 1e3 / PROFILED_STEPS,
                       compute_idle_ms=(span - _length(busy)) / 1e3 / PROFILED_STEPS)
        nccl_union = _union(nccl)
        summary["nccl_not_hidden_ms"] = (_length(nccl_union) - _overlap(nccl_union, busy)) / 1e3 / PROFILED_STEPS
    waits = [float(e["dur"]) for e in events if str(e.get("name", "")).startswith("cp_a2a_wait") and "dur" in e]
    summary["host_a2a_wait_ms"] = sum(waits) / 1e3 / PROFILED_STEPS
    return summary


def profile_steps(step, grads, device: str, trace_path: str | None = None) -> dict:
    """PROFILED_STEPS more calls of step() under torch.profiler, summarised (summarise_trace); trace_path: the
    kernels and the CP ranges (cp_*) written there as gzipped JSON rows [name, stream or 'host', start us, dur us]."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            for t in grads:
                t.grad = None
            step()
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    summary = summarise_trace(events)
    if trace_path:
        rows = [[e.get("name", "")[:120], (e.get("args") or {}).get("stream", "host"), e["ts"], e["dur"]]
                for e in events if "dur" in e and (e.get("cat") == "kernel" or str(e.get("name", "")).startswith(
                    ("cp_", "_ContextParallel", "aten::_cudnn_attention", "aten::_flash_attention")))]
        os.makedirs(os.path.dirname(trace_path), exist_ok=True)
        with gzip.open(trace_path, "wt") as f:
            json.dump(rows, f)
    summary["top_host_ops"] = top_ops(prof, "self_cpu_time_total")
    summary["top_device_ops"] = top_ops(prof, "self_device_time_total")
    return summary


def top_ops(prof, key: str, n: int = 8) -> list[list]:
    """[name, ms per step, calls per step] of the n ops with the most `key` time (host or device, self)."""
    rows = [(e.key, getattr(e, key, 0.0) or 0.0, e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return [[name[:80], round(t / 1e3 / PROFILED_STEPS, 3), round(c / PROFILED_STEPS, 1)] for name, t, c in rows[:n]]


def peak_mem(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def comms_for(args, world: int) -> list[str]:
    n = args.a2a_size
    return [c for c in args.comm if c != "a2a+p2p" or (world >= 2 * n and world % n == 0)]


def heads_ok(args, comm: str, world: int) -> bool:
    split = args.a2a_size if comm == "a2a+p2p" else world if comm == "a2a" else 1
    return args.heads % split == 0 and args.kv_heads % split == 0


def window_of(args):
    return (args.window, 0) if args.window > 0 else None


# ----------------------------------------------------------------------------------------------
# Worker
# ----------------------------------------------------------------------------------------------
def worker(rank: int, world: int, port: int, args, out_path: str, baselines: list[list]) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    init = dict(backend="nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                world_size=world, timeout=datetime.timedelta(seconds=args.timeout_s))
    if device == "cuda":
        init["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(**init)
    stream = torch.cuda.Stream() if device == "cuda" else None
    result: dict = {"world_size": world, "checks": [], "points": [], "errors": []}

    def attempt(what: str, fn):
        """Run one point; record an error instead of stopping (every rank fails alike: checks are collective)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            result["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}",
                                     "trace": traceback.format_exc()[-2000:]})
            return None
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

    def cp_row(what, comm, seqlen, window, checks=True, groups=None):
        engine, why = cp_engine(args, make_params(args, seqlen // world, "causal", world, comm, window=window))
        if engine is None:
            result["errors"].append({"what": what, "error": why})
            return
        os.environ["ATTN_DISPATCH_CP_CHECKS"] = "1" if checks else "0"
        try:
            row = attempt(what, lambda: cp_point(args, seqlen, comm, engine, world, rank, device, stream, window,
                                                 groups))
        finally:
            os.environ["ATTN_DISPATCH_CP_CHECKS"] = "1"
        if row:
            row["cp_checks"] = checks
            row["transport"] = transport_used(comm, world, rank)
            result["points"].append(row)
            if rank == 0:
                print(f"[W={world}] {what} {row['engine']}: {row['fwd_bwd_ms']:.1f} ms fwd+bwd", flush=True)

    try:
        if world == 1:
            for seqlen, provider, window in baselines:
                window = tuple(window) if window else None
                what = f"baseline S={seqlen} {provider}" + (f" window={window}" if window else "")
                row = attempt(what, lambda: baseline_point(args, seqlen, provider, device, window))
                if row:
                    result["points"].append(row)
                    print(f"[W=1] {what}: {row['fwd_bwd_ms']:.1f} ms fwd+bwd", flush=True)
        else:
            window = window_of(args)
            for comm in comms_for(args, world):
                if not heads_ok(args, comm, world):
                    result["errors"].append({"what": comm, "error": f"heads {args.heads}/{args.kv_heads} not "
                                             f"divisible for {comm} at world size {world}"})
                    continue
                local = args.check_seqlen // world
                checks = [] if args.skip_checks else [("causal", "vanilla", None), ("no_mask", "vanilla", None),
                                                      ("causal", "learnable", None)]
                if window and not args.skip_checks:
                    checks.append(("causal", "vanilla", window))
                for transport in (args.transports if comm in TRANSPORT_COMMS else args.transports[:1]):
                    os.environ[copy_engine.TRANSPORT_ENV] = transport
                    for groups in (args.a2a_head_groups if comm == "a2a" else [None]):
                        label = f"{comm}" + (f" G={groups}" if groups else "") + \
                            (f" [{transport}]" if len(args.transports) > 1 else "")
                        for mask, softmax, win in checks:
                            what = f"check {label} {mask} {softmax}" + (f" window={win}" if win else "")
                            engine, why = cp_engine(args, make_params(args, local, mask, world, comm, softmax,
                                                                      window=win))
                            if engine is None:
                                result["errors"].append({"what": what, "error": why})
                                continue
                            row = attempt(what, lambda: check_point(args, comm, mask, softmax, dtype_for(args),
                                                                    engine, world, rank, device, win, groups))
                            if row:
                                row["transport"] = transport_used(comm, world, rank)
                                result["checks"].append(row)
                        for win in ([] if args.skip_checks else [None, window] if window else [None]):
                            row = attempt(f"check {label} fp32 unfused window={win}", lambda: check_point(
                                args, comm, "causal", "vanilla", torch.float32, get_engine("unfused:pytorch"), world,
                                rank, device, win, groups))
                            if row:
                                row["transport"] = transport_used(comm, world, rank)
                                result["checks"].append(row)
                        for seqlen in args.seqlens:
                            cp_row(f"S={seqlen} {label}", comm, seqlen, None, groups=groups)
                            if comm in args.unchecked_comm:
                                cp_row(f"S={seqlen} {label} checks off", comm, seqlen, None, checks=False,
                                       groups=groups)
                        if window and comm in args.window_comm:
                            cp_row(f"S={max(args.seqlens)} {label} window={window}", comm, max(args.seqlens), window,
                                   groups=groups)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------
RING_COMMS = ("p2p", "a2a+p2p")
TRANSPORT_COMMS = RING_COMMS + ("a2a",)  # the comm types whose exchanges ATTN_DISPATCH_CP_TRANSPORT chooses


def transport_used(comm: str, world: int, rank: int) -> str:
    """The transport this process used for comm's ring hops or a2a exchanges (ATTN_DISPATCH_CP_TRANSPORT and the
    group's self-check)."""
    if comm == "a2a":
        group = groups_for(comm, world, rank)
        exchange, _ = copy_engine_a2a.copy_engine_exchange(group_info(group), torch.device("cuda", rank), 1)
        return "copy_engine" if exchange is not None else "nccl"
    if comm not in RING_COMMS:
        return "nccl collectives"
    group = groups_for(comm, world, rank)
    ring = group[1] if isinstance(group, list) else group
    if copy_engine.requested_transport() == "nccl":
        return "nccl"
    return copy_engine.transport_of(copy_engine.ring_for(group_info(ring), None, torch.device("cuda", rank)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine(args) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "attn_dispatch": attn_dispatch_version, "packages": {pkg.name: pkg.version or pkg.error
                                                                 for pkg in Platform.detect().packages},
            "torch": torch.__version__, "python": sys.version.split()[0], "hostname": socket.gethostname(),
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS", "ATTN_DISPATCH_POLICY",
                                                   copy_engine.TRANSPORT_ENV, _row_copy.COPIES_ENV)}}
    if args.device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                    capability=list(torch.cuda.get_device_capability(0)), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def baseline_rows(args) -> list[list]:
    """[seqlen, provider, window]: the one-GPU runs each efficiency divides by (selection's pick for the whole
    sequence, the same window)."""
    rows = [[s, whole_engine(args, s), None] for s in args.seqlens]
    window = window_of(args)
    if window and args.window_comm:
        s = max(args.seqlens)
        rows.append([s, whole_engine(args, s, window), list(window)])
    return [r for r in rows if r[1]]


def summarise(points: list[dict]) -> list[dict]:
    base = {(p["seqlen"], str(p.get("window"))): p["tokens_per_s"] for p in points if p["world_size"] == 1}
    rows = []
    for p in points:
        row = dict(p)
        one = base.get((p["seqlen"], str(p.get("window"))))
        row["efficiency"] = p["tokens_per_s"] / (p["world_size"] * one) if one else None
        rows.append(row)
    return rows


def targets(summary: list[dict]) -> list[dict]:
    out = []
    for t in TARGETS:
        hit = [r for r in summary if r["comm"] == t["comm"] and r["world_size"] == t["world_size"]
               and r["seqlen"] == t["seqlen"] and r.get("window") == t["window"] and r["efficiency"] is not None
               and r.get("cp_checks", True)]
        if hit:
            best = max(hit, key=lambda r: r["efficiency"])
            out.append(dict(t, measured=best["efficiency"], met=best["efficiency"] >= t["efficiency"],
                            a2a_head_groups=best.get("a2a_head_groups")))
    return out


def _ring(row: dict) -> str:
    return f" [{row['transport']}]" if row.get("transport") in copy_engine.TRANSPORTS else ""


def table(rows: list[dict], checks: list[dict]) -> str:
    lines = ["| GPUs | S | comm | window | engine | fwd ms | fwd+bwd ms | tokens/s | efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["seqlen"], str(r.get("window")), r["world_size"], r["comm"])):
        eff = f"{100 * r['efficiency']:.1f}%" if r.get("efficiency") is not None else "n/a"
        win = tuple(r["window"]) if r.get("window") else "-"
        comm = r["comm"] + (f" G={r['a2a_head_groups']}" if r.get("a2a_head_groups") else "") + _ring(r)
        comm += "" if r.get("cp_checks", True) else " (checks off)"
        lines.append(f"| {r['world_size']} | {r['seqlen']} | {comm} | {win} | {r['engine']} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {r['tokens_per_s']:.4g} | {eff} |")
    lines += ["", "| GPUs | check | dtype | engine | max rel err vs fp32 unfused | vs whole sequence | ok |",
              "|---|---|---|---|---|---|---|"]
    for c in checks:
        truth, same = c.get("vs_fp32_unfused"), c.get("vs_whole_sequence")
        fmt = lambda x: f"{x['max_rel_err_all_ranks']:.2e}" if isinstance(x, dict) else (x or "-")[:40]  # noqa: E731
        win = f" window={tuple(c['window'])}" if c.get("window") else ""
        groups = (f" G={c['a2a_head_groups']}" if c.get("a2a_head_groups") else "") + _ring(c)
        lines.append(f"| {c['world_size']} | {c['comm']}{groups} {c['mask']} {c['softmax']}{win} | {c['dtype']} | "
                     f"{c['engine']} | {fmt(truth)} | {fmt(same)} | {'yes' if c['ok'] else 'NO'} |")
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines += ["", "| GPUs | S | comm | window | rank | attention ms | NCCL ms | merge ms | other kernels ms | "
                  "compute idle ms | NCCL not hidden ms | host a2a wait ms |", "|---" * 12 + "|"]
        for r in profiled:
            comm = r["comm"] + (f" G={r['a2a_head_groups']}" if r.get("a2a_head_groups") else "") + _ring(r)
            for rank, p in enumerate(r["profile"]):
                cells = [f"{p.get(k, 0.0):.2f}" for k in ("attention_ms", "nccl_ms", "merge_ms", "other_kernels_ms",
                                                         "compute_idle_ms", "nccl_not_hidden_ms", "host_a2a_wait_ms")]
                win = tuple(r["window"]) if r.get("window") else "-"
                head = f"| {r['world_size']} | {r['seqlen']} | {comm} | {win} | {rank} | "
                lines.append(head + " | ".join(cells) + " |")
        lines += ["", "Most time per step on rank 0 (ms, calls): host ops by self time; device ops by self time"]
        for r in profiled:
            comm = r["comm"] + (f" G={r['a2a_head_groups']}" if r.get("a2a_head_groups") else "") + _ring(r)
            p = r["profile"][0]
            for kind in ("top_host_ops", "top_device_ops"):
                ops = "; ".join(f"{name[:40]} {ms:.2f} ({n:g})" for name, ms, n in p.get(kind, [])[:5])
                lines.append(f"- {r['seqlen']} {comm} {tuple(r['window']) if r.get('window') else ''} {kind}: {ops}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --passes: a2a's memory passes alone, on one device
# ----------------------------------------------------------------------------------------------
class _LocalExchange:
    """The exchange interface the passes use, in local memory: one buffer per region, this rank's own row kept out
    (as the copy-engine exchange does)."""

    transport = "local"
    keeps_own_row = True

    def __init__(self):
        self.regions: dict = {}

    def buffer(self, region, shape, dtype, device):
        got = self.regions.get(region)
        if got is None or got.shape != torch.Size(shape):
            got = self.regions[region] = torch.zeros(shape, dtype=dtype, device=device)
        return got


def _pass_ms(fn, args) -> float:
    """Median ms per call: `reps` calls back to back per sample, as a model's layers would run them."""
    reps, samples = 10, max(5, args.iters)
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(samples):
        if args.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def _kernel_count(fn, device: str) -> int | None:
    if device != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def passes_point(args, seqlen: int, size: int, groups: int) -> list[dict]:
    """One rank (the last) of `size`: every pass, timed in each copy mode, results compared across modes."""
    device, dtype, fmt = args.device, dtype_for(args), "bshd"
    local, rank = seqlen // size, size - 1
    gen = torch.Generator().manual_seed(seqlen + size)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v, dout = (rnd(args.batch, local, h, args.head_dim)
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    order = head_groups.SeqOrder(fmt, size, local, True)
    a2a = head_groups.A2AAttention(get_engine("unfused:pytorch"), config("causal", "vanilla", args.head_dim), AttnAux(),
                                   fmt, GroupInfo(None, size, rank, tuple(range(size))), order, groups,
                                   _LocalExchange())
    fwd_buf, fwd_layout = a2a._pack("fwd_in", (q, k, v))
    bwd_buf, bwd_layout = a2a._pack("bwd_in", (dout,))
    peer_fwd, peer_bwd = rnd(*fwd_buf.shape), rnd(*bwd_buf.shape)  # what the peers packed for this rank

    def received(peer, own, g):
        return [own if p == rank else peer[g, p] for p in range(size)]

    fwd_parts = received(peer_fwd, a2a._own((q, k, v), 0), 0)
    bwd_parts = received(peer_bwd, a2a._own((dout,), 0), 0)
    wholes = [t.clone() for t in a2a._unpack(fwd_parts, fwd_layout)]
    out_whole = wholes[0][..., :args.head_dim].clone()
    out = torch.zeros_like(q)
    out_layout, n_out = a2a._layout([a2a.group_heads(out).shape[2:]])
    out_buf = a2a.exchange.buffer("fwd_out", (groups, size, n_out), dtype, device)
    grad_buf = a2a.exchange.buffer("bwd_out", (groups, size, fwd_buf.shape[-1]), dtype, device)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    out_rows = [received(rnd(*out_buf.shape), None, g) for g in range(groups)]
    grad_rows = [received(rnd(*grad_buf.shape), None, g) for g in range(groups)]
    esize = q.element_size()
    local_bytes = sum(t.numel() for t in (q, k, v)) * esize
    whole_bytes = sum(t.numel() for t in wholes) * esize  # one group's heads of q, k, v
    passes = {
        "fwd pack q,k,v": (lambda: a2a._pack("fwd_in", (q, k, v)), lambda: [fwd_buf.clone()],
                           2 * (size - 1) * local_bytes // size),
        "fwd unpack q,k,v /group": (lambda: a2a._unpack(fwd_parts, fwd_layout), None, 2 * whole_bytes),
        "fwd send back out /group": (lambda: a2a._send_back([out_whole], out_buf[0], out_layout, [out], 0),
                                     lambda: [out_buf.clone(), out.clone()], 2 * out_whole.numel() * esize),
        "fwd place out": (lambda: a2a._place([out], out_rows, out_layout), lambda: [out.clone()],
                          2 * (size - 1) * out.numel() * esize // size),
        "bwd pack dout": (lambda: a2a._pack("bwd_in", (dout,)), lambda: [bwd_buf.clone()],
                          2 * (size - 1) * dout.numel() * esize // size),
        "bwd unpack dout /group": (lambda: a2a._unpack(bwd_parts, bwd_layout), None,
                                   2 * wholes[0].numel() * esize),
        "bwd send back dq,dk,dv /group": (lambda: a2a._send_back(wholes, grad_buf[0], fwd_layout, grads, 0),
                                          lambda: [grad_buf.clone(), *(g.clone() for g in grads)], 2 * whole_bytes),
        "bwd place dq,dk,dv": (lambda: a2a._place(grads, grad_rows, fwd_layout), lambda: [g.clone() for g in grads],
                               2 * (size - 1) * local_bytes // size),
    }
    rows = []
    for name, (fn, state, nbytes) in passes.items():
        row = {"seqlen": seqlen, "world_size": size, "a2a_head_groups": groups, "pass": name, "bytes": nbytes,
               "ms": {}, "kernels": {}, "same_as": {}}
        results = {}
        for mode in args.copies:
            os.environ[_row_copy.COPIES_ENV] = mode
            got = fn()
            results[mode] = [t.clone() for t in got] if state is None else state()
            row["ms"][mode] = _pass_ms(fn, args)
            row["kernels"][mode] = _kernel_count(fn, device)
        first = args.copies[0]
        row["same_as"] = {m: all(torch.equal(a, b) for a, b in zip(results[m], results[first]))
                          for m in args.copies[1:]}
        rows.append(row)
    os.environ.pop(_row_copy.COPIES_ENV, None)
    return rows


def passes_main(args) -> int:
    started = time.time()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    groups_list = [g or 1 for g in args.a2a_head_groups]
    rows = [r for seqlen in args.seqlens for size in args.world_sizes for groups in groups_list
            for r in passes_point(args, seqlen, size, groups)]
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    report = {"machine": machine(args), "config": {k: v for k, v in vars(args).items()},
              "kernel": {"triton": _row_copy.triton is not None,
                         "self_check": _row_copy.self_check(device) if device.type == "cuda" and _row_copy.triton
                         else "no Triton on this device"},
              "rows": rows, "seconds": time.time() - started}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    ok = all(all(r["same_as"].values()) for r in rows)
    print(f"machine: {report['machine'].get('gpu', 'cpu')}; kernel self-check: {report['kernel']['self_check']}; "
          f"all modes bit-for-bit equal: {ok}")
    modes = args.copies
    head = f"{'S':>7} {'P':>2} {'G':>2} {'pass':<30} {'MiB':>6} " + " ".join(f"{m + ' ms':>10} {'k':>3}" for m in modes)
    print(head + "  GB/s(" + modes[-1] + ")")
    totals = {m: 0.0 for m in modes}
    for r in rows:
        cells = " ".join(f"{r['ms'][m]:>10.3f} {r['kernels'][m] if r['kernels'][m] is not None else '-':>3}"
                         for m in modes)
        rate = r["bytes"] / (r["ms"][modes[-1]] * 1e-3) / 1e9
        print(f"{r['seqlen']:>7} {r['world_size']:>2} {r['a2a_head_groups']:>2} {r['pass']:<30} "
              f"{r['bytes'] / 2**20:>6.0f} {cells}  {rate:.0f}")
        for m in modes:
            totals[m] += r["ms"][m]
    print("total ms per point set: " + ", ".join(f"{m} {t:.3f}" for m, t in totals.items()))
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.passes:
        return passes_main(args)
    started = time.time()
    baselines = baseline_rows(args)
    report: dict = {"machine": machine(args), "config": {k: v for k, v in vars(args).items()},
                    "targets": TARGETS, "baselines": baselines, "runs": []}
    for world in sorted(set(args.world_sizes) | {1}):
        out_path = f"{args.out}.w{world}.tmp"
        print(f"== world size {world} ==", flush=True)
        try:
            mp.start_processes(worker, args=(world, free_port(), args, out_path, baselines), nprocs=world,
                               join=True, start_method="spawn")
            with open(out_path) as f:
                report["runs"].append(json.load(f))
            os.remove(out_path)
        except Exception as exc:  # noqa: BLE001 - one world size failing does not lose the others
            report["runs"].append({"world_size": world, "failed": f"{type(exc).__name__}: {exc}"[:4000]})
    points = [p for run in report["runs"] for p in run.get("points", [])]
    checks = [dict(c, world_size=run["world_size"]) for run in report["runs"] for c in run.get("checks", [])]
    report["summary"] = summarise(points)
    report["checks_ok"] = all(c["ok"] for c in checks) if checks else None
    report["target_results"] = targets(report["summary"])
    report["seconds"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    for run in report["runs"]:
        for e in run.get("errors", []):
            print(f"[W={run['world_size']}] {e['what']}: {e['error'][:300]}")
        if "failed" in run:
            print(f"[W={run['world_size']}] FAILED: {run['failed'][:1000]}")
    print(f"\nmachine: {report['machine']}")
    print(f"checks ok: {report['checks_ok']}; seconds: {report['seconds']:.0f}")
    for t in report["target_results"]:
        print(f"target {t['comm']} {t['world_size']} GPUs S={t['seqlen']}: >= {100 * t['efficiency']:.0f}%, "
              f"measured {100 * t['measured']:.1f}% ({'met' if t['met'] else 'NOT met'})")
    print()
    print(table(report["summary"], checks))
    return 0 if report["checks_ok"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
