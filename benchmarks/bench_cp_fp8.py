"""FP8 attention under context parallelism (cp_comm_type='a2a') on 2 GPUs: checked against one GPU and float32, then
timed against the same module in bf16.

    source .gpu-wheels/a2/env.sh && source benchmarks/gpu/setup.sh
    python3 benchmarks/bench_cp_fp8.py --out $OUT/cp_fp8_h200x2.json

One process per GPU (torch.multiprocessing, NCCL; bench_cp.py sets NCCL_NVLS_ENABLE=0 and the other multicast
switches before torch is imported). Every call is DotProductAttention's, as a user makes it: the rank's shards
(context_parallel.shard) into a module with cp_group and cp_comm_type='a2a' inside fp8_autocast, the output's
backward into the leaves' .grad.
1. Checks (b1 h16 d128, S=8k, bf16 inputs; causal and no_mask; each recipe of bench_fp8.RECIPES): STEPS steps of
   the CP module beside the same steps of a single-GPU module on the whole sequence (on every rank, each module
   from a fresh scaling state, the same recipe; the last step repeats the inputs of the one before, so the scales
   of what cuDNN writes come from the same data). On the last step, on each rank:
   - the output and dq/dk/dv against float32 attention on the same bf16 inputs (bench_fp8.ref_attention), sharded:
     Transformer Engine's FP8 criterion (bench_fp8.metrics: RMSE <= 0.11 x the values' range,
     test_dpa_fp8_vs_f16), for the CP call and for the single-GPU call;
   - against the single-GPU FP8 call, sharded: the relative L2 difference at most SAME_RUN_RATIO x the single-GPU
     call's own error against float32. The q, k, v and dO scales are the same by construction (delayed: the amax
     histories reduced over the CP group; current: the amaxes reduced before quantizing), so shards are bit for
     bit the single-GPU call's where cuDNN runs the same kernel for h/2 heads as for h (causal on 2x H100,
     benchmarks/results/fp8/check_fp8_cp_thd_h100x2.json) and within FP8's own error where it does not (GQA
     no_mask there: 3.5% on the output, 3.3% on dq). Bit equality is reported, not required;
   - the scaling state: scales and amax histories bit for bit equal on both ranks, and the step count; against the
     single-GPU module's, bit for bit for what attn-dispatch measures itself (the q, k, v, dO amaxes and every
     scale taken from them; the S scale, fixed at its bound) and within STATE_RTOL for the amaxes cuDNN's kernels
     report (S, O, dP, dQ, dK, dV);
   - both modules ran on cudnn_fused:fp8.
2. Timing (b1 h16 d128 causal, S in --seqlens): the FP8 CP module's step (forward + backward) and forward (no grad)
   against the same module's outside fp8_autocast (bf16, selection's pick), interleaved call by call with the order
   varying from round to round (a barrier before each call), --warmup rounds then --iters timed; the median per
   rank, then the slowest rank's.
Exit status: 0 when every check passes and every point ran; 1 when a check fails or a point raised; 2 when nothing
can run (cudnn-frontend missing, fewer than 2 GPUs, a GPU older than Hopper). JSON (machine, versions, date) goes
to --out; the tables are printed last.

--device cpu is a dry run of the same code over gloo with tiny float32 shapes and the calls outside FP8: the FP8
tables refuse a CPU call (cuDNN's FP8 graphs need a GPU), so the FP8-only checks (engine, scaling state) are
reported as not run. tests/test_fp8_context_parallel.py runs the FP8 a2a path itself on the CPU through a stand-in
cuDNN.
"""
from __future__ import annotations

import bench_cp  # noqa: F401 - first: sets the NCCL multicast switches before torch is imported

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attn_dispatch import DotProductAttention, context_parallel as cp, fp8_autocast
from attn_dispatch.fp8.state import INDEX, SELF_QUANTIZED, SLOTS
from bench_cp import free_port, machine, sync
from bench_fp8 import RECIPES, metrics, ref_attention

