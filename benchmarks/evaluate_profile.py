"""Offline check of the profile's predictions against measured rows (no GPU needed).

For each row of a bench_user_step.py result: the provider the profile predicts fastest among those the row timed
(optionally only torch's own providers, as on a stock `pip install torch`), and time(pick) / time(fastest). The
prediction is made for the row's machine (its run's device name), as the platform would on that machine; a packed
case with its own lengths carries their fills (as the module reads them from cu_seqlens), and where the profile
predicts none of the providers the pick is the run's recorded order pick (the policy's fallback).

    python3 benchmarks/evaluate_profile.py FILE...            # against the shipped profile
    python3 benchmarks/evaluate_profile.py --timed FILE...    # also the run's own timed default/measured columns
    python3 benchmarks/evaluate_profile.py --protocols FILE... # the model-selection protocols over these files:
    python3 benchmarks/evaluate_profile.py --model host_scale=0.9 --summary FILE...
        # a profile rebuilt from the shipped sources with these CostModel settings; --summary: one line over all
        # the files (mean, mean of each file's worst, worst, rows over 1.05): how a CostModel setting is compared

--protocols: the files are pooled (every run of a call on a machine combined, as build_profile.py does), then
- leave-one-out: each pooled entry predicted with every entry of its shape (on any machine) left out of the
  neighbours and the host floors;
- leave-one-grid-out: for each grid (the runs' `grid`), a profile built from the other grids' runs predicts that
  grid's pooled entries; and the files named by --holdout each predicted by a profile without their grid.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.policy.cost_model import COST_MODEL, CostModel  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402
from attn_dispatch.policy.profile_build import build, fills_of, pooled_calls  # noqa: E402
from build_profile import load_runs  # noqa: E402

# torch's own providers: what a stock `pip install torch` has
TORCH_PROVIDERS = ("flash_attn_2:torch", "cudnn_fused:torch", "flex_attention:torch", "mem_efficient:torch",
                   "unfused:pytorch")
HOLDOUT = ("fresh_h100_rerun.json.gz", "eval_h100_final.json.gz", "eval_h200.json.gz")


def forced_times(all_times: dict[str, float], stock: bool) -> dict[str, float]:
    """A row's providers forced (the columns named family:provider), torch's own only where `stock`."""
    return {n: t for n, t in all_times.items() if ":" in n and (not stock or n in TORCH_PROVIDERS)}


def call_of(params: dict, case: dict | None = None) -> AttentionParams:
    """A row's call as the module asks it: a packed case with its own lengths (Case.seqlens) carries their fills."""
    lengths = tuple((case or {}).get("seqlens") or ())
    if not lengths:
        return AttentionParams(**params)
    return AttentionParams(**{**params, **fills_of(params, lengths)})


def score(profile: Profile, label: str, params: dict, all_times: dict[str, float], machine: str, *, leave_out: bool,
          stock: bool, sdpa: float | None = None, case: dict | None = None,
          order_pick: str | None = None) -> dict | None:
    """The profile's pick over the fastest of the providers the row timed, compared as the policy compares them:
    the unfused engine left out while another was timed (the last resort on a GPU), a provider without a rate
    predicted relative to the others on a packed call (Profile.predict's among). Where the profile predicts none of
    them, the policy takes Transformer Engine's order: the row's recorded order pick (else the fastest, for rows
    without one)."""
    times = forced_times(all_times, stock)
    if not times:
        return None
    compared = [p for p in times if not p.startswith("unfused:")] or list(times)
    pred = profile.predict(call_of(params, case), machine=machine, leave_out=leave_out, among=compared)
    fastest = min(times, key=times.get)
    predicted = pred.best(compared)
    pick = predicted or (order_pick if order_pick in compared else min(compared, key=times.get))
    return {"label": label, "machine": machine, "pick": pick, "fastest": fastest,
            "ratio": times[pick] / times[fastest], "vs_sdpa": times[pick] / sdpa if sdpa else None,
            "predicted": bool(predicted)}


def evaluate(rows: list[dict], profile: Profile, machine: str, *, stock: bool, leave_out: bool = False) -> list[dict]:
    found = (score(profile, r["label"], r["params"], r["times_ms"], machine, leave_out=leave_out, stock=stock,
                   sdpa=r["times_ms"].get("sdpa"), case=r.get("case"), order_pick=r.get("order_pick")) for r in rows)
    return [r for r in found if r]


def pooled(profile_runs: list[dict], target_runs: list[dict], model: CostModel, *, leave_out: bool,
           stock: bool) -> list[dict]:
    """Each pooled (machine, call) entry of target_runs predicted by a profile of profile_runs."""
    profile = Profile(build(profile_runs, arch="sm90", stack={}, date="", model=model), model=model)
    out = []
    for (machine, _), (label, params, times, _) in pooled_calls(target_runs).items():
        found = score(profile, label, params, times, machine, leave_out=leave_out, stock=stock)
        if found:
            out.append(found)
    return out


