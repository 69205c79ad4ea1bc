"""Masked calls on the GPU: a user's training step (forward, then backward into the leaves'
.grad), bf16, h16 d128, for each call:

- the module (DotProductAttention) forced to each eligible engine, and its default pick;
- attn_dispatch.scaled_dot_product_attention and torch's F.scaled_dot_product_attention given the same mask or bias
  (a bool mask, True = take part; an additive float mask where SDPA has no other way, e.g. ALiBi with padding);
- the nearest structured call through the module (thd for the document mask, causal for the prefix-LM);
- FlexAttention called directly, compiled, with a BlockMask the user built once (where a mask_mod states the mask).

Calls: a document mask (8 documents in S=16k, causal within each, as a bool mask), a prefix-LM (1k bidirectional
prefix, S=8k), a random 50% block-sparse mask (128-blocks, S=8k), per-head ALiBi with padding (b2, S=4k), padded
softcap (Gemma 2 style, b2, S=4k), an additive bias [1, h, S, S] (S=8k). Every column's output and gradients are
checked first against a float32 reference (the unfused engine on float32 copies: tests/test_unfused_engine.py checks
it against the float64 reference), then all are timed interleaved (attn_dispatch.policy.timing.time_interleaved:
blocks of back-to-back calls, rounds in a balanced order). TFLOP/s count the attended pairs. Then the peak memory of
one step at S=32k with the document mask, per column, beyond the inputs and their gradients.

    python benchmarks/bench_masks.py --out $OUT/bench_masks.json            # ~4 minutes on an H100
    python benchmarks/bench_masks.py --cases documents,prefix_lm --out ...   # a subset
    python benchmarks/bench_masks.py --inference --memory-s 0 --out ...      # forward alone, as inference runs
    python benchmarks/bench_masks.py --device cpu --out /tmp/masks_cpu.json # the script's plumbing, tiny, inference
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform as py_platform
import sys
import time
import traceback
from importlib import metadata
from typing import Callable

import torch
import torch.nn.functional as F

from attn_dispatch import AttentionParams, DotProductAttention, Platform, runtime_facts, scaled_dot_product_attention, \
    selection
from attn_dispatch import question
from attn_dispatch.call_args import CallArgs
from attn_dispatch.policy.timing import TimerSettings, time_interleaved
from attn_dispatch.validation import bias_shape_label

H, D = 16, 128
DTYPE = torch.bfloat16
TOL = 2e-2          # bf16 against the float32 reference: max |a - b| / max |b|
SETTINGS = TimerSettings(warmup=2, reps=8, max_reps=40, target_ms=40.0, warm_ms=30.0, block_ms=20.0)
USER_COLUMNS = ("module:default", "attn_dispatch.sdpa", "F.sdpa")


@dataclasses.dataclass
class Call:
    """One masked call at one size: the module's configuration and keywords, what SDPA is given, the dense keep
    mask of the attended pairs ([b|1, 1, s, s], True = take part), rows that belong to no sequence."""

    name: str
    b: int
    s: int
    mask_type: str
    keep: torch.Tensor
    module_kwargs: dict
    sdpa_mask: torch.Tensor | None        # SDPA's attn_mask (bool: take part; float: added), None: SDPA cannot
    softcap: float = 0.0
    f_sdpa: bool = True                    # F.sdpa can express the call (no softcap)
    real_rows: torch.Tensor | None = None  # [b, s] bool: rows a user's loss reads (padding rows excluded)
    structured: Callable | None = None     # (q, k, v) -> out [b, s, h*d]: the nearest structured module call
    structured_pairs: float = 0.0          # the pairs it attends (per batch element and head)
    structured_same: bool = False          # it computes the same attention (then it is checked too)
    flex_mask_mod: Callable | None = None  # a user's own mask_mod for FlexAttention called directly
    notes: str = ""


def _ij(s, device):
    return torch.arange(s, device=device).view(s, 1), torch.arange(s, device=device).view(1, s)


def documents(s: int, device, n_docs: int = 8) -> Call:
    gen = torch.Generator().manual_seed(39)
    cuts = sorted(torch.randperm(s - 1, generator=gen)[: n_docs - 1].add(1).tolist())
    starts = [0] + cuts
    doc = torch.zeros(s, dtype=torch.long, device=device)
    for st in cuts:
        doc[st:] += 1
    i, j = _ij(s, device)
    keep = ((doc.view(s, 1) == doc.view(1, s)) & (j <= i)).view(1, 1, s, s)
    cu = torch.tensor(starts + [s], dtype=torch.int32, device=device)
    lens = cu.diff().tolist()

    def thd(q, k, v):
        m = _module(("padding_causal", "thd", 0.0, None))
        return m(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                 max_seqlen_kv=max(lens)).unsqueeze(0)

    def doc_mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
    return Call("documents", 1, s, "arbitrary", keep, {"attention_mask": ~keep}, keep, structured=thd,
                structured_pairs=float(keep.sum()), structured_same=True, flex_mask_mod=doc_mask,
                notes=f"document lengths {lens}; structured: the same documents as thd, padding_causal")


def prefix_lm(s: int, device, prefix: int = 1024) -> Call:
    prefix = min(prefix, s // 8) if s < 8192 else prefix
    i, j = _ij(s, device)
    keep = ((j < prefix) | (j <= i)).view(1, 1, s, s)

    def causal(q, k, v):
        return _module(("causal", "bshd", 0.0, None))(q, k, v)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)
    return Call("prefix_lm", 1, s, "arbitrary", keep, {"attention_mask": ~keep}, keep, structured=causal,
                structured_pairs=s * (s + 1) / 2, flex_mask_mod=mask_mod,
                notes=f"bidirectional prefix of {prefix} tokens; structured: causal (not the same call: unchecked)")


def block_sparse(s: int, device, block: int = 128) -> Call:
    n = -(-s // block)
    gen = torch.Generator().manual_seed(50)
    blocks = (torch.rand(n, n, generator=gen) < 0.5) | torch.eye(n, dtype=torch.bool)
    keep = blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)[:s, :s].to(device).view(1, 1, s, s)
    return Call("block_sparse", 1, s, "arbitrary", keep, {"attention_mask": ~keep}, keep,
                notes=f"{block}-blocks, {blocks.float().mean():.2f} of them attended (the diagonal always)")


def _padding(b: int, s: int, device):
    lens = torch.tensor([s, (5 * s) // 8][:b], device=device)
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
    i, j = _ij(s, device)
    inside = (i < lens.view(b, 1, 1, 1)) & (j < lens.view(b, 1, 1, 1))
    real_rows = torch.arange(s, device=device).view(1, s) < lens.view(b, 1)
    return lens, cu, inside, real_rows


def alibi_padding(s: int, device) -> Call:
    b = 2
    lens, cu, inside, real_rows = _padding(b, s, device)
    i, j = _ij(s, device)
    keep = inside & (j <= i)
    slopes = torch.tensor([2 ** (-8 * (n + 1) / H) for n in range(H)], device=device)
    additive = (-slopes.view(1, H, 1, 1) * (i - j).abs()).masked_fill(~keep, float("-inf"))
    additive[..., 0] = additive[..., 0].nan_to_num(neginf=0.0)  # padded rows see key 0: no NaN rows for SDPA
    return Call("alibi_padding", b, s, "padding_causal", keep,
                {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "core_attention_bias_type": "alibi",
                 "alibi_slopes": slopes}, additive.to(DTYPE), real_rows=real_rows,
                notes=f"lengths {lens.tolist()}, ALiBi slopes per head; SDPA gets the [b, h, s, s] additive mask")


def softcap_padding(s: int, device, cap: float = 50.0) -> Call:
    b = 2
    lens, cu, inside, real_rows = _padding(b, s, device)
    i, j = _ij(s, device)
    keep = inside & (j <= i)
    sdpa_keep = keep | (j == 0)  # padded rows see key 0 (as transformers' masks do): no empty rows
    return Call("softcap_padding", b, s, "padding_causal", keep, {"cu_seqlens_q": cu, "cu_seqlens_kv": cu},
                sdpa_keep, softcap=cap, f_sdpa=False, real_rows=real_rows,
                notes=f"lengths {lens.tolist()}, softcap {cap}; F.sdpa has no softcap (attn_dispatch.sdpa gets "
                      "softcap= and the bool mask)")


def additive_bias(s: int, device) -> Call:
    gen = torch.Generator(device=device).manual_seed(7)
    bias = torch.randn(1, H, s, s, generator=gen, device=device, dtype=torch.float32).to(DTYPE)
    keep = torch.ones(1, 1, s, s, dtype=torch.bool, device=device)
    return Call("additive_bias", 1, s, "no_mask", keep,
                {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": bias}, bias,
                notes="post-scale bias [1, h, s, s], no mask")


CASES = {"documents": (documents, 16384), "prefix_lm": (prefix_lm, 8192), "block_sparse": (block_sparse, 8192),
         "alibi_padding": (alibi_padding, 4096), "softcap_padding": (softcap_padding, 4096),
         "additive_bias": (additive_bias, 8192)}


def call_params(call: Call, heads: int, dim: int, train: bool) -> AttentionParams:
    """The call as the module's forced engines take it: the mask as given (the default pick may read a document
    mask as thd; a forced engine runs the mask it was given), its bias, ALiBi slopes and softcap."""
    kw = call.module_kwargs
    bias, slopes = kw.get("core_attention_bias"), kw.get("alibi_slopes")
    return AttentionParams(dtype="bf16", qkv_format="bshd", batch_size=call.b, num_heads=heads, head_dim_qk=dim,
                           max_seqlen_q=call.s, attn_mask_type=call.mask_type,
                           bias_type=kw.get("core_attention_bias_type", "no_bias"),
                           bias_shape=None if bias is None else bias_shape_label(bias, call.b, heads, call.s, call.s),
                           alibi_slopes_shape=None if slopes is None else ("h" if slopes.dim() == 1 else "bh"),
                           softcap=call.softcap, is_training=train)


def row_params(row: dict, train: bool) -> dict:
    """A recorded call's params: its own record, or, for runs recorded before rows kept them, the case's builder at
    a small size on the CPU (its mask type, bias, slopes and softcap) at the row's sizes."""
    if "params" in row:
        return row["params"]
    small = CASES[row["call"]][0](64, torch.device("cpu"))
    return call_params(small, row["h"], row["d"], train).replace(batch_size=row["b"], max_seqlen_q=row["s"],
                                                                  max_seqlen_kv=row["s"]).to_dict()