STEPS = 3
TENSORS = ("out", "dq", "dk", "dv")
MASKS = ("causal", "no_mask")
SAME_RUN_RATIO = 1.0   # CP vs one GPU: no further apart than the one-GPU call is from float32
SAME_RUN_FLOOR = 1e-4  # where both calls are exact (the dry run's float32), rounding alone
EXACT_SCALES = SELF_QUANTIZED + ("s",)  # scales from amaxes attn-dispatch measures, and S's fixed bound
EXACT_HISTORY = SELF_QUANTIZED
STATE_RTOL = 0.25      # the kernel-reported amaxes, where cuDNN's kernel for h/2 heads rounds otherwise
FP8_ENGINE = "cudnn_fused:fp8"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"checked recipes (of {', '.join(RECIPES)})")
    ap.add_argument("--timing-recipe", default="delayed_hybrid", choices=list(RECIPES))
    ap.add_argument("--check-seqlen", type=int, default=8192)
    ap.add_argument("--seqlens", default="32768,131072", help="timed total sequence lengths (comma list)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones")
    ap.add_argument("--iters", type=int, default=5, help="timed rounds (one call of each variant per round)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout-s", type=int, default=120, help="collective timeout (a failed rank cannot hang us)")
    args = ap.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    for r in args.recipes:
        if r not in RECIPES:
            ap.error(f"--recipes {r!r}: expected some of {', '.join(RECIPES)}")
    args.seqlens = [int(s) for s in args.seqlens.split(",") if s]
    args.world = 2
    args.batch = 1
    args.fp8 = args.device == "cuda"
    if args.device == "cpu":  # the dry run: tiny float32 shapes
        args.check_seqlen, args.seqlens = min(args.check_seqlen, 64), [s for s in (128, 256)]
        args.heads, args.head_dim = 4, 16
    for s in [args.check_seqlen, *args.seqlens]:
        if s % (2 * args.world):
            ap.error(f"sequence length {s} must split into {2 * args.world} load-balanced chunks")
    return args


