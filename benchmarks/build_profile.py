"""Build the shipped profile (attn_dispatch/policy/profiles/<arch>.json) from bench_user_step.py results.

    python3 benchmarks/build_profile.py --shipped     # the shipped sm90.json, from shipped_sources()
    python3 benchmarks/build_profile.py FILE... --out PATH

Any number of result files, of any grid, machine and stack: rows of one call on one machine make one entry, its
provider times the median over the runs after scaling each run onto the one with the most providers by the
providers both timed (policy.profile.combine_runs; a stock-torch run times torch's providers only). Each entry
records its machine (the run's device name). The stack named is the full-stack runs' (flash-attn-4 installed).
A run of a refresh grid (cases.REFRESH_GRIDS: fit-thd) replaces the earlier runs of its calls on its machine.
Runs with a host/GPU split (bench_user_step.py --split-only: split_fit_*) add each provider's host and GPU time.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.benchmarking.cases import REFRESH_GRIDS  # noqa: E402
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR, build  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "profile"
# Not profile data: held-out grids (blind*), the H200's fit and split runs, split refreshes included (kept out: they
# made its held-out mean worse, results/profile/README.md), a run from before the torch providers' path was fixed
# (session3_first), the checks' own formats (check_*, gqa_cudnn, sdpa_gap, host_*, split_stock_*, sustained_*), and
# the fit-dense grid's run (session 18: its host times made blind10-19's picks worse, stock 1.0030 -> 1.0052;
# results/profile/README.md).
NOT_FIT = ("session3_first", "gqa_cudnn", "sdpa_gap", "blind", "check_", "host_", "split_stock", "split_dense",
           "sustained_")


def shipped_sources() -> list[str]:
    """The result files the shipped profile is built from."""
    paths = sorted(RESULTS.glob("*.json")) + sorted(RESULTS.glob("*.json.gz"))
    return [str(p) for p in paths if not any(x in p.name for x in NOT_FIT)
            and not (p.name.startswith(("fit", "split_")) and "h200" in p.name)]


def load_runs(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(runs for build(), their environments), in the order of the files' names: the build combines a call's runs
    in run order (combine_runs scales them onto the first with the most providers), so a shell's sort order (a
    locale's collation) must not change the profile."""
    runs, envs = [], []
    for path in sorted(paths, key=lambda p: (Path(p).name, p)):
        data = read_results(path)
        if "rows" not in data or "environment" not in data:
            raise ValueError(f"{path}: not a bench_user_step.py result (no rows/environment)")
        env = data["environment"]
        grid = data.get("grid", "")
        runs.append({"machine": env["device"], "rows": data["rows"], "path": path, "grid": grid, "date": env["date"],
                     "replaces": grid in REFRESH_GRIDS, "refreshes": data.get("refreshes", [])})
        envs.append(env)
    return runs, envs


def full_stack(env: dict) -> bool:
    """Whether a run's environment had flash-attn-4 (the full stack), not a stock `pip install torch`."""
    return env.get("flash_attn_4") not in (None, "absent")


def stack_of(envs: list[dict]) -> tuple[dict[str, str], str]:
    """The software stack of the full-stack runs (the first with flash-attn-4's version), and the newest date."""
    full = [e for e in envs if full_stack(e)] or envs
    env = dict(full[-1])
    for key, dist in (("cudnn_frontend", "cudnn-frontend"), ("flash_attn_4", "flash-attn-4")):
        if not str(env[key])[:1].isdigit():  # older harness runs recorded 'present': the platform line has it
            found = re.search(re.escape(dist) + r" ([0-9][^ ,;]*)", env["platform"])
            env[key] = found.group(1) if found else env[key]
    cudnn = int(env["cudnn"])
    stack = {"torch": env["torch"], "cuDNN": f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}",
             "cudnn-frontend": env["cudnn_frontend"], "flash-attn-4": env["flash_attn_4"]}
    return stack, max(e["date"] for e in envs)[:10]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", help="bench_user_step.py results (any grids, machines, stacks)")
    ap.add_argument("--shipped", action="store_true", help="build the shipped profile of --arch from its sources")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.shipped:
        if args.results:
            ap.error("--shipped names its own sources: give no result files")
        args.results, args.out = shipped_sources(), args.out or str(PROFILE_DIR / f"{args.arch}.json")
    if not args.results or not args.out:
        ap.error("give result files and --out, or --shipped")
    runs, envs = load_runs(args.results)
    stack, date = stack_of(envs)
    profile = build(runs, arch=args.arch, stack=stack, date=date)
    Path(args.out).write_text(json.dumps(profile, separators=(",", ":")))
    per_machine = {m: sum(e["machine"] == i for e in profile["entries"]) for i, m in enumerate(profile["machines"])}
    print(f"{len(profile['entries'])} entries ({', '.join(f'{m}: {n}' for m, n in per_machine.items())}) from "
          f"{len(runs)} runs -> {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
