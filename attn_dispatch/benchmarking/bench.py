"""Benchmark core (behind `attn-dispatch bench` and benchmarks/bench_policy.py).

For each shape and mode: what each policy picks through selection (`auto`, the default, as a call on this machine
would decide: the shipped profile, or a bucket tuned here before; `order`; `measured` from its own tuning pass;
`checked` timing what the profile cannot separate, into a cache of its own for the run, so that measured's tunings
do not decide for it), then every eligible engine timed again for the evaluation (interleaved call by call after a
warm period, longer than tuning, on fresh inputs), and the ratio time(picked) / time(fastest) for each policy.
"""
from __future__ import annotations

import platform as py_platform
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import __version__, selection
from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import Platform
from .grid import shape_label
from ..policy.measured import MeasuredPolicy
from .progress import progress
from ..policy.timing import MODES, TimerSettings, attention_flops, check_mode, time_engines
from ..backends import get_engine
from ..policy import AutoPolicy, CheckedPolicy

POLICIES = ("auto", "order", "measured", "checked")
DEFAULT_POLICIES = ("auto", "order", "measured")
RATIO_TARGET = 1.03
# The evaluation times all eligible engines interleaved, as tuning does, but longer: ~100 ms warm, >= 100 ms each.
EVAL_SETTINGS = TimerSettings(warmup=3, reps=15, max_reps=300, target_ms=100.0, warm_ms=100.0)
CUTOFF_RATIO = 3.0  # an engine whose estimate is 3x the best is not timed further: it cannot be the fastest
_SHORT_FAMILY = {"flash_attn_4": "fa4", "flash_attn_3": "fa3", "flash_attn_2": "fa2", "cudnn_fused": "cudnn",
                 "unfused": "unfused"}


def short_name(provider_id: str) -> str:
    family, _, provider = provider_id.partition(":")
    return f"{_SHORT_FAMILY.get(family, family)}:{provider}" if provider else family


@dataclass
class BenchConfig:
    modes: tuple[str, ...] = MODES
    settings: TimerSettings = EVAL_SETTINGS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    providers: tuple[str, ...] | None = None  # time only these ('family' or 'family:provider'); None: all
    show_progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for mode in self.modes:
            check_mode(mode)
        for policy in self.policies:
            if policy not in POLICIES:
                raise ValueError(f"policy={policy!r} is not supported; expected one of {', '.join(POLICIES)}")

    def wants(self, provider_id: str) -> bool:
        if self.providers is None:
            return True
        return provider_id in self.providers or provider_id.partition(":")[0] in self.providers


