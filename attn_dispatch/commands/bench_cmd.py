"""Time every eligible engine on this machine over a grid of shapes, or one shape given with the call flags.

Writes JSON (--out), prints a table (TFLOP/s per engine, the fastest starred, each policy's pick with
time(pick)/time(fastest)) and writes a PNG plot (--plot, needs matplotlib). With no call flags and no --shapes
the grid is --grid (default: 'default' on a GPU, 'quick' on the CPU). The measured policy's pick comes from
its own tuning pass (cache: --cache-dir, else the usual cache directory); the checked policy's (--policies ...,checked)
from its own, into a cache of its own for the run.

Exit status: 0 when every shape had at least one engine timed, 1 otherwise, 2 on bad arguments."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..platform import Platform
from ..benchmarking.bench import EVAL_SETTINGS
from .common import add_call_arguments, params_from
from ..benchmarking.grid import GRIDS, load_shapes
from ..benchmarking.bench import BenchConfig, render_table, report, run_bench
from ..policy.measured import MeasuredPolicy
from ..policy.timing import TimerSettings
from ..benchmarking.plot import plot_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_call_arguments(parser)
    g = parser.add_argument_group("what to run")
    g.add_argument("--grid", choices=("default", "quick"), default=None,
                   help="a built-in grid (used when no call flag and no --shapes is given)")
    g.add_argument("--shapes", default=None, metavar="FILE", help="JSON list of AttentionParams objects "
                   "(format: attn_dispatch/policy/grid.py)")
    g.add_argument("--modes", default="fwd,fwd_bwd", help="comma list of fwd, fwd_bwd (default both)")
    g.add_argument("--providers", default=None, help="time only these, comma list of families or family:provider")
    g.add_argument("--policies", default="auto,order,measured",
                   help="policies whose picks are marked: auto (the default policy), order, measured, checked")
    t = parser.add_argument_group("timing")
    defaults = EVAL_SETTINGS
    t.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed calls per engine (first ones compile)")
    t.add_argument("--reps", type=int, default=defaults.reps, help="at least this many timed rounds per shape")
    t.add_argument("--max-reps", type=int, default=defaults.max_reps)
    t.add_argument("--target-ms", type=float, default=defaults.target_ms,
                   help="keep timing (up to max-reps) until the fastest engine has run this long")
    t.add_argument("--warm-ms", type=float, default=defaults.warm_ms,
                   help="untimed interleaved rounds before timing, for the GPU clock to settle")
    t.add_argument("--cache-dir", default=None, help="measured policy's cache directory (default: the usual)")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default="attn-dispatch-bench.json", help="JSON result file")
    o.add_argument("--plot", default=None, help="PNG plot (default: --out with .png); 'none' for no plot")
    o.add_argument("--no-progress", action="store_true")


def _explicit_call_flags(args: argparse.Namespace) -> bool:
    defaults = argparse.ArgumentParser()
    add_call_arguments(defaults)
    blank = vars(defaults.parse_args([]))
    return any(getattr(args, name) != value for name, value in blank.items())


def _comma_list(flag: str, text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{flag}={text!r} names nothing; give a comma-separated list")
    return items


def shapes_for(args: argparse.Namespace, platform: Platform) -> list:
    if args.shapes:
        if args.grid or _explicit_call_flags(args):
            raise ValueError("--shapes cannot be combined with --grid or call flags (--seqlen, ...)")
        return load_shapes(args.shapes)
    if _explicit_call_flags(args):
        if args.grid:
            raise ValueError("--grid cannot be combined with call flags (--seqlen, ...): give one or the other")
        return [params_from(args, platform)]
    name = args.grid or ("default" if platform.device_type == "cuda" else "quick")
    return GRIDS[name](device_type=platform.device_type)


def run(args: argparse.Namespace) -> int:
    platform = Platform.detect()
    config = BenchConfig(
        modes=_comma_list("--modes", args.modes), policies=_comma_list("--policies", args.policies),
        providers=_comma_list("--providers", args.providers), show_progress=not args.no_progress,
        settings=TimerSettings(warmup=args.warmup, reps=args.reps, max_reps=args.max_reps, target_ms=args.target_ms,
                               warm_ms=args.warm_ms))
    shapes = shapes_for(args, platform)
    measured = MeasuredPolicy(directory=args.cache_dir) if "measured" in config.policies else None
    rows = run_bench(shapes, platform, config, measured=measured)
    result = report(rows, platform, config)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot_note = ""
    if (args.plot or "").lower() != "none":
        plot_path = Path(args.plot) if args.plot else out.with_suffix(".png")
        try:
            plot_note = f", plot: {plot_bench(result, plot_path)}"
        except ImportError as exc:
            plot_note = f", no plot ({exc})"
    print(render_table(result))
    print(f"results: {out}{plot_note}")
    return 0 if all(row["fastest"] for row in rows) else 1
