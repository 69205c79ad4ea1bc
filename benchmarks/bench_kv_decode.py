"""KV-cache inference on a GPU, per engine: equality and decode bandwidth. One process, <= 8 minutes.

1. Equality: each engine that takes a cache, forced (flash_attn_2:torch, flash_attn_4:cute, cudnn_fused:frontend,
   unfused), contiguous and paged, bshd and thd, GQA 8/2, with and without a sliding window: the generation loop
   of benchmarking/kv_loop.py (prompts join, decode, chunked prefill, reorder, leave) in bf16 against float64
   attention over each sequence's whole prefix; worst |err| <= 2e-2. A combination the engine's table refuses is
   listed with the reason.
2. Decode step time, 32 query / 8 KV heads, D=128, bf16, causal, for B=32 at context 8k and B=1 at 32k:
   - module:<engine> / module:default: DotProductAttention(inference_params=) forced to each engine, and with
     the default policy (its pick recorded), one layer per alternative: append the step's token, attend;
   - kernel:<engine>: the call the module makes after the append (engine.forward_kv_cache) on a fixed cache view;
   - paged:<engine>: the module on a paged cache (page_size 256: torch FA2's minimum), where the engine takes it;
   - sdpa: torch.nn.functional.scaled_dot_product_attention on the same contiguous cache rows (enable_gqa, one
     query that sees every cached key).
   Interleaved call by call in balanced round orders (policy/timing.py's round_order), each call between two CUDA
   events; one pre_step per round (untimed) advances every cache by a token. Reported: median ms, achieved K/V
   read bandwidth (bytes of K and V the step must read / time) and its fraction of the card's copy bandwidth,
   measured here as a 1 GiB device-to-device copy (bytes read + written / time). Target: >= 0.7 for B=32.
3. Which kernels each alternative launches (torch.profiler, one call each): split-KV shows as *splitkv* / combine
   kernels.
JSON to $OUT/kv_decode.json (machine, versions, date); a short table last.

    PYTHONPATH=$PWD python3 benchmarks/bench_kv_decode.py [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time
import traceback
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attn_dispatch as ad  # noqa: E402
from attn_dispatch import NoBackendAvailableError  # noqa: E402
from attn_dispatch.benchmarking.kv_loop import run_generation  # noqa: E402
from attn_dispatch.policy.timing import round_order  # noqa: E402

ENGINES = ("flash_attn_2:torch", "flash_attn_4:cute", "cudnn_fused:frontend", "unfused:pytorch")
EQ_PAGES = {"flash_attn_2:torch": 256, "flash_attn_4:cute": 64, "cudnn_fused:frontend": 64, "unfused:pytorch": 64}
TOL = 2e-2
H, HKV, D = 32, 8, 128
DECODE_CASES = ((32, 8192), (1, 32768))
DECODE_PAGE = 256
MARGIN = 512  # tokens of room per sequence for the timed rounds
OUT = Path(os.environ.get("OUT", "/tmp"))
result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "equality": [], "decode": [], "errors": {}}


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kv_decode.json").write_text(json.dumps(result, indent=1, default=str))


def versions() -> dict:
    found = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None}
    for dist in ("nvidia-cudnn-frontend", "flash-attn-4", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import cudnn
        found["cudnn_backend"] = cudnn.backend_version()
    except Exception as exc:  # noqa: BLE001 - informational
        found["cudnn_backend"] = f"unavailable: {exc}"
    return found


# --- 1. equality -------------------------------------------------------------------------------------------
def equality() -> None:
    for engine in ENGINES:
        for paged in (False, True):
            for fmt in ("thd", "bshd"):
                for window in (-1, 24):
                    page = EQ_PAGES[engine] if paged else None
                    max_len = 256
                    row = {"engine": engine, "cache": f"paged({page})" if paged else "contiguous", "fmt": fmt,
                           "window": window}
                    start = time.perf_counter()
                    try:
                        got = run_generation(fmt, paged, window, dtype=torch.bfloat16, device="cuda", heads=8,
                                             kv_heads=2, head_dim=64, max_len=max_len, page_size=page or 4,
                                             total_pages=6 * max_len // page if paged else None, backend=engine)
                        row.update(worst_abs_err=got["worst_abs_err"], padding_zero=got["padding_zero"],
                                   ok=got["worst_abs_err"] <= TOL and got["padding_zero"] and got["chosen"] == [engine])
                    except NoBackendAvailableError as exc:
                        verdict = exc.decision.verdict(*engine.split(":"))
                        row.update(refused="; ".join(r.message for r in verdict.reasons)[:300], ok=True)
                    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                        row.update(error=f"{type(exc).__name__}: {exc}"[:400], ok=False)
                    row["seconds"] = round(time.perf_counter() - start, 2)
                    result["equality"].append(row)
                    save()


# --- 2. decode ---------------------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read + written (median of 20)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def _cache(batch: int, ctx: int, paged: bool, layers: int) -> ad.InferenceParams:
    """An InferenceParams whose sequences hold ctx - 1 random tokens in each of `layers` layers."""
    ip = ad.InferenceParams(batch, ctx + MARGIN, HKV, D, torch.bfloat16, is_paged=paged,
                            page_size=DECODE_PAGE if paged else None, qkv_format="thd")
    for layer in range(1, layers + 1):
        ip.allocate_memory(layer)
        for cache in ip._caches[layer]:
            cache.normal_()
    ip.pre_step(OrderedDict((f"s{i}", ctx - 1) for i in range(batch)))
    return ip


def decode_case(batch: int, ctx: int, rounds: int) -> dict:
    torch.manual_seed(0)
    row: dict = {"batch": batch, "context": ctx, "heads": H, "kv_heads": HKV, "head_dim": D,
                 "kv_bytes": 2 * batch * ctx * HKV * D * 2, "times_ms": {}, "errors": {}, "kernels": {}}
    names = [f"module:{e}" for e in ENGINES] + ["module:default"]
    contiguous = _cache(batch, ctx, False, len(names))
    paged_engines = [e for e in ENGINES if e != "unfused:pytorch"] + ["default"]
    paged = _cache(batch, ctx, True, len(paged_engines))
    modules: dict = {}
    for i, name in enumerate(names):
        backend = None if name.endswith("default") else name.split(":", 1)[1]
        modules[name] = (contiguous, ad.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd",
                                                            attn_mask_type="padding_causal", layer_number=i + 1,
                                                            backend=backend).eval())
    for i, engine in enumerate(paged_engines):
        backend = None if engine == "default" else engine
        modules[f"paged:{engine}"] = (paged, ad.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format="thd",
                                                                    attn_mask_type="padding_causal",
                                                                    layer_number=i + 1, backend=backend).eval())
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    one = OrderedDict((f"s{i}", 1) for i in range(batch))

    def step_all() -> None:
        contiguous.pre_step(one)
        paged.pre_step(one)

    fns: dict = {}
    for name, (ip, module) in modules.items():
        fns[name] = (lambda ip=ip, module=module: module(q, kv, kv, inference_params=ip))
    # First round: every module decides (and compiles); the refused ones are recorded and dropped.
    step_all()
    with torch.no_grad():
        for name in list(fns):
            try:
                fns[name]()
                row.setdefault("chosen", {})[name] = modules[name][1].last_decision.chosen
            except Exception as exc:  # noqa: BLE001
                row["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
                del fns[name]
    # kernel rows: the engine call the module makes after its append, on that step's (fixed) view
    layer_of = {name: i + 1 for i, name in enumerate(names)}
    for name in [n for n in names if n in fns and n != "module:default"]:
        module = modules[name][1]
        plan = next(iter(module._plans.kv_cache.values()))
        view = contiguous.append(layer_of[name], kv, kv)  # rewrites the step's token: the same view as the call
        cu_q = contiguous.current_step.cu_q
        fns[f"kernel:{name.split(':', 1)[1]}"] = (lambda plan=plan, view=view, cu_q=cu_q:
                                                   plan.engine.forward_kv_cache(q, view, cu_q, 1, plan.cfg))
    k_rows, v_rows = contiguous._caches[1]
    k_sdpa = k_rows[:batch, :ctx].permute(0, 2, 1, 3)  # [b, hkv, ctx, d] views of the cache rows
    v_sdpa = v_rows[:batch, :ctx].permute(0, 2, 1, 3)
    q_sdpa = q.view(batch, H, 1, D)
    fns["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)
    # warm-up rounds (each new alternative's first calls), then timed rounds
    samples: dict = {name: [] for name in fns}
    order = list(fns)
    with torch.no_grad():
        for r in range(rounds):
            step_all()
            marks = []
            for name in round_order(order, r):
                if name not in fns:
                    continue
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    fns[name]()
                except Exception as exc:  # noqa: BLE001
                    row["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
                    del fns[name]
                    continue
                end.record()
                marks.append((name, start, end))
            torch.cuda.synchronize()
            if r >= 3:
                for name, start, end in marks:
                    samples[name].append(start.elapsed_time(end))
    bandwidth = result["copy_bandwidth_bytes_per_s"]
    for name, times in samples.items():
        if times:
            ms = statistics.median(times)
            row["times_ms"][name] = {"median": round(ms, 4), "min": round(min(times), 4), "n": len(times),
                                     "kv_bytes_per_s": row["kv_bytes"] / (ms / 1e3),
                                     "fraction_of_copy": round(row["kv_bytes"] / (ms / 1e3) / bandwidth, 3)}
    row["kernels"] = kernels_of({name: fns[name] for name in fns})
    return row


def kernels_of(fns: dict) -> dict:
    """The CUDA kernels one call of each alternative launches (names shortened)."""
    from torch.profiler import ProfilerActivity, profile

    found = {}
    with torch.no_grad():
        for name, fn in fns.items():
            if name.startswith("module:") or name.startswith("paged:"):
                continue  # the kernel rows run the same engines without the cache bookkeeping
            try:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                found[name] = sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})
            except Exception as exc:  # noqa: BLE001
                found[name] = [f"profiler failed: {exc}"[:120]]
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no equality grid (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    props = torch.cuda.get_device_properties(0)
    result.update(machine={"device": props.name, "sms": props.multi_processor_count,
                           "memory_gib": round(props.total_memory / 2**30, 1)}, versions=versions())
    started = time.perf_counter()
    if not args.quick:
        try:
            equality()
        except Exception:  # noqa: BLE001
            result["errors"]["equality"] = traceback.format_exc()[-2000:]
    result["equality_seconds"] = round(time.perf_counter() - started, 1)
    result["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    for batch, ctx in DECODE_CASES:
        try:
            result["decode"].append(decode_case(batch, ctx, rounds=12 if args.quick else 60))
        except Exception:  # noqa: BLE001
            result["errors"][f"decode B={batch} ctx={ctx}"] = traceback.format_exc()[-2000:]
        save()
        torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    save()
    print_summary()
    return 0 if all(r.get("ok") for r in result["equality"]) and not result["errors"] else 1


def print_summary() -> None:
    print(f"\n{result['machine']['device']} ({result['machine']['sms']} SMs); {result['versions']}")
    print(f"copy bandwidth (read + write): {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    bad = [r for r in result["equality"] if not r.get("ok")]
    refused = [r for r in result["equality"] if "refused" in r]
    print(f"equality: {len(result['equality']) - len(bad)}/{len(result['equality'])} ok "
          f"({len(refused)} refused by their table), worst err "
          f"{max((r.get('worst_abs_err', 0) for r in result['equality']), default=0):.4f} (tol {TOL})")
    for r in bad:
        print(f"  FAIL {r}")
    for row in result["decode"]:
        print(f"\ndecode B={row['batch']} context={row['context']} ({row['kv_bytes'] / 1e6:.0f} MB of K/V); "
              f"default picks {row.get('chosen', {}).get('module:default')} (paged: "
              f"{row.get('chosen', {}).get('paged:default')})")
        print(f"  {'alternative':34s} {'ms':>9s} {'TB/s':>7s} {'of copy':>8s}  split-KV kernels")
        for name, t in sorted(row["times_ms"].items(), key=lambda kv: kv[1]["median"]):
            split = [k for k in row["kernels"].get(name, []) if "split" in k.lower() or "combine" in k.lower()]
            print(f"  {name:34s} {t['median']:9.4f} {t['kv_bytes_per_s'] / 1e12:7.2f} {t['fraction_of_copy']:8.2f}"
                  f"  {'yes' if split else ('-' if name in row['kernels'] else '')}")
        for name, err in row["errors"].items():
            print(f"  {name}: {err[:150]}")
    for name, err in result["errors"].items():
        print(f"ERROR {name}: {err[-600:]}")
    print(f"\ntotal {result.get('seconds')} s; JSON: {OUT / 'kv_decode.json'}")


if __name__ == "__main__":
    sys.exit(main())