def profile_rows(result: dict) -> list[dict]:
    """A run's calls as the performance profile's masked entries take them (policy.profile_build.build's `masked`): each
    call's params and the step time of every engine forced through the module (columns module:<provider>; the
    default pick, the SDPA functions and the structured call are not providers)."""
    train = result["environment"]["train"]
    return [{"label": row["call"], "params": row_params(row, train),
             "times_ms": {name.removeprefix("module:"): ms for name, ms in row["times_ms"].items()
                          if name.startswith("module:") and name.count(":") == 2}}
            for row in result["calls"]]

_MODULES: dict[tuple, DotProductAttention] = {}
DEVICE = torch.device("cuda")
TRAIN = True


def _module(key: tuple) -> DotProductAttention:
    """DotProductAttention for (mask type, format, softcap, backend), one per key."""
    m = _MODULES.get(key)
    if m is None:
        mask_type, fmt, softcap, backend = key
        m = _MODULES[key] = DotProductAttention(H, D, qkv_format=fmt, attn_mask_type=mask_type, softcap=softcap,
                                                backend=backend).to(DEVICE).train(TRAIN)
    return m


# ---------------------------------------------------------------------------------------------
# The columns: functions (q, k, v) -> out [b, s, h * d] on bshd leaves
# ---------------------------------------------------------------------------------------------
def columns(call: Call, q, k, v) -> dict[str, Callable]:
    def module_with(backend):
        m = _module((call.mask_type, "bshd", call.softcap, backend))
        return lambda q, k, v: m(q, k, v, **call.module_kwargs)

    default = _module((call.mask_type, "bshd", call.softcap, None))
    # the engines that take the call as given (the default may run it otherwise: a prefix-LM mask as two calls)
    as_given = question.ask(default, q, k, v, CallArgs(**call.module_kwargs), read_masks=False)
    decision = selection.explain(as_given.params)
    cols = {"module:default": module_with(None)}
    for verdict in decision.verdicts:
        if verdict.eligible and not (verdict.backend == "unfused" and call.s > 8192):
            cols[f"module:{verdict.id}"] = module_with(verdict.id)
    def bhsd(x):
        return x.transpose(1, 2)

    def merge(o):  # [b, h, s, d] -> [b, s, h * d]
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)
    if call.sdpa_mask is not None:
        cols["attn_dispatch.sdpa"] = lambda q, k, v: merge(scaled_dot_product_attention(
            bhsd(q), bhsd(k), bhsd(v), attn_mask=call.sdpa_mask, softcap=call.softcap))
    if call.sdpa_mask is not None and call.f_sdpa:
        cols["F.sdpa"] = lambda q, k, v: merge(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v),
                                                                              attn_mask=call.sdpa_mask))
    if call.structured is not None:
        cols["structured:module"] = call.structured
    if call.flex_mask_mod is not None and DEVICE.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        block_mask = create_block_mask(call.flex_mask_mod, None, None, call.s, call.s, device=DEVICE)
        cols["flex_direct"] = lambda q, k, v: merge(flex(bhsd(q), bhsd(k), bhsd(v), block_mask=block_mask))
    return cols


