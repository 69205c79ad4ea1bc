"""Pre-tune the measured policy for the shapes a run will use, on this machine, so that training starts tuned.

--shapes FILE: a JSON list of objects holding AttentionParams keywords, for example
    [{"dtype": "bf16", "batch_size": 8, "num_heads": 16, "num_gqa_groups": 4, "head_dim_qk": 128,
      "max_seqlen_q": 4096, "attn_mask_type": "causal", "is_training": true}]
(omitted keys take AttentionParams' defaults; device_type defaults to 'cuda'). Each shape's bucket is timed
once (forward, plus backward when is_training) and stored in the persistent cache; already tuned buckets are
skipped unless --retune. Environment variables (NVTE_FLASH_ATTN=0, ATTN_DISPATCH_BACKEND, ...) apply as usual.

Exit status: 0 when every shape got a pick, 1 otherwise, 2 on bad arguments."""
from __future__ import annotations

import argparse
import json
from ..benchmarking.grid import load_shapes, shape_label
from ..platform import Platform
from ..policy.measured import MeasuredPolicy
from ..selection import explain
from ..benchmarking.grid import shape_from_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", metavar="FILE", help="JSON list of AttentionParams objects (see above)")
    parser.add_argument("--retune", action="store_true", help="time again even where the cache has a result")
    parser.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $ATTN_DISPATCH_CACHE_DIR, $XDG_CACHE_HOME/attn-dispatch "
                             "or ~/.cache/attn-dispatch)")
    parser.add_argument("--show", action="store_true", help="print this machine's cached entries and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    policy = MeasuredPolicy(directory=args.cache_dir)
    platform = Platform.detect()
    if args.show:
        return _show(policy, platform, args.json)
    if not args.shapes:
        raise ValueError("--shapes FILE is required (or --show)")
    results = []
    for params in load_shapes(args.shapes):
        candidates = [v.id for v in explain(params, platform, use_cache=False).verdicts if v.eligible]
        result = policy.tune(params, platform, candidates, retune=args.retune)
        results.append({"shape": shape_label(params), "mode": result.entry.get("mode"),
                        "bucket_shape": shape_label(policy.scheme.representative(params)),
                        "timed_shape": shape_label(result.timed_shape), "chosen": result.chosen,
                        "tuned_now": result.tuned_now, "times_ms": result.entry.get("times_ms", {}),
                        "pruned_probe_ms": result.entry.get("probe_ms", {}),
                        "errors": result.entry.get("errors", {}), "skipped": result.entry.get("skipped", {}),
                        "tuning_s": result.entry.get("tuning_s")})
    cache = policy.cache_for(platform)
    if args.json:
        print(json.dumps({"cache": str(cache.path), "results": results}, indent=2))
    else:
        for r in results:
            times = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(r["times_ms"].items(), key=lambda kv: kv[1]))
            state = "tuned" if r["tuned_now"] else "cached"
            if r["tuning_s"] is not None:  # what timing this bucket cost (compiles and graph builds included)
                state += f" in {r['tuning_s']:.2f} s"
            print(f"{r['shape']} {r['mode']} (bucket {r['bucket_shape']}, timed at {r['timed_shape']}): "
                  f"{r['chosen'] or 'NONE'} [{state}]"
                  f"{': ' + times if times else ''}")
            for pid, err in r["errors"].items():
                print(f"    {pid} failed: {err}")
        print(f"cache: {cache.path}")
    return 0 if all(r["chosen"] for r in results) else 1


def _show(policy, platform, as_json: bool) -> int:
    cache = policy.cache_for(platform)
    entries = cache.entries()
    if as_json:
        print(json.dumps({"cache": str(cache.path), "platform": cache.key, "entries": entries}, indent=2))
        return 0
    print(f"cache: {cache.path} ({len(entries)} buckets)")
    for entry in entries.values():
        label = shape_label(shape_from_dict(entry.get("shape"), where="cached entry"))
        print(f"  {label} {entry.get('mode')}: {entry.get('chosen')}")
    return 0
