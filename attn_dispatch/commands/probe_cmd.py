"""Run boundary configurations on every installed engine and check the constraint tables against them.

Exit status 1 when any case is too loose (declared eligible, but fails or is wrong)."""
from __future__ import annotations

import argparse
import collections
import json
import time

from ..constraints import TABLES
from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from ..probe import boundary_configs, probe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--providers", default=None,
                        help="comma-separated provider ids (default: every provider whose platform and package "
                             "checks pass here)")
    parser.add_argument("--limit", type=int, default=None, help="probe only the first N configurations")
    parser.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write every result here")
    parser.add_argument("--seed", type=int, default=0)


def installed_providers(platform: Platform) -> list[str]:
    probe_params = AttentionParams(device_type=platform.device_type)
    env = EnvFlags.from_environ({})
    usable = []
    for table in TABLES.values():
        failures = [c for c in table.checks if c.topic in ("platform", "package") and c(probe_params, platform, env)]
        if not failures:
            usable.append(table.id)
    return usable


def _progress(total: int):
    try:
        from rich.progress import Progress
    except ImportError:
        return None
    progress = Progress(transient=False)
    return progress, progress.add_task("probing", total=total)


def run(args: argparse.Namespace) -> int:
    platform = Platform.detect()
    providers = args.providers.split(",") if args.providers else installed_providers(platform)
    unknown = [p for p in providers if p not in TABLES]
    if unknown:
        raise ValueError(f"--providers: {', '.join(unknown)} unknown; known: {', '.join(TABLES)}")
    configs = boundary_configs(platform.device_type)[: args.limit]
    total = len(configs) * len(providers)
    print(f"probing {len(configs)} configurations x {len(providers)} providers on {platform.describe()}")
    results, started = [], time.perf_counter()
    bar = _progress(total)
    if bar:
        bar[0].start()
    for i, result in enumerate(probe(providers, configs, device=platform.device_type, seed=args.seed), 1):
        results.append(result)
        if bar:
            bar[0].update(bar[1], advance=1, description=f"{result.provider}")
        elif i % 25 == 0:
            print(f"  {i}/{total}")
    if bar:
        bar[0].stop()
    counts = collections.Counter((r.provider, r.verdict) for r in results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"platform": platform.to_dict(), "date": time.strftime("%Y-%m-%d"),
                       "seconds": time.perf_counter() - started, "results": [r.to_dict() for r in results]}, f,
                      indent=1, default=str)
    for r in results:
        if r.verdict != "agreed":
            why = r.error.splitlines()[0] if r.error else ", ".join(f"{k}={v:.2g}" for k, v in r.errors.items())
            declared = "eligible" if r.declared_eligible else "rejected by " + ",".join(r.declared_reasons)
            print(f"{r.verdict:<11}{r.provider:<24}{AttentionParams(**r.params).describe()}\n"
                  f"{'':<35}declared {declared}; {why}")
    print(f"\n{'provider':<26}{'agreed':>8}{'too_strict':>12}{'too_loose':>11}")
    for provider in providers:
        print(f"{provider:<26}{counts[(provider, 'agreed')]:>8}{counts[(provider, 'too_strict')]:>12}"
              f"{counts[(provider, 'too_loose')]:>11}")
    return 1 if any(r.verdict == "too_loose" for r in results) else 0