def step(fn, q, k, v, dout, train: bool):
    if not train:
        return lambda: fn(q, k, v)

    def run():
        q.grad = k.grad = v.grad = None
        with torch.enable_grad():
            fn(q, k, v).backward(dout)
    return run


def reference(call: Call, q, k, v, dout):
    """The unfused engine on float32 copies: (out, grads)."""
    leaves = [x.detach().float().requires_grad_(TRAIN) for x in (q, k, v)]
    m = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=call.mask_type, softcap=call.softcap,
                            backend="unfused").to(DEVICE).train(TRAIN)
    with torch.enable_grad():
        out = m(*leaves, **{key: (val.float() if key == "core_attention_bias" else val)
                             for key, val in call.module_kwargs.items()})
        grads = torch.autograd.grad(out, leaves, dout.float()) if TRAIN else ()
    return out.detach(), grads


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(0.1)).item()


def check(call: Call, cols: dict, q, k, v, dout) -> dict:
    ref_out, ref_grads = reference(call, q, k, v, dout)
    rows = call.real_rows.unsqueeze(-1) if call.real_rows is not None else None
    result = {}
    for name, fn in cols.items():
        if name == "structured:module" and not call.structured_same:
            result[name] = {"ok": True, "unchecked": "another call (the nearest structured one)"}
            continue
        try:
            q.grad = k.grad = v.grad = None
            with torch.enable_grad():
                out = fn(q, k, v)
                if TRAIN:
                    out.backward(dout)
            got, want = (out, ref_out) if rows is None else (out * rows, ref_out * rows)
            errs = {"out": rel_err(got, want)}
            if TRAIN:
                errs.update({f"d{n}": rel_err(x.grad, g) for n, x, g in zip("qkv", (q, k, v), ref_grads)})
            result[name] = {**errs, "ok": all(e < TOL for e in errs.values())}
        except Exception as exc:  # noqa: BLE001 - recorded: the column is then left out of the timing
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    q.grad = k.grad = v.grad = None
    return result


