"""Build the shipped profile (attn_dispatch/policy/profiles/<arch>.json) from bench_user_step.py results.

    python3 benchmarks/build_profile.py --shipped     # the shipped sm90.json, from results/manifest.json
    python3 benchmarks/build_profile.py FILE... --out PATH
    python3 benchmarks/build_profile.py FILE... --write-manifest   # these files become the shipped profile's sources

Any number of result files, of any grid, machine and stack: rows of one call on one machine make one entry, its
provider times the median over the runs after scaling each run onto the one with the most providers by the
providers both timed (policy.profile_build.combine_runs; a stock-torch run times torch's providers only). Each entry
records its machine (the run's device name). The stack named is the full-stack runs' (flash-attn-4 installed).
A run of a refresh grid (cases.REFRESH_GRIDS: fit-thd) replaces the earlier runs of its calls on its machine.
Runs with a host/GPU split (bench_user_step.py --split-only: split_fit_*) add each provider's host and GPU time.
bench_masks.py runs (masked calls: softcap, ALiBi, a bias, arbitrary masks) become the profile's `masked` entries,
which rank the providers of calls with those modifiers (policy/modified.py); the rate model never reads them.
The packed fit grids (the manifest's `packed-fit` runs; --packed) become its `packed` entries, off which a provider
no source timed (FlexAttention's) is predicted on a packed call relative to the others (Profile.relative); the rate
model never reads them either.
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
from attn_dispatch.policy.profile import PROFILE_DIR  # noqa: E402
from attn_dispatch.policy.profile_build import build  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_masks  # noqa: E402
import results_manifest  # noqa: E402


def shipped_sources(manifest: Path = results_manifest.MANIFEST, *, masked: bool = False) -> list[str]:
    """The result files the shipped profile is built from: exactly the manifest's `profile-source` entries, each
    checked against its sha256 (a renamed, edited or missing file is an error, never a silently different profile):
    the bench_user_step.py runs (entries naming their grid), or with `masked` the bench_masks.py runs (no grid).
    Held-out grids, measurements that were not adopted (the H200's fit and split runs, the dense fit) and evidence
    files are other roles: results/README.md says why each source set is what it is."""
    return [str(results_manifest.verified_path(e, manifest))
            for e in results_manifest.entries("profile-source", manifest) if ("grid" in e) != masked]


def packed_sources(manifest: Path = results_manifest.MANIFEST) -> list[str]:
    """The packed fit grids' runs (the manifest's `packed-fit` entries, each checked against its sha256): the
    profile's packed entries."""
    return [str(results_manifest.verified_path(e, manifest)) for e in results_manifest.entries("packed-fit", manifest)]


def write_manifest(paths: list[str], manifest: Path = results_manifest.MANIFEST) -> None:
    """Record these result files as the shipped profile's sources (replacing the previous set), for --write-manifest."""
    what = "a bench_user_step.py run the shipped profile is built from"
    new = [results_manifest.entry_for(Path(p), "profile-source", f"{what} (grid {read_results(p).get('grid', '')})",
                                      manifest) for p in paths]
    results_manifest.record(new, manifest, replace_role="profile-source")


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


def load_masked_runs(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(bench_masks.py runs as build()'s `masked` runs, their environments), in the order of the files' names."""
    runs, envs = [], []
    for path in sorted(paths, key=lambda p: (Path(p).name, p)):
        data = read_results(path)
        if "calls" not in data or "environment" not in data:
            raise ValueError(f"{path}: not a bench_masks.py result (no calls/environment)")
        runs.append({"machine": data["environment"]["device"], "rows": bench_masks.profile_rows(data), "path": path})
        envs.append(data["environment"])
    return runs, envs


def is_masked_run(path: str) -> bool:
    return "calls" in read_results(path)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", help="bench_user_step.py results (any grids, machines, stacks)")
    ap.add_argument("--shipped", action="store_true", help="build the shipped profile of --arch from its sources")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", default=None)
    ap.add_argument("--write-manifest", action="store_true", help="record the result files given as the shipped "
                    "profile's sources (results/manifest.json), then build it")
    ap.add_argument("--packed", nargs="*", default=[], metavar="FILE",
                    help="bench_user_step.py runs of packed grids: the profile's packed entries (not with --shipped, "
                    "which reads the manifest's packed-fit runs)")
    args = ap.parse_args(argv)
    if args.write_manifest:
        if not args.results:
            ap.error("--write-manifest records the result files given: name them")
        write_manifest(args.results)
        args.results, args.shipped = [], True
    if args.shipped:
        if args.results or args.packed:
            ap.error("--shipped names its own sources: give no result files")
        step_paths, masked_paths, args.packed = shipped_sources(), shipped_sources(masked=True), packed_sources()
        args.out = args.out or str(PROFILE_DIR / f"{args.arch}.json")
    else:
        masked_paths = [p for p in args.results if is_masked_run(p)]
        step_paths = [p for p in args.results if p not in masked_paths]
    if not step_paths or not args.out:
        ap.error("give result files (bench_user_step.py runs, and any bench_masks.py runs) and --out, or --shipped")
    runs, envs = load_runs(step_paths)
    masked, masked_envs = load_masked_runs(masked_paths)
    packed, packed_envs = load_runs(args.packed)
    stack, date = stack_of(envs)
    # the newest measurement the profile holds
    date = max([date] + [env["date"][:10] for env in [*masked_envs, *packed_envs]])
    profile = build(runs, arch=args.arch, stack=stack, date=date, masked=masked, packed=packed)
    Path(args.out).write_text(json.dumps(profile, separators=(",", ":")))
    per_machine = {m: sum(e["machine"] == i for e in profile["entries"]) for i, m in enumerate(profile["machines"])}
    print(f"{len(profile['entries'])} entries ({', '.join(f'{m}: {n}' for m, n in per_machine.items())}) and "
          f"{len(profile.get('masked', []))} masked calls from {len(runs) + len(masked)} runs ({len(masked)} of "
          f"bench_masks.py); {len(profile.get('packed', []))} packed calls from {len(packed)} packed-grid runs -> "
          f"{args.out} ({Path(args.out).stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