def stats(results: list[dict]) -> str:
    ratios = [r["ratio"] for r in results]
    if not ratios:
        return "no rows"
    worst = max(results, key=lambda r: r["ratio"])
    return (f"{len(ratios)} rows, mean {statistics.mean(ratios):.4f}, worst {worst['ratio']:.3f} ({worst['label']}"
            f"{', ' + worst['machine'].split()[1] if ' ' in worst['machine'] else ''}: {worst['pick']} vs "
            f"{worst['fastest']}), over 1.05: {sum(r > 1.05 for r in ratios)}")


def protocols(paths: list[str], model: CostModel = COST_MODEL, *, verbose: bool = False,
              holdout: tuple[str, ...] = HOLDOUT) -> dict[str, list[dict]]:
    runs, _ = load_runs(paths)
    report: dict[str, list[dict]] = {}
    for stock in (False, True):
        tag = " torch-only" if stock else ""
        report["leave-one-out" + tag] = pooled(runs, runs, model, leave_out=True, stock=stock)
        for machine in sorted({r["machine"] for r in runs}):
            report[f"leave-one-out, {machine}{tag}"] = [r for r in report["leave-one-out" + tag]
                                                        if r["machine"] == machine]
        for grid in sorted({r["grid"] for r in runs}):
            report[f"without {grid}{tag}"] = pooled([r for r in runs if r["grid"] != grid],
                                                    [r for r in runs if r["grid"] == grid], model,
                                                    leave_out=False, stock=stock)
        for name in holdout:
            target = [r for r in runs if Path(r["path"]).name == name]
            if not target:
                continue
            profile = Profile(build([r for r in runs if r["grid"] != target[0]["grid"]], arch="sm90", stack={},
                                    date="", model=model), model=model)
            report[f"{name} without its grid{tag}"] = evaluate(target[0]["rows"], profile, target[0]["machine"],
                                                               stock=stock)
    for name, results in report.items() if verbose is not None else ():
        print(f"{name:44s} {stats(results)}")
        if verbose:
            for r in sorted(results, key=lambda r: -r["ratio"]):
                if r["ratio"] > 1.03:
                    print(f"     {r['ratio']:.3f} {r['label']:55s} {r['machine'][:12]:12s} {r['pick']} vs "
                          f"{r['fastest']}")
    return report


def summarize(name: str, results: list[dict]) -> None:
    sd = [r["vs_sdpa"] for r in results if r["vs_sdpa"]]
    print(f"{name}: {stats(results)}" + (f"; vs SDPA worst {max(sd):.3f} mean {statistics.mean(sd):.3f}" if sd else ""))


def timed(path: str) -> None:
    """What the GPU run itself measured (bench_user_step.py --policies [--measured]): the default module's and the
    measured policy's time over the fastest provider forced, over SDPA, and default / its own pick forced (the
    same engine in two modules: the timer's noise on that row)."""
    rows = read_results(path)["rows"]
    found: dict[str, list[tuple[float, str]]] = {"default/fastest": [], "measured/fastest": [],
                                                 "checked/fastest": [], "default/sdpa": [], "checked/sdpa": [],
                                                 "default/pick forced": [], "measured pick forced/fastest": [],
                                                 "measured/pick forced": [], "checked pick forced/fastest": [],
                                                 "A/A twin/pick": []}
    for row in rows:
        t = row["times_ms"]
        forced = {n: v for n, v in t.items() if ":" in n}
        if not forced or "default" not in t:
            continue
        best = min(forced.values())
        found["default/fastest"].append((t["default"] / best, row["label"]))
        if "measured" in t:
            found["measured/fastest"].append((t["measured"] / best, row["label"]))
        if "checked" in t:
            found["checked/fastest"].append((t["checked"] / best, row["label"]))
        if "sdpa" in t:
            found["default/sdpa"].append((t["default"] / t["sdpa"], row["label"]))
            if "checked" in t:
                found["checked/sdpa"].append((t["checked"] / t["sdpa"], row["label"]))
        if row.get("checked_pick") in forced:
            found["checked pick forced/fastest"].append((forced[row["checked_pick"]] / best, row["label"]))
        if row.get("default_pick") in forced:
            found["default/pick forced"].append((t["default"] / forced[row["default_pick"]], row["label"]))
        if row.get("measured_pick") in forced:  # the measured policy's pick, timed as a forced module
            found["measured pick forced/fastest"].append((forced[row["measured_pick"]] / best, row["label"]))
            if "measured" in t:  # far from 1: the measured column ran another engine than its recorded pick
                found["measured/pick forced"].append((t["measured"] / forced[row["measured_pick"]], row["label"]))
        if "aa_ratio" in row:
            found["A/A twin/pick"].append((row["aa_ratio"], row["label"]))
    print(f"{Path(path).name} (timed, {len(rows)} rows):")
    for name, values in found.items():
        if values:
            worst = max(values)
            print(f"  {name:28s} mean {statistics.mean(v for v, _ in values):.3f}  worst {worst[0]:.3f} ({worst[1]})  "
                  f"over 1.03: {sum(v > 1.03 for v, _ in values)}/{len(values)}")