def attended_flops(call: Call) -> float:
    pairs = float(call.keep.expand(call.b, 1, call.s, call.s).sum()) * H
    return 4.0 * pairs * D * (3.5 if TRAIN else 1.0)


def leaves(b: int, s: int, seed: int, rows: torch.Tensor | None):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(b, s, H, D, generator=gen, device=DEVICE, dtype=torch.float32).to(DTYPE)
               .requires_grad_(TRAIN) for _ in range(3))
    dout = torch.randn(b, s, H * D, generator=gen, device=DEVICE, dtype=torch.float32).to(DTYPE)
    if rows is not None:  # a user's loss reads no padding row
        dout = dout * rows.unsqueeze(-1)
    return q, k, v, dout


def run_call(name: str, s: int, seed: int) -> dict:
    make = CASES[name][0]
    call = make(s, DEVICE)
    q, k, v, dout = leaves(call.b, call.s, seed, call.real_rows)
    t0 = time.perf_counter()
    cols = columns(call, q, k, v)
    checks = check(call, cols, q, k, v, dout)
    check_s = time.perf_counter() - t0
    timed = {n: step(fn, q, k, v, dout, TRAIN) for n, fn in cols.items() if checks[n].get("ok")}
    timings, errors = time_interleaved(timed, DEVICE.type, SETTINGS, cutoff_ratio=4.0,
                                       never_cut=frozenset(n for n in USER_COLUMNS if n in timed))
    flops = attended_flops(call)
    default_module = _module((call.mask_type, "bshd", call.softcap, None))
    default = default_module.last_decision
    with torch.set_grad_enabled(TRAIN):  # explain's notes say how the mask was read (two calls, as given: why)
        read = default_module.explain(q, k, v, **call.module_kwargs).notes if default else ()
    row = {
        "call": name, "b": call.b, "s": call.s, "h": H, "d": D, "mask_type": call.mask_type, "notes": call.notes,
        "training": TRAIN,
        "params": call_params(call, H, D, TRAIN).to_dict(),
        "attended_pairs": flops / (4.0 * D * (3.5 if TRAIN else 1.0)),
        "default_pick": default.chosen if default else None,
        "default_reason": default.policy_reason[:400] if default else None,
        "default_notes": list(read),
        "check": checks, "check_and_compile_s": check_s,
        "times_ms": {n: t.median_ms for n, t in timings.items()},
        "tflops": {n: flops / (t.median_ms * 1e9) for n, t in timings.items()},
        "cut_short": sorted(n for n, t in timings.items() if t.cut_short),
        "errors": {n: f"{type(e).__name__}: {e}"[:400] for n, e in errors.items()},
    }
    times = row["times_ms"]
    if "structured:module" in times:  # its TFLOP/s over its own attended pairs
        structured_flops = 4.0 * call.structured_pairs * call.b * H * D * (3.5 if TRAIN else 1.0)
        row["tflops"]["structured:module"] = structured_flops / (times["structured:module"] * 1e9)
        fused = {n: t for n, t in row["tflops"].items() if n.startswith("module:") and "unfused" not in n}
        row["vs_structured_tflops"] = {n: t / row["tflops"]["structured:module"] for n, t in fused.items()}
    if "F.sdpa" in times:  # > 1: faster than F.scaled_dot_product_attention given the same mask or bias
        row["speedup_over_F.sdpa"] = {n: times["F.sdpa"] / times[n] for n in ("module:default", "attn_dispatch.sdpa")
                                      if n in times}
    return row


