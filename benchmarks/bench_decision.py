"""Cost of a decision on the host: cached (the hot path) and fresh (every check of every table).

Targets: cached <= 2 us (every call pays it), fresh <= 300 us (once per new shape).
Run: python3 benchmarks/bench_decision.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import platform as py_platform
import statistics
import time

from attn_dispatch import AttentionParams, EnvFlags, Platform, explain
from attn_dispatch.constraints import TABLES


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    platform = Platform.parse("h100-cudnn9")
    env = EnvFlags.from_environ({})
    params = AttentionParams(dtype="bf16", batch_size=4, max_seqlen_q=4096, num_heads=16, head_dim_qk=128,
                             attn_mask_type="causal")
    explain(params, platform, env)
    results = {
        "cached_select_us": per_call_us(lambda: explain(params, platform, env), 100_000),
        "cached_select_with_env_read_us": per_call_us(lambda: explain(params, platform, EnvFlags.from_environ()),
                                                      50_000),
        "fresh_select_us": per_call_us(lambda: explain(params, platform, env, use_cache=False), 500),
        "checks_evaluated": sum(len(t.checks) for t in TABLES.values()),
        "providers": len(TABLES),
        "host": f"{py_platform.processor() or py_platform.machine()}, Python {py_platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'measure':<34}{'value':>10}   target")
    print(f"{'cached decision (us)':<34}{results['cached_select_us']:>10.2f}   <= 2")
    print(f"{'cached + reading env (us)':<34}{results['cached_select_with_env_read_us']:>10.2f}")
    print(f"{'fresh decision (us)':<34}{results['fresh_select_us']:>10.1f}   <= 300")
    print(f"{'checks per fresh decision':<34}{results['checks_evaluated']:>10}")


if __name__ == "__main__":
    main()