def model_with(settings: list[str]) -> CostModel:
    """COST_MODEL with KEY=VALUE settings (each value parsed as its field's type)."""
    changes = {}
    for item in settings:
        key, _, value = item.partition("=")
        if not hasattr(COST_MODEL, key) or not value:
            raise SystemExit(f"--model {item!r}: expected KEY=VALUE with KEY a CostModel field "
                             f"({', '.join(COST_MODEL.__dataclass_fields__)})")
        default = getattr(COST_MODEL, key)
        if isinstance(default, bool):
            changes[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, tuple) and default and all(isinstance(x, tuple) for x in default):
            changes[key] = _named_numbers(item, key, value, per_dim=len(default[0]) == 3)
        elif isinstance(default, tuple) and all(isinstance(x, str) for x in default):
            changes[key] = () if value == "none" else tuple(value.split(","))  # names; "none": the empty tuple
        elif isinstance(default, tuple):
            changes[key] = tuple(float(x) for x in value.split(","))
        else:
            changes[key] = type(default)(value)
    return dataclasses.replace(COST_MODEL, **changes)


def _named_numbers(item: str, key: str, value: str, *, per_dim: bool) -> tuple:
    """A CostModel table from --model: (name, number) pairs as NAME=NUMBER,..., or with per_dim (name, head dim,
    number) triples as NAME#DIM=NUMBER,...; "none": the empty table."""
    form = "NAME#DIM=NUMBER" if per_dim else "NAME=NUMBER"
    found = []
    for part in [] if value == "none" else value.split(","):
        name, _, number = part.rpartition("=")
        name, _, dim = name.rpartition("#") if per_dim else (name, "", "")
        if not name or not number or (per_dim and not dim.isdigit()):
            raise SystemExit(f"--model {item!r}: expected {key}={form},... or {key}=none")
        found.append((name, int(dim), float(number)) if per_dim else (name, float(number)))
    return tuple(found)


def summary_line(profile: Profile, paths: list[str]) -> str:
    """mean, mean of each file's worst row, worst row and rows over 1.05, over every row of the files."""
    ratios, worst = [], []
    for path in paths:
        data = read_results(path)
        found = [r["ratio"] for r in evaluate(data["rows"], profile, data["environment"]["device"], stock=False)]
        if found:
            ratios += found
            worst.append(max(found))
    if not ratios:
        return "no rows"
    return (f"{len(ratios)} rows in {len(worst)} files: mean {statistics.mean(ratios):.4f}, mean of the files' worst "
            f"{statistics.mean(worst):.3f}, worst {max(ratios):.3f}, over 1.05: {sum(r > 1.05 for r in ratios)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--profile", default=str(PROFILE_DIR / "sm90.json"))
    ap.add_argument("--protocols", action="store_true", help="leave-one-out and leave-one-grid-out over the files")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--timed", action="store_true", help="also summarise the run's own timed default/measured columns")
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="a CostModel setting (repeatable): the profile is rebuilt from the shipped sources with it")
    ap.add_argument("--summary", action="store_true", help="one line over all the files (all providers)")
    args = ap.parse_args()
    model = model_with(args.model)
    if args.protocols:
        protocols(args.results, model, verbose=args.verbose)
        return 0
    if args.model:
        from build_profile import shipped_sources

        runs, _ = load_runs(shipped_sources())
        profile = Profile(build(runs, arch="sm90", stack={}, date="", model=model), model=model)
    else:
        profile = Profile(json.loads(Path(args.profile).read_text()))
    if args.summary:
        print(summary_line(profile, args.results))
        return 0
    for path in args.results:
        if args.timed:
            timed(path)
        data = read_results(path)
        for stock in (False, True):
            res = evaluate(data["rows"], profile, data["environment"]["device"], stock=stock)
            summarize(f"{Path(path).name} {'torch providers only' if stock else 'all providers'}", res)
            if args.verbose:
                for r in res:
                    if r["ratio"] > 1.02 or (r["vs_sdpa"] or 0) > 1.02:
                        print(f"   {r['label']:52s} {r['pick']:22s} {r['ratio']:.3f} fastest {r['fastest']} "
                              f"vs sdpa {r['vs_sdpa'] or 0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