def peak_memory(s: int, seed: int) -> dict:
    """One step's peak memory beyond the inputs and their gradients, per column, at S=s with the document mask."""
    call = documents(s, DEVICE)
    q, k, v, dout = leaves(1, s, seed, None)
    cols = columns(call, q, k, v)
    cols = {n: fn for n, fn in cols.items() if "unfused" not in n}
    result = {}
    grad_bytes = 3 * q.numel() * q.element_size()
    for name, fn in cols.items():
        run = step(fn, q, k, v, dout, TRAIN)
        try:
            torch.cuda.synchronize()
            inputs = torch.cuda.memory_allocated()  # q, k, v, dout, the mask: no gradients yet
            run()  # compiles; builds what the column caches (a BlockMask, a bias): counted below
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            result[name] = {"peak_beyond_inputs_and_grads_gib": (peak - inputs - grad_bytes) / 2 ** 30}
        except torch.cuda.OutOfMemoryError as exc:
            result[name] = {"error": f"OutOfMemoryError: {str(exc)[:200]}"}
        except Exception as exc:  # noqa: BLE001 - recorded
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        q.grad = k.grad = v.grad = None
        torch.cuda.empty_cache()
    return {"s": s, "mask_bytes_gib": call.keep.numel() / 2 ** 30, "columns": result}


