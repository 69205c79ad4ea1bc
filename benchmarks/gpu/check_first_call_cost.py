"""What a fresh process pays the first time it meets a shape, under each policy (`auto`, `checked`,
`measured`), with nothing compiled or tuned before: flash-attn-4's import and JIT compiles included.

The held-out runs time the checked and measured modules after other modules of the same process compiled every
engine's kernels, so their first-call costs there hold no compile. Here each policy runs in a process of its own
(an empty tuning cache, no kernels compiled), as a user's script starts: a workload of calls, each new to the
process; per call the module's first step (wall time to a synchronisation), the engine it chose and why, then its
step (median of seven 5-step blocks, CUDA events) taken right after the compiles with the GPU just out of idle: a
first look, not a warm steady loop as the held-out runs time, so no ranking of engines. The workload is eval-blind25's
training and inference calls of its first four families' first shapes and every window, packed, MLA and d256
call's training step (drawn, not tuned on).

    python3 benchmarks/gpu/check_first_call_cost.py --out $OUT/first_call_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[1]))

POLICIES = ("auto", "checked", "measured")


def workload():
    from attn_dispatch.benchmarking.cases import CASE_GRIDS

    grid = CASE_GRIDS["eval-blind25"]()
    firsts = {}
    for case in grid:
        family = case.name.rstrip("0123456789")
        if family in ("llm", "long", "enc", "small"):
            firsts.setdefault((family, case.train), case)  # one shape per family and kind
        elif case.train:
            firsts.setdefault((case.name, True), case)
    return list(firsts.values())


def worker(policy: str, out: str) -> None:
    t_start = time.perf_counter()
    import torch

    from attn_dispatch import DotProductAttention  # noqa: F401 - the import is part of what is timed
    from bench_user_step import block_ms_per_call, make_tensors, module_for, step_fn

    import_s = time.perf_counter() - t_start
    device = torch.device("cuda")
    rows = []
    for i, case in enumerate(workload()):
        q, k, v, dout, kwargs = make_tensors(case, device, seed=100 + i)
        module = module_for(case, None, device)
        step = step_fn(module, q, k, v, dout, kwargs, case.train)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            step()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - recorded, the workload goes on
            rows.append({"label": case.label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        first_ms = (time.perf_counter() - t0) * 1e3
        decision = module.last_decision
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        samples = [block_ms_per_call(step, 5) for _ in range(7)]
        rows.append({"label": case.label, "chosen": decision.chosen, "reason": decision.policy_reason[:400],
                     "first_ms": first_ms, "step_ms": statistics.median(samples)})
        print(f"  {policy:9s} {case.label:55s} {decision.chosen:22s} first {first_ms:9.1f} ms  step "
              f"{rows[-1]['step_ms']:.3f} ms", flush=True)
    Path(out).write_text(json.dumps({"policy": policy, "import_s": import_s,
                                     "wall_s": time.perf_counter() - t_start, "rows": rows}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.worker_out)
        return 0
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        ap.error(f"--policies {args.policies!r}: expected a comma list of {', '.join(POLICIES)}")
    from bench_user_step import environment

    results = {"environment": environment(), "workload": [c.label for c in workload()], "runs": {}}
    for policy in policies:
        with tempfile.TemporaryDirectory(prefix="attn-dispatch-first-") as cache, \
                tempfile.NamedTemporaryFile(suffix=".json") as part:
            env = {**os.environ, "ATTN_DISPATCH_POLICY": policy, "ATTN_DISPATCH_CACHE_DIR": cache}
            proc = subprocess.run([sys.executable, str(HERE), "--out", args.out, "--worker", policy,
                                   "--worker-out", part.name], env=env, timeout=900)
            if proc.returncode == 0:
                results["runs"][policy] = json.loads(Path(part.name).read_text())
            else:
                results["runs"][policy] = {"error": f"exit {proc.returncode}"}
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'policy':9s} {'import s':>8s} {'wall s':>7s} {'first calls: sum s':>18s} {'median ms':>9s} "
          f"{'max ms':>8s} {'steps: sum ms':>13s}")
    for policy, run in results["runs"].items():
        rows = [r for r in run.get("rows", []) if "first_ms" in r]
        if not rows:
            print(f"{policy:9s} {run.get('error', 'no rows')}")
            continue
        firsts = [r["first_ms"] for r in rows]
        print(f"{policy:9s} {run['import_s']:8.1f} {run['wall_s']:7.1f} {sum(firsts) / 1e3:18.1f} "
              f"{statistics.median(firsts):9.1f} {max(firsts):8.1f} {sum(r['step_ms'] for r in rows):13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