# ----------------------------------------------------------------------------------------------
# Pure helpers (tests/test_bench_cp_fp8.py)
# ----------------------------------------------------------------------------------------------
def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def slot_rel_diff(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Per FP8 slot (the last dim, fp8.state.SLOTS), max |got - want| / max |want| (0 where both are 0)."""
    got, want = got.detach().double().reshape(-1, len(SLOTS)), want.detach().double().reshape(-1, len(SLOTS))
    out = {}
    for name in SLOTS:
        i = INDEX[name]
        diff, size = float((got[:, i] - want[:, i]).abs().max()), float(want[:, i].abs().max())
        out[name] = diff / size if size > 0 else (0.0 if diff == 0 else float("inf"))
    return out


def state_report(cp_state, one_state, ranks: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The CP module's scaling state against the other ranks' (ranks: every rank's (scale, amax_history)) and the
    single-GPU module's."""
    scale, history = ranks[0]
    return {"ranks_equal": all(torch.equal(scale, s) and torch.equal(history, h) for s, h in ranks[1:]),
            "steps": cp_state.steps, "single_steps": one_state.steps,
            "scale_vs_single": slot_rel_diff(cp_state.scale, one_state.scale),
            "history_vs_single": slot_rel_diff(cp_state.amax_history, one_state.amax_history),
            "bit_equal_single": bool(torch.equal(cp_state.scale, one_state.scale)
                                     and torch.equal(cp_state.amax_history, one_state.amax_history)),
            "scale": cp_state.scale.tolist()}


def check_failures(row: dict, fp8: bool, steps: int = STEPS) -> list[str]:
    """What a rank's check row fails on (empty: it passed). fp8=False: the dry run, whose calls are not FP8."""
    where = f"rank {row['rank']} {row['mask']} {row['recipe']}"
    bad = []
    for name in TENSORS:
        for key, who in (("vs_fp32", "CP"), ("single_vs_fp32", "one-GPU")):
            m = row[key][name]
            if not m["te_pass"]:
                bad.append(f"{where}: {who} {name} vs float32 fails Transformer Engine's FP8 criterion (RMSE "
                           f"{m['rmse_over_range']:.3f} x range > 0.11)")
        same, own = row["vs_single"][name]["rel_l2"], row["single_vs_fp32"][name]["rel_l2"]
        bound = max(SAME_RUN_RATIO * own, SAME_RUN_FLOOR)
        if not same <= bound:
            bad.append(f"{where}: CP {name} differs from the one-GPU FP8 call by {same:.4f} (rel L2), more than "
                       f"{bound:.4f} ({SAME_RUN_RATIO:g} x that call's own error vs float32)")
    if not fp8:
        return bad
    for who, chosen in (("CP", row["engine"]), ("one-GPU", row["single_engine"])):
        if chosen != FP8_ENGINE:
            bad.append(f"{where}: the {who} module ran {chosen}, not {FP8_ENGINE}")
    st = row["state"]
    if st is None:
        return bad + [f"{where}: the CP module has no FP8 scaling state (the call did not run in FP8)"]
    if not st["ranks_equal"]:
        bad.append(f"{where}: the ranks' scales or amax histories differ")
    if st["steps"] != steps or st["single_steps"] != steps:
        bad.append(f"{where}: scaling states recorded {st['steps']} (CP) and {st['single_steps']} (one GPU) steps, "
                   f"not {steps}")
    for kind, exact in (("scale", EXACT_SCALES), ("history", EXACT_HISTORY)):
        for slot, diff in st[f"{kind}_vs_single"].items():
            limit = 0.0 if slot in exact else STATE_RTOL
            if not diff <= limit:
                bad.append(f"{where}: {slot} {kind} differs from the one-GPU module's by {diff:.3g} (relative; "
                           f"allowed {limit:g})")
    return bad


def rotated(names: list[str], round_index: int) -> list[str]:
    """The call order of one timing round: reversed every other round and rotated by one every two, so that over
    2 x len(names) rounds each variant takes every position and follows more than one other (probe_fp8's rotation
    reversed each other round keeps an even number of variants in half the positions)."""
    k = round_index // 2 % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if round_index % 2 else order


def exit_status(report: dict) -> int:
    if report.get("unable"):
        return 2
    return 0 if report["ok"] else 1


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
def fp8_region(args, recipe):
    """The user's FP8 region; the dry run's calls stay outside FP8 (the FP8 tables refuse a CPU call)."""
    return fp8_autocast(recipe=recipe) if args.fp8 else fp8_autocast(enabled=False)


def dtype_of(args) -> torch.dtype:
    return torch.bfloat16 if args.fp8 else torch.float32


def module(args, mask: str, cp_group=None, cp_stream=None) -> DotProductAttention:
    kw = dict(cp_group=cp_group, cp_comm_type="a2a", cp_stream=cp_stream) if cp_group is not None else {}
    return DotProductAttention(args.heads, args.head_dim, qkv_format="bshd", attn_mask_type=mask, **kw)


def step_inputs(args, device) -> list[tuple[torch.Tensor, ...]]:
    """STEPS sets of whole-sequence (q, k, v, dO) [b, s, h, d], the same on every rank (rank 0's, broadcast); the
    last repeats the one before."""
    b, s, h, d = args.batch, args.check_seqlen, args.heads, args.head_dim
    sets = []
    for step in range(STEPS - 1):
        g = torch.Generator(device=device).manual_seed(1000 + step)
        tensors = [torch.randn(b, s, h, d, device=device, generator=g).to(dtype_of(args)) for _ in range(4)]
        for t in tensors:
            dist.broadcast(t, src=0)
        sets.append(tuple(tensors))
    return sets + [sets[-1]]


def reference(args, q, k, v, dout, mask: str, shard) -> dict[str, torch.Tensor]:
    """float32 attention on the bf16 inputs (out and the q, k, v gradients), this rank's shard of each."""
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = ref_attention(qr, kr, vr, mask == "causal")
    out.backward(dout.float())
    return {name: shard(t.detach()) for name, t in zip(TENSORS, (out, qr.grad, kr.grad, vr.grad))}


def check_case(args, mask: str, recipe_name: str, inputs, ref: dict, rank: int, group, stream) -> dict:
    shard = lambda t: cp.shard(t, "bshd", args.world, rank)  # noqa: E731
    recipe = RECIPES[recipe_name]()
    one, split = module(args, mask), module(args, mask, group, stream)
    for q, k, v, dout in inputs:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        with fp8_region(args, recipe):
            out_one = one(*whole)
        out_one.backward(dout.reshape(out_one.shape))
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        with fp8_region(args, recipe):
            out = split(*local)
        out.backward(shard(dout).reshape(out.shape))
    got = dict(zip(TENSORS, (out.detach().view(local[0].shape), *(t.grad for t in local))))
    single = dict(zip(TENSORS, (shard(out_one.detach().view(q.shape)), *(shard(t.grad) for t in whole))))
    row = {"rank": rank, "mask": mask, "recipe": recipe_name, "seqlen": args.check_seqlen,
           "engine": split.last_decision.chosen, "single_engine": one.last_decision.chosen,
           "notes": list(split.last_decision.notes),
           "vs_fp32": {n: metrics(got[n], ref[n]) for n in TENSORS},
           "single_vs_fp32": {n: metrics(single[n], ref[n]) for n in TENSORS},
           "vs_single": {n: {"rel_l2": rel_l2(got[n], single[n]), "bit_equal": bool(torch.equal(got[n], single[n]))}
                         for n in TENSORS},
           "state": None}
    if split.fp8_state is not None and one.fp8_state is not None:
        st = split.fp8_state
        ranks = []
        for t in (st.scale, st.amax_history):
            parts = [torch.empty_like(t) for _ in range(args.world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            ranks.append(parts)
        row["state"] = state_report(st, one.fp8_state, list(zip(*ranks)))
    row["failures"] = check_failures(row, args.fp8)
    return row


def interleaved_ms(fns: dict, grads, args, device: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(slowest rank's median ms per variant, this rank's timed samples): one call of each variant per round, in
    rotated order, each after a barrier; args.warmup rounds first, untimed."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.iters):
        for name in rotated(names, r):
            for t in grads:
                t.grad = None
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            if r >= args.warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    medians = torch.tensor([statistics.median(samples[n]) for n in names], dtype=torch.float64,
                           device=device if device == "cuda" else "cpu")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(names, medians.tolist())), samples


def timing_point(args, seqlen: int, rank: int, group, stream, device: str) -> dict:
    b, h, d, dt = args.batch, args.heads, args.head_dim, dtype_of(args)
    local = seqlen // args.world
    attn = module(args, "causal", group, stream)
    q, k, v = (torch.randn(b, local, h, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, local, h * d, device=device, dtype=dt)
    recipe = RECIPES[args.timing_recipe]()
    region = lambda fp8: fp8_region(args, recipe) if fp8 else contextlib.nullcontext()  # noqa: E731 - bf16: none
    decisions = {}

    def step(fp8: bool):
        with region(fp8):
            out = attn(q, k, v)
        decisions["fp8" if fp8 else "bf16"] = attn.last_decision
        out.backward(dout)

    def forward(fp8: bool):
        with torch.no_grad(), region(fp8):
            attn(q, k, v)

    fns = {"fp8_step": lambda: step(True), "bf16_step": lambda: step(False),
           "fp8_fwd": lambda: forward(True), "bf16_fwd": lambda: forward(False)}
    ms, samples = interleaved_ms(fns, (q, k, v), args, device)
    everyone = [None] * args.world
    dist.all_gather_object(everyone, {n: [round(x, 4) for x in xs] for n, xs in samples.items()})
    row = {"seqlen": seqlen, "batch": b, "heads": h, "head_dim": d, "mask": "causal", "recipe": args.timing_recipe,
           "ms": ms, "samples_ms": everyone, "warmup": args.warmup, "iters": args.iters,
           "step_speedup": ms["bf16_step"] / ms["fp8_step"], "fwd_speedup": ms["bf16_fwd"] / ms["fp8_fwd"],
           "engines": {k: v.chosen for k, v in decisions.items()},
           "notes": {k: list(v.notes) for k, v in decisions.items()},
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    row["failures"] = ([f"S={seqlen}: the FP8 step ran {row['engines'].get('fp8')}, not {FP8_ENGINE}"]
                       if args.fp8 and row["engines"].get("fp8") != FP8_ENGINE else [])
    return row


def worker(rank: int, port: int, args, out_path: str) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
    init = dict(backend="nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout_s))
    if device == "cuda":
        init["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(**init)
    group = dist.group.WORLD
    stream = torch.cuda.Stream() if device == "cuda" else None
    result: dict = {"rank": rank, "checks": [], "timing": [], "errors": []}

    def attempt(what: str, fn):
        """One point; an exception is recorded, not raised (the calls are collective: every rank fails alike)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            result["errors"].append({"rank": rank, "what": what, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                     "trace": traceback.format_exc()[-3000:]})
            return None
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

    try:
        inputs = attempt("inputs", lambda: step_inputs(args, device))
        for mask in MASKS if inputs else ():
            q, k, v, dout = inputs[-1]
            ref = attempt(f"float32 reference {mask}", lambda: reference(
                args, q, k, v, dout, mask, lambda t: cp.shard(t, "bshd", args.world, rank)))
            for recipe in args.recipes if ref else ():
                row = attempt(f"check {mask} {recipe}", lambda: check_case(args, mask, recipe, inputs, ref, rank,
                                                                           group, stream))
                if row:
                    result["checks"].append(row)
                    if rank == 0:
                        print(f"check {mask} {recipe}: {'ok' if not row['failures'] else 'FAILED'}", flush=True)
        inputs = ref = None
        for seqlen in [] if args.skip_timing else args.seqlens:
            row = attempt(f"timing S={seqlen}", lambda: timing_point(args, seqlen, rank, group, stream, device))
            if row:
                result["timing"].append(row)
                if rank == 0:
                    print(f"timing S={seqlen}: step fp8 {row['ms']['fp8_step']:.2f} ms, bf16 "
                          f"{row['ms']['bf16_step']:.2f} ms", flush=True)
        everyone = [None] * args.world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(everyone, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------
def unable_to_run(args) -> str | None:
    """Why this machine cannot run the GPU checks at all, or None."""
    if args.device == "cpu":
        return None
    if torch.cuda.device_count() < args.world:
        return f"{torch.cuda.device_count()} GPU(s) visible; this needs {args.world} (or --device cpu for a dry run)"
    if torch.cuda.get_device_capability(0)[0] < 9:
        return f"{torch.cuda.get_device_name(0)}: FP8 attention (cuDNN's FP8 graphs) needs Hopper or newer"
    try:
        import cudnn  # noqa: F401
    except ImportError as exc:
        return (f"cudnn-frontend is not importable ({exc}): FP8 attention runs on {FP8_ENGINE} through "
                "cudnn-frontend graphs; source .gpu-wheels/a2/env.sh first")
    return None


def versions(args) -> dict:
    info = machine(argparse.Namespace(device=args.device))
    if args.device == "cuda":
        import cudnn

        info.update(cudnn_frontend=cudnn.__version__, cudnn_backend=cudnn.backend_version())
    return info


def summarise(ranks: list[dict]) -> dict:
    checks = [row for r in ranks for row in r["checks"]]
    errors = [e for r in ranks for e in r["errors"]]
    timing = ranks[0]["timing"]  # every rank holds the same slowest-rank medians
    failures = [f for row in checks + timing for f in row["failures"]]
    failures += [f"rank {e['rank']}: {e['what']} raised {e['error'][:300]}" for e in errors]
    return {"checks": checks, "timing": timing, "errors": errors, "failures": failures}


def check_table(checks: list[dict]) -> str:
    lines = ["| mask | recipe | engine | CP vs float32 rel L2 out/dq/dk/dv (worst rank) | one GPU vs float32 | "
             "CP vs one GPU (max) | bit-equal to one GPU | state | ok |", "|---" * 9 + "|"]
    cases: dict = {}
    for row in checks:
        cases.setdefault((row["mask"], row["recipe"]), []).append(row)
    for (mask, recipe), rows in cases.items():
        worst = lambda key: "/".join(f"{max(r[key][n]['rel_l2'] for r in rows):.3f}" for n in TENSORS)  # noqa: E731
        same = max(r["vs_single"][n]["rel_l2"] for r in rows for n in TENSORS)
        equal = ",".join(n for n in TENSORS if all(r["vs_single"][n]["bit_equal"] for r in rows)) or "none"
        states = [r["state"] for r in rows]
        state = "not run (no FP8)" if any(s is None for s in states) else (
            ("ranks equal" if all(s["ranks_equal"] for s in states) else "RANKS DIFFER")
            + (", = one GPU" if all(s["bit_equal_single"] for s in states) else ", ~ one GPU"))
        ok = "yes" if not any(r["failures"] for r in rows) else "NO"
        lines.append(f"| {mask} | {recipe} | {rows[0]['engine']} | {worst('vs_fp32')} | {worst('single_vs_fp32')} | "
                     f"{same:.2e} | {equal} | {state} | {ok} |")
    return "\n".join(lines)


def timing_table(timing: list[dict], fp8: bool) -> str:
    label = "FP8" if fp8 else "FP8 off (dry run)"
    lines = [f"| S | step {label} ms | step bf16 ms | step speedup | fwd {label} ms | fwd bf16 ms | fwd speedup | "
             "bf16 engine |", "|---" * 8 + "|"]
    for r in timing:
        ms = r["ms"]
        lines.append(f"| {r['seqlen']} | {ms['fp8_step']:.2f} | {ms['bf16_step']:.2f} | {r['step_speedup']:.2f}x | "
                     f"{ms['fp8_fwd']:.2f} | {ms['bf16_fwd']:.2f} | {r['fwd_speedup']:.2f}x | "
                     f"{r['engines'].get('bf16')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"},
                    "criteria": {"fp32": "Transformer Engine test_dpa_fp8_vs_f16: RMSE <= 0.11 x value range",
                                 "same_run_ratio": SAME_RUN_RATIO, "same_run_floor": SAME_RUN_FLOOR,
                                 "state_exact_scales": list(EXACT_SCALES), "state_exact_history": list(EXACT_HISTORY),
                                 "state_rtol": STATE_RTOL, "steps": STEPS}}
    why = unable_to_run(args)
    report["machine"] = versions(args) if why is None else {"date": datetime.datetime.now().isoformat()}
    if why is not None:
        report.update(unable=why, ok=False)
    else:
        tmp = f"{args.out}.ranks.tmp"
        try:
            mp.start_processes(worker, args=(free_port(), args, tmp), nprocs=args.world, join=True,
                               start_method="spawn")
            with open(tmp) as f:
                report.update(summarise(json.load(f)))
            os.remove(tmp)
        except Exception as exc:  # noqa: BLE001 - a rank that died (or timed out in a collective) fails the run
            report.update(checks=[], timing=[], errors=[], failures=[f"the ranks failed: {type(exc).__name__}: "
                                                                     f"{str(exc)[:3000]}"])
        if not report["failures"]:  # nothing raised, so every point must have its row
            for key, expected in (("checks", len(MASKS) * len(args.recipes) * args.world),
                                  ("timing", 0 if args.skip_timing else len(args.seqlens))):
                if len(report[key]) != expected:
                    report["failures"].append(f"{len(report[key])} {key} rows, expected {expected}")
        report["ok"] = not report["failures"]
    report["seconds"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    status = exit_status(report)
    if status == 2:
        print(f"CANNOT RUN: {report['unable']}")
        return status
    print(f"\nmachine: {report['machine']}")
    for e in report["errors"]:
        print(f"rank {e['rank']} {e['what']}:\n{e['trace']}")
    print("\n" + check_table(report["checks"]))
    if not args.fp8:
        print("dry run: every call ran outside FP8 (the FP8 tables refuse a CPU call); the FP8 engine and "
              "scaling-state checks did not run")
    print(f"\n{len(report['failures'])} failure(s); {report['seconds']:.0f} s; JSON: {args.out}")
    for f in report["failures"]:
        print(f"FAILED: {f}")
    timing = "timing skipped (--skip-timing)" if args.skip_timing else timing_table(report["timing"], args.fp8)
    print("\n" + timing)
    return status


if __name__ == "__main__":
    sys.exit(main())