def environment() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": py_platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
            "platform": Platform.detect().describe(), "dtype": str(DTYPE), "train": TRAIN,
            "timer": dataclasses.asdict(SETTINGS)}
    for name, dist in (("triton", "triton"), ("cudnn_frontend", "nvidia-cudnn-frontend"),
                       ("flash_attn_4", "flash-attn-4")):
        try:
            info[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[name] = "absent"
    return info


def facts_since(before: runtime_facts.RuntimeFacts) -> dict:
    """Engines that failed to load, and kinds of call a compile refused, since `before` (this process's facts)."""
    now = runtime_facts.current()
    return {"load_failures": {k: v for k, v in now.load_failures.items() if k not in before.load_failures},
            "rejections": {repr(k): v for k, v in now.rejections.items() if k not in before.rejections}}


def main() -> int:
    global DEVICE, TRAIN, H, D
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--memory-s", type=int, default=32768, help="S of the peak-memory run (0: skip it)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of the script (tiny sizes, inference: FlexAttention has no CPU "
                             "backward)")
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--inference", action="store_true",
                        help="time and check the forward alone (no grad), as an inference call runs")
    args = parser.parse_args()
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: {', '.join(unknown)} unknown; choose from {', '.join(CASES)}")
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cpu":
        TRAIN, H, D = False, 2, 32
    elif not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu for a smoke run)")
    TRAIN = TRAIN and not args.inference
    selection.clear_cache()
    result = {"environment": environment(), "calls": [], "errors": {}}
    t_start = time.perf_counter()
    for n, name in enumerate(names):
        s = CASES[name][1] if DEVICE.type == "cuda" else 256
        try:
            before = runtime_facts.current()
            row = run_call(name, s, args.seed + n)
            row["facts_learned"] = facts_since(before)  # why an engine dropped out of this call's columns
            result["calls"].append(row)
            print(f"{name}: default {row['default_pick']}; " + ", ".join(
                f"{c} {t:.2f} ms ({row['tflops'][c]:.0f} TFLOP/s)" for c, t in sorted(row["times_ms"].items(),
                                                                                   key=lambda x: x[1])), flush=True)
        except Exception:  # noqa: BLE001 - one failing call must not lose the others
            result["errors"][name] = traceback.format_exc()[-2000:]
            print(f"{name}: failed\n{result['errors'][name]}", file=sys.stderr, flush=True)
    if args.memory_s and DEVICE.type == "cuda":
        try:
            result["memory"] = peak_memory(args.memory_s, args.seed)
            print("memory:", json.dumps(result["memory"]["columns"]), flush=True)
        except Exception:  # noqa: BLE001
            result["errors"]["memory"] = traceback.format_exc()[-2000:]
    result["wall_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