def run_bench(shapes: list[AttentionParams], platform: Platform, config: BenchConfig, *,
              measured: MeasuredPolicy | None = None, env: EnvFlags | None = None,
              on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Rows in shape-major order; on_row(rows so far) after each (to save partial results)."""
    env = EnvFlags.from_environ() if env is None else env
    if "measured" in config.policies and measured is None:
        measured = MeasuredPolicy()
    checked = _checked_policy(measured) if "checked" in config.policies else None
    rows = []
    with progress(len(shapes) * len(config.modes), "bench", enabled=config.show_progress) as advance:
        for shape in shapes:
            for mode in config.modes:
                params = shape.replace(is_training=mode == "fwd_bwd")
                rows.append(bench_row(params, platform, env, config, measured, checked))
                advance(f"{rows[-1]['label']} {mode}")
                if on_row is not None:
                    on_row(rows)
    return rows


def bench_row(params: AttentionParams, platform: Platform, env: EnvFlags, config: BenchConfig,
              measured: MeasuredPolicy | None, checked=None) -> dict[str, Any]:

    mode = "fwd_bwd" if params.is_training else "fwd"
    row: dict[str, Any] = {"label": shape_label(params), "mode": mode, "shape": params.to_dict(),
                           "flops": attention_flops(params, mode), "picks": {}, "engines": {}}
    decision = selection.explain(params, platform, env, policy="order", use_cache=False)
    row["eligible"] = [v.id for v in decision.verdicts if v.eligible]
    if "order" in config.policies:
        row["picks"]["order"] = decision.chosen
    # auto before measured: it reads the buckets tuned here before this run, never this run's
    for name, policy, tuner in (("auto", "auto", None), ("measured", measured, measured),
                                ("checked", checked, checked and checked.measured)):
        if name not in config.policies or policy is None:
            continue
        try:
            row["picks"][name], row[name] = _pick(params, platform, env, policy, tuner)
        except Exception as exc:  # noqa: BLE001 - reported in the row; the evaluation still runs
            row["picks"][name], row[name] = None, {"error": f"{type(exc).__name__}: {exc}"[:500]}
    engines, load_errors = {}, {}
    for pid in row["eligible"]:
        if config.wants(pid):
            try:
                engines[pid] = get_engine(pid)
            except Exception as exc:  # noqa: BLE001 - one engine failing is a result, not the end of the run
                load_errors[pid] = exc
    timings, errors = time_engines(engines, params, mode, config.settings, seed=1, cutoff_ratio=CUTOFF_RATIO) \
        if engines else ({}, {})
    for pid in row["eligible"]:
        if pid in timings:
            timing = timings[pid]
            row["engines"][pid] = {**timing.to_dict(), "tflops": row["flops"] / timing.median_ms / 1e9}
        elif pid in errors or pid in load_errors:
            exc = errors.get(pid) or load_errors[pid]
            row["engines"][pid] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    _rate(row)
    return row


def _pick(params: AttentionParams, platform: Platform, env: EnvFlags, policy,
          tuner: MeasuredPolicy | None = None) -> tuple[str | None, dict[str, Any]]:
    """The pick through selection, exactly as a call under this policy (a name or a policy object) makes it: the
    decision's time and reason, and what the tuner (the measured policy, or the one checked times with) recorded."""
    started = time.perf_counter()
    decision = selection.explain(params, platform, env, policy=policy, use_cache=False)
    info: dict[str, Any] = {"decision_s": round(time.perf_counter() - started, 4), "reason": decision.policy_reason}
    if tuner is not None:
        entry = tuner.cache_for(platform).get(tuner.scheme.key(params)) or {}
        info.update({"bucket_shape": shape_label(tuner.scheme.representative(params)),
                     "tuning_times_ms": entry.get("times_ms", {}), "pruned_probe_ms": entry.get("probe_ms", {}),
                     "errors": entry.get("errors", {}), "skipped": entry.get("skipped", {})})
    return decision.chosen, info


def _checked_policy(measured: MeasuredPolicy | None):
    """The checked policy timing into a cache of its own for the run (with the measured policy's timer settings)."""
    settings = {} if measured is None else {"settings": measured.settings, "prune_ratio": measured.prune_ratio}
    directory = tempfile.mkdtemp(prefix="attn-dispatch-bench-checked-")
    own = MeasuredPolicy(directory=directory, **settings)
    weakref.finalize(own, shutil.rmtree, directory, ignore_errors=True)  # the run's cache goes with the policy
    return CheckedPolicy(AutoPolicy(measured=own), own)


def _rate(row: dict[str, Any]) -> None:
    times = {pid: r["median_ms"] for pid, r in row["engines"].items() if "median_ms" in r}
    row["fastest"] = min(times, key=times.get) if times else None
    row["ratios"] = {}
    for policy, pick in row["picks"].items():
        row["ratios"][policy] = times[pick] / times[row["fastest"]] if pick in times else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    for policy in [p for p in POLICIES if any(p in row["picks"] for row in rows)]:
        rated = [(row["ratios"].get(policy), row) for row in rows if row["ratios"].get(policy) is not None]
        if not rated:
            summary[policy] = {"rated": 0}
            continue
        worst_ratio, worst_row = max(rated, key=lambda x: x[0])
        summary[policy] = {
            "rated": len(rated), "unrated": len(rows) - len(rated), "worst_ratio": worst_ratio,
            "worst_shape": f"{worst_row['label']} {worst_row['mode']}",
            "mean_ratio": sum(r for r, _ in rated) / len(rated),
            "over_target": sum(r > RATIO_TARGET for r, _ in rated), "target": RATIO_TARGET,
        }
    return summary


def report(rows: list[dict[str, Any]], platform: Platform, config: BenchConfig) -> dict[str, Any]:
    import torch

    return {
        "tool": "attn-dispatch bench", "attn_dispatch": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "platform": platform.to_dict(), "platform_text": platform.describe(), "torch": torch.__version__,
        "python": py_platform.python_version(), "host": py_platform.node(),
        "timing": {"method": "CUDA events, median" if platform.device_type == "cuda" else "perf_counter, median",
                   **config.settings.to_dict()},
        "flops": "2*(d_qk+d_v) per attended (q,k) pair per head; fwd+bwd = 3.5x fwd",
        **config.extra, "summary": summarize(rows), "rows": rows,
    }


def render_table(result: dict[str, Any]) -> str:
    """Plain-text table: TFLOP/s per engine, '*' the fastest, and each policy's pick with its ratio."""
    rows = result["rows"]
    engines = sorted({pid for row in rows for pid in row["engines"]})
    policies = [p for p in POLICIES if any(p in row["picks"] for row in rows)]
    label_w = max([len(f"{r['label']} {r['mode']}") for r in rows] + [5]) + 2
    names = [short_name(e) for e in engines]
    col_w = [max(9, len(n) + 2) for n in names]
    head = f"{'shape':<{label_w}}" + "".join(f"{n:>{w}}" for n, w in zip(names, col_w))
    head += "".join(f"  {p + ' pick (ratio)':<26}" for p in policies)
    lines = ["TFLOP/s per engine (* = fastest); each policy's pick and time(pick)/time(fastest)", head]
    for row in rows:
        line = f"{row['label'] + ' ' + row['mode']:<{label_w}}"
        for pid, w in zip(engines, col_w):
            r = row["engines"].get(pid)
            cell = "-" if r is None else ("error" if "error" in r else _tflops_text(r["tflops"]))
            if pid == row.get("fastest"):
                cell += "*"
            line += f"{cell:>{w}}"
        for policy in policies:
            pick, ratio = row["picks"].get(policy), row["ratios"].get(policy)
            text = f"{short_name(pick) if pick else 'none'} ({ratio:.3f})" if ratio else \
                f"{short_name(pick) if pick else 'none'} (-)"
            line += f"  {text:<26}"
        lines.append(line)
    for policy, s in result.get("summary", {}).items():
        if s.get("rated"):
            lines.append(f"{policy}: worst {s['worst_ratio']:.3f} ({s['worst_shape']}), mean {s['mean_ratio']:.3f}, "
                         f"{s['over_target']}/{s['rated']} over {s['target']}")
    return "\n".join(lines)


def _tflops_text(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"
