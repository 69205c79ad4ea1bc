"""Issue 16 on one GPU: the per-block calls context parallelism makes, on the real engines.

For each block kind the CP code declares (constraints.context_parallel.block_params) for
  - p2p causal at 32k total tokens on 2 GPUs (the 90% target's blocks), and
  - windowed causal (left 4096) under p2p and all_gather at 128k on 2 GPUs,
it (1) checks every eligible engine's output, lse and dq/dk/dv on the block's geometry scaled down
(same masks and window relative to the block) against a float64 reference (tests/reference.py), and
(2) times every eligible engine on the full-size block, forward + backward into leaf .grad, interleaved call by
call with CUDA events after warm-up, and reports whether selection's pick (the default policy) was the fastest.
JSON: $OUT/issue16.json (or --out). Must finish within 3 minutes on an H100 (a deadline skips the rest).

  PYTHONPATH=$PWD python3 benchmarks/gpu/check_issue16.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from attn_dispatch import AttentionParams, explain  # noqa: E402
from attn_dispatch.backends import AttnAux, AttnConfig, get_engine  # noqa: E402
from attn_dispatch.constraints.context_parallel import block_params  # noqa: E402
from reference import reference_attention  # noqa: E402

DEADLINE_S = 160
TOL = 2e-2
H, D = 16, 128


def cp_calls() -> list[tuple[str, AttentionParams]]:
    base = dict(dtype="bf16", num_heads=H, head_dim_qk=D, attn_mask_type="causal", cp_size=2)
    return [("p2p causal 32k/2", AttentionParams(max_seqlen_q=16384, cp_comm_type="p2p", **base)),
            ("p2p causal window 4096, 128k/2", AttentionParams(max_seqlen_q=65536, cp_comm_type="p2p",
                                                               window_size=(4096, 0), **base)),
            ("all_gather causal window 4096, 128k/2", AttentionParams(max_seqlen_q=65536, cp_comm_type="all_gather",
                                                                      window_size=(4096, 0), **base))]


def scaled(p: AttentionParams, factor: int) -> AttentionParams:
    """The block shrunk by `factor` (lengths and window), the same mask relative to the block."""
    w = tuple(x if x < 0 else max(x // factor, 0) for x in p.window_size)
    return p.replace(max_seqlen_q=max(p.max_seqlen_q // factor, 1), max_seqlen_kv=max(p.max_seqlen_kv // factor, 1),
                     window_size=w, batch_size=1, num_heads=4, num_gqa_groups=4)


def tensors(p: AttentionParams, grad: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, h, d: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(p.max_seqlen_q, p.num_heads, D), mk(p.max_seqlen_kv, p.num_gqa_groups, D), \
        mk(p.max_seqlen_kv, p.num_gqa_groups, D)
    dout = mk(p.max_seqlen_q, p.num_heads, D)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def cfg_aux(p: AttentionParams) -> tuple[AttnConfig, AttnAux]:
    cfg = AttnConfig(qkv_format="bshd", attn_mask_type=p.attn_mask_type, window_size=p.window_size,
                     softmax_scale=D ** -0.5)
    return cfg, AttnAux(max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(provider: str, p: AttentionParams) -> dict:
    small = scaled(p, 16)
    q, k, v, dout = tensors(small, True, seed=1)
    cfg, aux = cfg_aux(small)
    out, lse, _ = get_engine(provider)(q, k, v, aux, cfg)
    out.backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*leaves, qkv_format="bshd", attn_mask_type=small.attn_mask_type,
                                       window_size=small.window_size, softmax_scale=D ** -0.5)
    ref.backward(dout.double())
    finite = torch.isfinite(ref_lse)
    errs = {"out": rel(out, ref), "lse_max_abs": float((lse.double() - ref_lse)[finite].abs().max()),
            "dq": rel(q.grad, leaves[0].grad), "dk": rel(k.grad, leaves[1].grad), "dv": rel(v.grad, leaves[2].grad)}
    ok = max(errs["out"], errs["dq"], errs["dk"], errs["dv"]) <= TOL and errs["lse_max_abs"] <= 5e-2
    return {"small_shape": [small.max_seqlen_q, small.max_seqlen_kv, small.window_size], "errors": errs, "ok": ok}


def time_engines(providers: list[str], p: AttentionParams, rounds: int = 12, warm: int = 3) -> dict[str, float]:
    """fwd+bwd ms per provider (median), interleaved call by call in rotating order."""
    q, k, v, dout = tensors(p, True)
    cfg, aux = cfg_aux(p)
    engines = {name: get_engine(name) for name in providers}

    def step(name):
        out, _, _ = engines[name](q, k, v, aux, cfg)
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None
    for _ in range(warm):
        for name in providers:
            step(name)
    torch.cuda.synchronize()
    times = {name: [] for name in providers}
    for r in range(rounds):
        order = providers[r % len(providers):] + providers[:r % len(providers)]
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(name)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "issue16.json"))
    args = ap.parse_args()
    started = time.time()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability()),
                          "torch": torch.__version__, "cuda": torch.version.cuda,
                          "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
                          "policy": os.environ.get("ATTN_DISPATCH_POLICY")},
              "rows": []}
    try:
        from importlib.metadata import version
        report["machine"]["packages"] = {}
        for dist_name in ("nvidia-cudnn-frontend", "flash-attn-4", "flash-attn", "flash_attn_3"):
            try:
                report["machine"]["packages"][dist_name] = version(dist_name)
            except Exception:  # noqa: BLE001 - not installed
                pass
    except ImportError:
        pass
    seen = set()
    for call_name, call in cp_calls():
        row_call = {"call": call_name, "params": call.describe()}
        try:
            cp_decision = explain(call)
            row_call["cp_decision"] = cp_decision.chosen
            row_call["cp_rejected"] = {v.id: [r.message for r in v.reasons][:2] for v in cp_decision.verdicts
                                       if not v.eligible}
            blocks = block_params(call)
        except Exception as exc:  # noqa: BLE001
            report["rows"].append(dict(row_call, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()))
            continue
        for block in blocks:
            key = (block.max_seqlen_q, block.max_seqlen_kv, block.attn_mask_type, block.window_size)
            if key in seen:
                continue
            seen.add(key)
            row = dict(row_call, block=list(key))
            report["rows"].append(row)
            if time.time() - started > DEADLINE_S:
                row["skipped"] = "deadline"
                continue
            try:
                decision = explain(block)
                row["selected"] = decision.chosen
                eligible = [v.id for v in decision.verdicts if v.eligible and v.backend != "unfused"]
                row["eligible"] = eligible
                row["checks"] = {}
                for provider in eligible:
                    try:
                        row["checks"][provider] = check(provider, block)
                    except Exception as exc:  # noqa: BLE001 - one engine failing does not stop the others
                        row["checks"][provider] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
                good = [name for name in eligible if row["checks"][name].get("ok")]
                if good and time.time() - started < DEADLINE_S:
                    ms = time_engines(good, block)
                    row["fwd_bwd_ms"] = ms
                    best = min(ms, key=ms.get)
                    row["fastest"] = best
                    if decision.chosen in ms:
                        row["selected_over_fastest"] = ms[decision.chosen] / ms[best]
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                row["trace"] = traceback.format_exc()[-2000:]
            torch.cuda.empty_cache()
    report["seconds"] = time.time() - started
    report["all_checks_ok"] = all(c.get("ok") for r in report["rows"] for c in r.get("checks", {}).values())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"{report['machine']}\nchecks ok: {report['all_checks_ok']}; {report['seconds']:.0f} s; JSON: {args.out}\n")
    print("| call | block (sq, skv, mask, window) | selected | fastest | selected/fastest | checks |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        checks = ", ".join(f"{k}:{'ok' if c.get('ok') else 'FAIL'}" for k, c in r.get("checks", {}).items())
        ratio = r.get("selected_over_fastest")
        print(f"| {r['call']} | {tuple(r.get('block', ()))} | {r.get('selected')} | {r.get('fastest')} | "
              f"{f'{ratio:.3f}' if ratio else '-'} | {checks or r.get('error', r.get('skipped', '-'))[:80]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
