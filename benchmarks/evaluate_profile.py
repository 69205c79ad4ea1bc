"""Offline check of the shipped profile's predictions against measured rows (no GPU needed).

For each row of a bench_user_step.py result: the provider the profile predicts fastest among those the row timed
(optionally only torch's own providers, as on a stock `pip install torch`), and time(pick) / time(fastest).
--loo: leave-one-out on the profile's own fit rows (each row predicted without itself, its neighbours and host
floors both). --timed: the run's own default (and measured) columns, timed on the GPU.

    python3 benchmarks/evaluate_profile.py benchmarks/results/profile/eval_h100.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402

TORCH_PROVIDERS = ("flash_attn_2:torch", "cudnn_fused:torch", "unfused:pytorch")


def evaluate(rows: list[dict], profile: Profile, *, loo: bool, stock: bool) -> list[dict]:
    out = []
    for row in rows:
        times = {n: t for n, t in row["times_ms"].items() if ":" in n and (not stock or n in TORCH_PROVIDERS)}
        if not times:
            continue
        pred = profile.predict(AttentionParams(**row["params"]), exclude_label=row["label"] if loo else None)
        candidates = sorted(times, key=times.get)
        pick = pred.best(list(times)) or candidates[0]
        best = times[candidates[0]]
        sdpa = row["times_ms"].get("sdpa")
        out.append({"label": row["label"], "pick": pick, "fastest": candidates[0], "ratio": times[pick] / best,
                    "vs_sdpa": times[pick] / sdpa if sdpa else None})
    return out


def summarize(name: str, results: list[dict]) -> None:
    ratios = [r["ratio"] for r in results]
    worst = max(results, key=lambda r: r["ratio"])
    sd = [r["vs_sdpa"] for r in results if r["vs_sdpa"]]
    print(f"{name}: {len(ratios)} rows, mean {statistics.mean(ratios):.3f}, worst {worst['ratio']:.3f} "
          f"({worst['label']}: picked {worst['pick']}, fastest {worst['fastest']}), "
          f"{sum(r > 1.03 for r in ratios)} over 1.03"
          + (f"; vs SDPA worst {max(sd):.3f} mean {statistics.mean(sd):.3f}" if sd else ""))


def timed(path: str) -> None:
    """What the GPU run itself measured (bench_user_step.py --policies [--measured]): the default module's and the
    measured policy's time over the fastest provider forced, over SDPA, and default / its own pick forced (the
    same engine in two modules: the timer's noise on that row)."""
    rows = json.loads(Path(path).read_text())["rows"]
    stats: dict[str, list[tuple[float, str]]] = {"default/fastest": [], "measured/fastest": [], "default/sdpa": [],
                                                 "default/pick forced": [], "measured pick forced/fastest": [],
                                                 "measured/pick forced": [], "A/A twin/pick": []}
    for row in rows:
        t = row["times_ms"]
        forced = {n: v for n, v in t.items() if ":" in n}
        if not forced or "default" not in t:
            continue
        best = min(forced.values())
        stats["default/fastest"].append((t["default"] / best, row["label"]))
        if "measured" in t:
            stats["measured/fastest"].append((t["measured"] / best, row["label"]))
        if "sdpa" in t:
            stats["default/sdpa"].append((t["default"] / t["sdpa"], row["label"]))
        if row.get("default_pick") in forced:
            stats["default/pick forced"].append((t["default"] / forced[row["default_pick"]], row["label"]))
        if row.get("measured_pick") in forced:  # the measured policy's pick, timed as a forced module
            stats["measured pick forced/fastest"].append((forced[row["measured_pick"]] / best, row["label"]))
            if "measured" in t:  # far from 1: the measured column ran another engine (the session-4 harness)
                stats["measured/pick forced"].append((t["measured"] / forced[row["measured_pick"]], row["label"]))
        if "aa_ratio" in row:
            stats["A/A twin/pick"].append((row["aa_ratio"], row["label"]))
    print(f"{Path(path).name} (timed, {len(rows)} rows):")
    for name, values in stats.items():
        if values:
            worst = max(values)
            print(f"  {name:28s} mean {statistics.mean(v for v, _ in values):.3f}  worst {worst[0]:.3f} ({worst[1]})  "
                  f"over 1.03: {sum(v > 1.03 for v, _ in values)}/{len(values)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--profile", default=str(PROFILE_DIR / "sm90.json"))
    ap.add_argument("--loo", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--timed", action="store_true", help="also summarise the run's own timed default/measured columns")
    args = ap.parse_args()
    profile = Profile(json.loads(Path(args.profile).read_text()))
    for path in args.results:
        if args.timed:
            timed(path)
        rows = json.loads(Path(path).read_text())["rows"]
        for stock in (False, True):
            res = evaluate(rows, profile, loo=args.loo, stock=stock)
            summarize(f"{Path(path).name} {'torch providers only' if stock else 'all providers'}", res)
            if args.verbose:
                for r in res:
                    if r["ratio"] > 1.02 or (r["vs_sdpa"] or 0) > 1.02:
                        print(f"   {r['label']:52s} {r['pick']:22s} {r['ratio']:.3f} fastest {r['fastest']} "
                              f"vs sdpa {r['vs_sdpa'] or 0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
