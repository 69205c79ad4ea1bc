"""Build the shipped profile (attn_dispatch/policy/profiles/<arch>.json) from bench_user_step.py results.

    python3 benchmarks/build_profile.py FIT.json [--stock STOCK_FIT.json] --out attn_dispatch/policy/profiles/sm90.json

--stock: a run of the same grid on the same machine without the extra engines (torch's providers only). Its times
fill providers the full run lacks, scaled into the full run by a provider both timed (the two runs' clocks differ
by a few percent).
"""
from __future__ import annotations

import argparse
import re
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.policy.profile import build  # noqa: E402


def merge_stock(rows: list[dict], stock_rows: list[dict]) -> int:
    by_label = {r["label"]: r for r in stock_rows}
    filled = 0
    for row in rows:
        other = by_label.get(row["label"])
        if other is None:
            continue
        shared = [p for p in row["times_ms"] if ":" in p and p in other["times_ms"]]
        if not shared:
            continue
        scale = statistics.median(row["times_ms"][p] / other["times_ms"][p] for p in shared)
        for p, t in other["times_ms"].items():
            if ":" in p and p not in row["times_ms"]:
                row["times_ms"][p] = t * scale
                filled += 1
    return filled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fit", nargs="+", help="bench_user_step.py --grid fit results (one per machine)")
    ap.add_argument("--stock", nargs="*", default=[], help="stock-torch runs of the same grid, same order as fit")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, machines, envs = [], [], []
    for i, path in enumerate(args.fit):
        data = json.loads(Path(path).read_text())
        these = data["rows"]
        if i < len(args.stock):
            print(f"{path}: filled {merge_stock(these, json.loads(Path(args.stock[i]).read_text())['rows'])} times "
                  "from the stock run")
        env = data["environment"]
        machines.append(env["device"])
        envs.append(env)
        rows += these
    env = envs[0]
    cudnn = int(env["cudnn"])
    for key, dist in (("cudnn_frontend", "cudnn-frontend"), ("flash_attn_4", "flash-attn-4")):
        if not str(env[key])[:1].isdigit():  # older harness runs recorded 'present': the platform line has it
            found = re.search(re.escape(dist) + r" ([0-9][^ ,;]*)", env["platform"])
            env[key] = found.group(1) if found else env[key]
    stack = {"torch": env["torch"], "cuDNN": f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}", "cudnn-frontend": env["cudnn_frontend"],
             "flash-attn-4": env["flash_attn_4"]}
    profile = build(rows, arch=args.arch, machines=sorted(set(machines)), stack=stack, date=env["date"][:10])
    Path(args.out).write_text(json.dumps(profile, separators=(",", ":")))
    print(f"{len(profile['entries'])} entries -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
