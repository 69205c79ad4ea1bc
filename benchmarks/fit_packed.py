"""How well the profile predicts packed (thd) calls, per engine: the numbers the packed cost terms of
policy/cost_model.py's CostModel were chosen by (no GPU needed).

    python3 benchmarks/fit_packed.py                       # the shipped CostModel
    python3 benchmarks/fit_packed.py --model twin_k=3      # a CostModel setting (repeatable, evaluate_profile's form)
    python3 benchmarks/fit_packed.py --before packed_twin=false    # against a model before a change: what moved

The checks over the fit data:
- split: the profile's packed calls that some run split into host and GPU time (bench_user_step.py --split), each
  predicted with its own shape left out: the predicted GPU time over the measured, per provider (rms of the log),
  and per pair of providers (rms of the log of the predicted ratio over the measured one: what a pick depends on);
- steps: the packed rows of the given result files (default: the packed held-out runs looked at so far and every
  blind grid's packed rows), each provider's predicted step over the measured one, likewise;
- picks: the profile's pick over the fastest engine on those rows (evaluate_profile.score: a case's own lengths give
  its fills; where nothing is predicted, the order's pick), and on every row of the blind grids (dense ones too: a
  packed term must not move them);
- grids: every measured packed grid's run (the manifest's packed-fit runs and its held-out runs of packed grids;
  stock ones too) picked with the profile's packed entries made of every other measured packed grid (leave one grid
  out: a provider without a rate read off the other grids alone, as before the grid was measured), and of every
  measured packed grid (the full fit); the machine varlen factors stay the model's (refitted in each fold on the
  other grids' rows they moved no pick: benchmarks/results/README.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy.cost_model import CostModel  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402
from attn_dispatch.policy.profile_build import (packed_entries, pooled_calls, pooled_splits,  # noqa: E402
                                                with_settled_flex)
import results_manifest  # noqa: E402
from build_profile import load_runs, shipped_sources  # noqa: E402
from evaluate_profile import call_of, evaluate, model_with  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# packed grids looked at, fit data from then on: the manifest's packed-fit runs of the full stack (a stock run times
# FA2 on the same calls again)
PACKED_FIT = tuple(e["file"] for e in results_manifest.entries("packed-fit")
                   if e["stack"].get("flash_attn_4") not in (None, "absent"))
ENGINES = ("cudnn_fused:frontend", "flash_attn_2:torch", "flash_attn_4:cute")


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else float("nan")


def log_errors(predicted: dict[str, float], measured: dict[str, float]) -> tuple[dict[str, float], dict[tuple, float]]:
    """log(predicted / measured) per provider, and per pair log((pa / pb) / (ma / mb))."""
    own = {p: math.log(predicted[p] / measured[p]) for p in ENGINES if p in predicted and p in measured
           and measured[p] > 0}
    pairs = {(a, b): own[a] - own[b] for a, b in itertools.combinations(sorted(own), 2)}
    return own, pairs


def summarize_errors(name: str, found: list[tuple[dict, dict]]) -> None:
    own: dict[str, list[float]] = {}
    pairs: dict[tuple, list[float]] = {}
    for o, pr in found:
        for k, v in o.items():
            own.setdefault(k, []).append(v)
        for k, v in pr.items():
            pairs.setdefault(k, []).append(v)
    line = ", ".join(f"{k.split(':')[0]} {rms(v):.3f} (bias {statistics.mean(v):+.3f})" for k, v in sorted(own.items()))
    pair = ", ".join(f"{a.split(':')[0]}/{b.split(':')[0]} {rms(v):.3f}" for (a, b), v in sorted(pairs.items()))
    print(f"  {name}: {len(found)} calls; rms log error {line}; pairs {pair}")


def split_check(profile: Profile, runs: list[dict]) -> list[tuple[dict, dict]]:
    """Predicted GPU time over the measured split, each packed call with its shape left out."""
    splits = pooled_splits(runs)
    found = []
    for key, (_, params, _, _) in pooled_calls(runs).items():
        if params.get("qkv_format") != "thd" or key not in splits:
            continue
        measured = {p: g for p, (_, g) in splits[key].items() if g >= 0.2}  # launch latency dominates below
        parts = profile.parts(AttentionParams(**params), machine=key[0], leave_out=True)
        found.append(log_errors(parts.gpus, measured))
    return found


def varlen_factors(profile_data: dict, runs: list[dict], model: CostModel) -> dict[str, tuple[float, int]]:
    """Per provider, the median of a packed call's measured split GPU time over its predicted one without a varlen
    factor (CostModel.varlen_factor's source), and over how many calls."""
    profile = Profile(profile_data, model=dataclasses.replace(model, varlen_factor=()))
    splits = pooled_splits(runs)
    found: dict[str, list[float]] = {}
    for key, (_, params, _, _) in pooled_calls(runs).items():
        if params.get("qkv_format") != "thd" or key not in splits:
            continue
        gpus = profile.parts(AttentionParams(**params), machine=key[0]).gpus
        for provider, (_, gpu) in splits[key].items():
            if gpu >= 0.2 and provider in gpus:
                found.setdefault(provider, []).append(gpu / gpus[provider])
    return {p: (statistics.median(v), len(v)) for p, v in sorted(found.items())}


def machine_varlen_factors(profile_data: dict, rows: list[tuple[str, dict]], model: CostModel,
                           host_margin: float = 2.0) -> dict[str, tuple[float, int]]:
    """Per "provider@machine", the median of a packed row's measured step over its predicted GPU time without a
    machine factor (CostModel.machine_varlen_factor's source), over the rows where both are over host_margin x the
    predicted host time (GPU-bound: the step is its GPU time), and over how many rows."""
    profile = Profile(profile_data, model=dataclasses.replace(model, machine_varlen_factor=()))
    found: dict[str, list[float]] = {}
    for machine, row in rows:
        parts = profile.parts(call_of(row["params"], row.get("case")), machine=machine)
        for provider, gpu in parts.gpus.items():
            measured = row["times_ms"].get(provider)
            host = parts.hosts[provider]
            if provider in ENGINES and measured and min(gpu, measured) > host_margin * host:
                found.setdefault(f"{provider}@{machine}", []).append(math.log(measured / gpu))
    return {key: (math.exp(statistics.median(v)), len(v)) for key, v in sorted(found.items())}


def packed_rows(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for path in paths:
        data = read_results(path)
        out += [(data["environment"]["device"], r) for r in data["rows"] if r["params"].get("qkv_format") == "thd"]
    return out


def step_check(profile: Profile, rows: list[tuple[str, dict]]) -> list[tuple[dict, dict]]:
    found = []
    for machine, row in rows:
        measured = {p: t for p, t in row["times_ms"].items() if p in ENGINES}
        predicted = profile.predict(call_of(row["params"], row.get("case")), machine=machine).times_ms
        found.append(log_errors(predicted, measured))
    return found


def picks(profile: Profile, paths: list[str], packed_only: bool) -> list[dict]:
    out = []
    for path in paths:
        data = read_results(path)
        rows = [r for r in data["rows"] if not packed_only or r["params"].get("qkv_format") == "thd"]
        out += [{**r, "file": Path(path).name} for r in evaluate(rows, profile, data["environment"]["device"],
                                                                  stock=False)]
    return out


def pick_line(results: list[dict]) -> str:
    ratios = [r["ratio"] for r in results]
    if not ratios:
        return "no rows"
    return (f"{len(ratios)} rows, mean {statistics.mean(ratios):.4f}, worst {max(ratios):.3f}, "
            f"over 1.05: {sum(x > 1.05 for x in ratios)}")


def measured_packed_grids(manifest: Path = results_manifest.MANIFEST) -> list[str]:
    """Every measured packed grid's runs, each checked against its sha256: the manifest's packed-fit runs and its
    held-out runs of packed grids (eval-blind-packed*)."""
    return [str(results_manifest.verified_path(e, manifest)) for e in results_manifest.entries(manifest=manifest)
            if e["role"] == "packed-fit" or (e["role"] == "held-out"
                                             and e.get("grid", "").startswith("eval-blind-packed"))]


def grid_check(profile_data: dict, model: CostModel, paths: list[str]) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per run of the packed grids `paths`: (its rows' picks with the profile's packed entries made of the other
    grids' runs, made of every run), scored against its rows' times with flex's replaced where a run timed the call
    again with flex settled on its dynamic compile (with_settled_flex)."""
    runs, _ = load_runs(paths)
    machines = sorted({*profile_data["machines"], *(r["machine"] for r in runs)})
    data = {**profile_data, "machines": machines}

    def profile_of(fit: list[dict]) -> Profile:
        return Profile({**data, "packed": packed_entries(fit, machines, model)}, model=model)

    every = profile_of(runs)
    found = {}
    for run in runs:
        others = profile_of([r for r in runs if not _grids(r) & _grids(run)])
        rows = with_settled_flex(run, runs)
        found[Path(run["path"]).name] = (evaluate(rows, others, run["machine"], stock=False),
                                         evaluate(rows, every, run["machine"], stock=False))
    return found


def _grids(run: dict) -> set[str]:
    """The grids a run measured rows of (a re-measure may hold several grids' rows: a comma list)."""
    return set(run["grid"].split(","))


def report(model: CostModel, profile_data: dict, runs: list[dict], fit: list[str], blind: list[str],
           grids: list[str]) -> dict:
    profile = Profile(profile_data, model=model)
    if model.packed_twin:
        factors = varlen_factors(profile_data, runs, model)
        print("  varlen factors measured: " + ", ".join(f"{p} {f:.3f} ({n} calls)" for p, (f, n) in factors.items()))
        machines = machine_varlen_factors(profile_data, packed_rows(fit), model)
        print("  machine factors measured on the packed fit rows: "
              + ", ".join(f"{p} {f:.3f} ({n} rows)" for p, (f, n) in machines.items()))
    summarize_errors("split GPU time, leave-one-out", split_check(profile, runs))
    summarize_errors("packed fit rows' steps", step_check(profile, packed_rows(fit)))
    summarize_errors("blind grids' packed steps", step_check(profile, packed_rows(blind)))
    found = {"packed fit rows": picks(profile, fit, True),
             "blind grids, packed rows": picks(profile, [p for p in blind if "stock" not in p], True),
             "blind grids, full stack": picks(profile, [p for p in blind if "stock" not in p], False),
             "blind grids, stock": picks(profile, [p for p in blind if "stock" in p], False)}
    for name, results in found.items():
        print(f"  picks, {name}: {pick_line(results)}")
    checked = grid_check(profile_data, model, grids)
    for name, (grid_out, every) in checked.items():
        print(f"  grids, {name}: other grids' packed calls {pick_line(grid_out)}; every grid's {pick_line(every)}")
    for index, name in enumerate(("other grids", "every grid")):
        print(f"  grids, all runs, {name}: {pick_line([r for found in checked.values() for r in found[index]])}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--before", action="append", default=[], metavar="KEY=VALUE",
                    help="also the model (with --model) changed by these settings, as the one before: what moved")
    ap.add_argument("--fit", nargs="*", default=[str(RESULTS / p) for p in PACKED_FIT])
    ap.add_argument("--grids", nargs="*", default=measured_packed_grids(),
                    help="the packed grids' runs left out in turn (default: every measured one in the manifest)")
    ap.add_argument("--verbose", action="store_true", help="every packed fit row whose pick is over 1.02")
    args = ap.parse_args()
    model = model_with(args.model)
    blind = sorted(glob.glob(str(RESULTS / "held_out" / "blind*.json.gz")))
    profile_data = json.loads((PROFILE_DIR / "sm90.json").read_text())
    runs, _ = load_runs(shipped_sources())
    models = [("before", model_with(args.model + args.before))] if args.before else []
    models.append(("model", model))
    found = {}
    for name, m in models:
        print(f"{name}: {', '.join(f'{k}={v}' for k, v in dataclasses.asdict(m).items() if k in _packed_fields())}")
        found[name] = report(m, profile_data, runs, args.fit, blind, args.grids)
        if args.verbose:
            for r in found[name]["packed fit rows"]:
                if r["ratio"] > 1.02:
                    print(f"     {r['ratio']:.3f} {r['label'][:64]:64s} {r['pick']} vs {r['fastest']}")
    if len(found) == 2:
        for group in found["model"]:
            moved = [(a, b) for a, b in zip(found["before"][group], found["model"][group]) if a["pick"] != b["pick"]]
            better = sum(b["ratio"] < a["ratio"] for a, b in moved)
            print(f"  {group}: {len(moved)} picks moved, {better} to a faster engine")
            for a, b in moved if group.startswith("blind grids, full") or group.startswith("packed") else ():
                print(f"     {a['file'][:22]:22s} {a['label'][:52]:52s} {a['pick']} {a['ratio']:.3f} -> "
                      f"{b['pick']} {b['ratio']:.3f}")
    return 0


def _packed_fields() -> set[str]:
    return {"packed_lengths", "packed_twin", "varlen_factor", "machine_varlen_factor", "host_scale", "machine_shift",
            "relative_k", "relative_length_slope", "relative_packed_margin", "windowed_varlen_forward"}


if __name__ == "__main__":
    sys.exit(main())
