"""The least any fixed choice of engine per call can score on grids measured more than once.

A policy that decides from the call alone (the shipped profile, Transformer Engine's order, any table) picks the
same engine for a call whatever lease it runs on. Where a grid was measured on several runs (other leases, or
later on the same one), this reads, for each call, the engine whose worst ratio over those runs is least:
- vs fastest: max over the runs of time(engine) / time(fastest engine forced in that run);
- vs SDPA: max over the runs of time(engine) / time(F.sdpa), where SDPA expresses the call.
No fixed choice can score below that on those runs, so a row over a target (say 1.05 of the fastest, 1.03 of
SDPA) here is one no profile can bring under it as measured: the lease, not the model, decides that row. Beside
it, the shipped profile's pick on the same runs.

    python3 benchmarks/static_bound.py benchmarks/results/held_out/*.json.gz
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.params import AttentionParams  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, Profile  # noqa: E402
from build_profile import full_stack  # noqa: E402
from evaluate_profile import forced_times  # noqa: E402


def groups(paths: list[str]) -> dict[tuple[str, str, str], list[tuple[str, dict]]]:
    """(grid, stack, machine) -> [(file names, {label: row})] for the groups of two runs or more. A file whose rows
    another run of its group lacks entirely (a run resumed: *_from45, *_rest) is merged into that run."""
    found: dict[tuple[str, str, str], list[tuple[str, dict]]] = defaultdict(list)
    for path in paths:
        data = read_results(path)
        env = data["environment"]
        key = (data.get("grid", ""), "full" if full_stack(env) else "stock", env["device"])
        found[key].append((Path(path).name, {row["label"]: row for row in data["rows"]}))
    merged = {}
    for key, files in found.items():
        runs: list[tuple[str, dict]] = []
        for name, rows in sorted(files, key=lambda f: -len(f[1])):
            part_of = next((i for i, (_, have) in enumerate(runs) if not set(have) & set(rows)), None)
            if part_of is None:
                runs.append((name, dict(rows)))
            else:
                runs[part_of] = (f"{runs[part_of][0]}+{name}", {**runs[part_of][1], **rows})
        if len(runs) > 1:
            merged[key] = runs
    return merged


def bound_rows(runs: list[tuple[str, dict]], stock: bool, profile: Profile, machine: str) -> list[dict]:
    """Per call timed in every run: the best fixed engine's worst ratios, and the profile pick's."""
    labels = set.intersection(*(set(rows) for _, rows in runs))
    out = []
    for label in sorted(labels):
        rows = [rows[label] for _, rows in runs]
        times = [forced_times(row["times_ms"], stock) for row in rows]
        common = set.intersection(*(set(t) for t in times))
        if not common:
            continue
        fastest = [min(t.values()) for t in times]

        def worst(engine: str) -> float:
            return max(t[engine] / f for t, f in zip(times, fastest))

        def worst_sdpa(engine: str) -> float | None:
            if any("sdpa" not in row["times_ms"] for row in rows):
                return None
            return max(t[engine] / row["times_ms"]["sdpa"] for t, row in zip(times, rows))
        best = min(common, key=worst)
        pick = profile.predict(AttentionParams(**rows[0]["params"]), machine=machine).best(sorted(common))
        sdpa_best = None if worst_sdpa(best) is None else min(worst_sdpa(e) for e in common)
        out.append({"label": label, "best": best, "best_worst": worst(best), "pick": pick,
                    "pick_worst": worst(pick) if pick else None, "sdpa_best": sdpa_best,
                    "pick_sdpa": worst_sdpa(pick) if pick else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--profile", default=str(PROFILE_DIR / "sm90.json"))
    ap.add_argument("--json", default=None, help="write the per-row bounds here")
    ap.add_argument("--verbose", action="store_true", help="list the rows over 1.05 (bound or pick)")
    args = ap.parse_args()
    profile = Profile(json.loads(Path(args.profile).read_text()))
    report = {}
    print(f"{'grid, stack, machine (runs)':44s} {'rows':>4s}  {'best fixed: mean / worst / >1.05':>33s}  "
          f"{'profile pick: mean / worst / >1.05':>35s}  {'vs SDPA >1.03: best / pick':>26s}")
    for (grid, stack, machine), runs in sorted(groups(args.results).items()):
        rows = bound_rows(runs, stack == "stock", profile, machine)
        if not rows:
            continue
        name = f"{grid}, {stack}, {machine.split()[1] if ' ' in machine else machine} ({len(runs)})"
        report[name] = {"runs": [n for n, _ in runs], "rows": rows}
        best = [r["best_worst"] for r in rows]
        picks = [r["pick_worst"] for r in rows if r["pick_worst"]]
        sdpa = [r for r in rows if r["sdpa_best"] is not None]
        pick_line = (f"{statistics.mean(picks):13.4f} / {max(picks):5.3f} / {sum(p > 1.05 for p in picks):3d}"
                     if picks else f"{'no prediction':>35s}")
        print(f"{name:44s} {len(rows):4d}  {statistics.mean(best):12.4f} / {max(best):5.3f} / "
              f"{sum(b > 1.05 for b in best):3d}  {pick_line}  {sum(r['sdpa_best'] > 1.03 for r in sdpa):9d} / "
              f"{sum((r['pick_sdpa'] or 0) > 1.03 for r in sdpa):2d} of {len(sdpa)}")
        if args.verbose:
            for r in rows:
                if r["best_worst"] > 1.05 or (r["pick_worst"] or 0) > 1.05:
                    print(f"    {r['label'][:52]:52s} best {r['best']} {r['best_worst']:.3f}; "
                          f"pick {r['pick']} {r['pick_worst']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
