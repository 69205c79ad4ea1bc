"""How close each selection policy gets to the fastest engine, what the module adds per call, and graphs/compile.

1. Grid (attn_dispatch.benchmarking.grid.default_grid: 31 shapes, D 64/128/256, S 512..16k, causal or not, GQA, two
   shapes off the bucket steps), each forward and forward+backward. Per row: the static order's pick
   (selection.preference_order), the measured policy's pick through selection's real hook with an empty cache
   (so it comes from its own tuning pass), then every eligible engine timed again for the evaluation (CUDA
   events, interleaved call by call after a warm period, median; longer than tuning, on other random inputs).
   Reported: time(pick) / time(fastest) per policy; target measured <= 1.03 everywhere.
2. Hot path at a small shape: cached DotProductAttention.forward vs the chosen engine called directly (host
   microseconds per call; target <= 5 us added), in inference, with autograd, and under the measured policy.
3. CUDA graph capture (forward, and forward+backward via make_graphed_callables) and torch.compile (output vs
   eager, compilations after the first call, graph breaks) for the default pick and each eligible engine.

JSON goes to --out after every section (a cut-off run still leaves results), the PNG next to it (needs
matplotlib; else `--replot OUT.json` elsewhere), the table is printed last.

    python3 benchmarks/bench_policy.py --out $OUT/policy.json         # the GPU run (~4-6 min on an H100)
    python3 benchmarks/bench_policy.py --quick --out /tmp/policy.json # CPU smoke run (tiny grid)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from attn_dispatch import Platform, explain, selection
from attn_dispatch.benchmarking import hotpath
from attn_dispatch.benchmarking.bench import EVAL_SETTINGS, BenchConfig, render_table, report, run_bench
from attn_dispatch.benchmarking.grid import default_grid, quick_grid
from attn_dispatch.policy.measured import TUNING_SETTINGS, MeasuredPolicy
from attn_dispatch.policy.timing import TimerSettings

QUICK = TimerSettings(warmup=1, reps=2, max_reps=2, target_ms=0.0)
QUICK_SHAPE = dict(batch=1, seqlen=16, heads=2, head_dim=16)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    parser.add_argument("--quick", action="store_true", help="tiny grid and few calls (CPU smoke run)")
    parser.add_argument("--providers", default=None, help="time only these (comma list); default every eligible")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: grid, hotpath, graph, compile")
    parser.add_argument("--replot", default=None, metavar="JSON", help="only draw the PNG from an earlier result")
    return parser.parse_args()


class Run:
    """Collects sections into one JSON file, rewritten after each section."""

    def __init__(self, out: Path):
        self.out, self.started, self.result = out, time.perf_counter(), {"sections_s": {}, "errors": {}}

    def section(self, name: str, fn) -> None:
        started = time.perf_counter()
        print(f"== {name} (at {started - self.started:.0f} s)", file=sys.stderr, flush=True)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a broken section is reported; the others still run
            self.result["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
            print(f"   {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self.result["sections_s"][name] = round(time.perf_counter() - started, 1)
        self.result["total_s"] = round(time.perf_counter() - self.started, 1)
        self.save()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=1, default=str))


def grid_section(run: Run, platform: Platform, args: argparse.Namespace) -> None:
    shapes = quick_grid(device_type=platform.device_type) if args.quick else default_grid()
    tune_dir = tempfile.mkdtemp(prefix="attn-dispatch-tune-")
    measured = MeasuredPolicy(directory=tune_dir, settings=QUICK if args.quick else TUNING_SETTINGS)
    providers = tuple(args.providers.split(",")) if args.providers else None
    config = BenchConfig(settings=QUICK if args.quick else EVAL_SETTINGS, providers=providers,
                         extra={"measured_policy": {"cache_dir": tune_dir, "settings": measured.settings.to_dict(),
                                                    "prune_ratio": measured.prune_ratio,
                                                    "buckets": "seqlen: quarter-octave steps; batch: power of two"}})
    def save_partial(rows: list[dict]) -> None:
        if len(rows) % 8 == 0:
            run.result.update(report(rows, platform, config))
            run.save()

    rows = run_bench(shapes, platform, config, measured=measured, on_row=save_partial)
    bench = report(rows, platform, config)
    bench["measured_policy"]["tuning_s_total"] = round(sum(r.get("measured", {}).get("decision_s", 0) for r in rows), 2)
    run.result.update(bench)


def hotpath_section(run: Run, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> None:
    kw = dict(shape=QUICK_SHAPE, calls=50, repeats=3, settle_s=0.0) if args.quick else {}
    hot = run.result["hot_path"] = {"target_added_us": 5.0}
    hot["inference"] = hotpath.overhead(device, dtype, **kw)
    hot["training"] = hotpath.overhead(device, dtype, grad=True, **kw)
    if device.type == "cuda" and not args.quick:
        # The default picks differ by mode (cuDNN frontend in inference, torch's FA2 in training on the H100): each
        # engine in the other mode too, to tell what grad costs the module from what the engine's path costs it.
        for name, provider, grad in (("training_cudnn_frontend", "cudnn_fused:frontend", True),
                                     ("inference_flash_attn_2_torch", "flash_attn_2:torch", False)):
            try:
                hot[name] = hotpath.overhead(device, dtype, backend=provider, grad=grad)
            except Exception as exc:  # noqa: BLE001 - a provider missing here is reported, not fatal
                hot[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    previous = os.environ.get("ATTN_DISPATCH_POLICY")
    selection.set_policy("measured", MeasuredPolicy(directory=tempfile.mkdtemp(prefix="attn-dispatch-hot-"),
                                                    settings=QUICK if args.quick else TUNING_SETTINGS))
    os.environ["ATTN_DISPATCH_POLICY"] = "measured"
    try:
        hot["measured_policy_inference"] = hotpath.overhead(device, dtype, **kw)
    finally:
        if previous is None:
            os.environ.pop("ATTN_DISPATCH_POLICY", None)
        else:
            os.environ["ATTN_DISPATCH_POLICY"] = previous


def small_shape_providers(platform: Platform, dtype: torch.dtype, args: argparse.Namespace) -> list[str | None]:
    """None (the default pick) and every provider eligible at the small shape."""
    from attn_dispatch import AttentionParams

    s = QUICK_SHAPE if args.quick else hotpath.SMALL_SHAPE
    params = AttentionParams(dtype=str(dtype).removeprefix("torch."), batch_size=s["batch"], num_heads=s["heads"],
                             head_dim_qk=s["head_dim"], max_seqlen_q=s["seqlen"], device_type=platform.device_type)
    return [None] + [v.id for v in explain(params, platform, use_cache=False).verdicts if v.eligible]


def graph_section(run: Run, device: torch.device, dtype: torch.dtype, providers: list[str | None],
                  args: argparse.Namespace) -> None:
    shape = QUICK_SHAPE if args.quick else None
    run.result["cuda_graph"] = [hotpath.check_cuda_graph(device, dtype, backend=p, shape=shape) for p in providers]


def compile_section(run: Run, device: torch.device, dtype: torch.dtype, providers: list[str | None],
                    args: argparse.Namespace) -> None:
    shape = QUICK_SHAPE if args.quick else None
    checks = [hotpath.check_compile(device, dtype, compiler="eager" if args.quick else "inductor", shape=shape)]
    checks += [hotpath.check_compile(device, dtype, backend=p, compiler="aot_eager", shape=shape, calls=5)
               for p in providers if p is not None]
    run.result["torch_compile"] = checks


def summary_lines(result: dict) -> list[str]:
    lines = [f"platform: {result.get('platform_text', '?')}; total {result.get('total_s', 0):.0f} s "
             f"(sections: {result.get('sections_s')})"]
    for policy, s in result.get("summary", {}).items():
        if s.get("rated"):
            lines.append(f"{policy} policy: worst time(pick)/time(fastest) = {s['worst_ratio']:.3f} "
                         f"({s['worst_shape']}); mean {s['mean_ratio']:.3f}; {s['over_target']} of {s['rated']} "
                         f"rows over {s['target']}" + (f"; {s['unrated']} rows unrated (pick not timed)"
                                                       if s.get("unrated") else ""))
    for name, hot in result.get("hot_path", {}).items():
        if isinstance(hot, dict) and "error" in hot:
            lines.append(f"hot path [{name}]: FAILED {hot['error']}")
        if isinstance(hot, dict) and "module_over_engine_us" in hot:
            added = hot["module_over_engine_us"]
            engine = hot["results_us"]["engine_call"]
            lines.append(f"hot path [{name}] ({hot['chosen']}): module adds {added['loop_us_min']:.2f} us/call "
                         f"(loop min; engine alone {engine['loop_us_min']:.2f}), {added['loop_us_p10']:.2f} at the "
                         f"10th percentile, {added['paired_loop_us_median']:.2f} median of paired repeats; "
                         f"target <= 5")
    for g in result.get("cuda_graph", []):
        lines.append(f"CUDA graph [{g.get('backend') or 'default'} -> {g.get('chosen')}]: inference "
                     f"{_ok(g.get('inference'))}, fwd+bwd {_ok(g.get('fwd_bwd'))}")
    for c in result.get("torch_compile", []):
        text = f"torch.compile[{c['compiler']}] [{c.get('backend') or 'default'} -> {c.get('chosen')}]: "
        text += (f"ok={c['ok']} matches eager={c.get('matches_eager')}, compilations after the first call="
                 f"{c.get('graphs_after_first_call')}, graph breaks={c.get('graph_breaks')}") if "error" not in c \
            else f"FAILED {c['error'][:200]}"
        lines.append(text)
    for name, error in result.get("errors", {}).items():
        lines.append(f"section {name} FAILED: {error.splitlines()[0]}")
    return lines


def _ok(check: dict | None) -> str:
    if not check:
        return "-"
    return "ok" if check.get("ok") else f"FAILED ({check.get('error', check)})"[:200]


def plot(result: dict, path: Path) -> str:
    from attn_dispatch.benchmarking.plot import plot_bench

    try:
        return f"plot: {plot_bench(result, path)}"
    except ImportError as exc:
        return f"no plot ({exc}); later: python3 benchmarks/bench_policy.py --replot <json> --out <json>"


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    if args.replot:
        print(plot(json.loads(Path(args.replot).read_text()), png))
        return 0
    platform = Platform.detect()
    if platform.device_type != "cuda" and not args.quick:
        print("no CUDA GPU here: run on the GPU machine, or pass --quick for a CPU smoke run", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if platform.device_type == "cuda" else \
        torch.device("cpu")
    dtype = torch.bfloat16 if platform.device_type == "cuda" else torch.float32
    print(f"platform: {platform.describe()}", file=sys.stderr)
    skip = set(filter(None, args.skip.split(",")))
    run = Run(out)
    if "grid" not in skip:
        run.section("grid", lambda: grid_section(run, platform, args))
    if "hotpath" not in skip:
        run.section("hotpath", lambda: hotpath_section(run, device, dtype, args))
    providers = small_shape_providers(platform, dtype, args)
    if "graph" not in skip and device.type == "cuda":
        run.section("graph", lambda: graph_section(run, device, dtype, providers, args))
    if "compile" not in skip:
        run.section("compile", lambda: compile_section(run, device, dtype, providers, args))
    notes = [plot(run.result, png)] if run.result.get("rows") else []
    print("\n".join(summary_lines(run.result) + notes + [f"results: {out}"]))
    if run.result.get("rows"):
        print(render_table(run.result))
    return 1 if run.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
