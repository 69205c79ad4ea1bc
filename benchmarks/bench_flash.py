"""FlashAttention engines on the GPU, side by side in one run: every installed FlashAttention provider, flash-attn-4
called directly (its own flash_attn_func), and torch's SDPA flash path (sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
which runs the same FA2 kernels as our flash_attn_2:torch provider.

bf16, D in {64, 128, 256}, S in {1k, 4k, 16k}, B x H as in ../shared/device/README.md, causal and not; forward and
forward+backward TFLOP/s (4*B*H*S^2*D flops forward, half when causal, 3.5x that for forward+backward), each timing
the median of triton.testing.do_bench with its defaults (25 ms warm-up, 100 ms of repeats, L2 flushed before
each call), as the README's grid was measured. Inputs are fresh contiguous bshd tensors (SDPA reads [b, h, s, d]
views of them); forward runs under torch.no_grad(), forward+backward in grad mode with dO given.

Timings on one GPU drift with its clock (power and temperature), and a single do_bench per implementation once made
two runs of the same kernel differ by up to 8%. So:
- the grid is measured in passes (every point, then every point again, up to --rounds, while a point's timing
  still fits in --budget seconds from the start); within a point each provider is timed right next to the same
  kernels called directly, kind by kind, in an order rotated and swapped each pass;
- each cell is the median over passes; a ratio (our provider / its reference) is the median of the per-pass ratios
  of timings taken back to back;
- nvidia-smi is sampled in the background (SM clock, power, temperature, clock-event reasons), and every cell
  carries the median SM clock and power seen while it was timed;
- the headline (flash-attn-4 forward at D=128, S=4k, non-causal; target >= 680 TFLOP/s) is measured first, after
  a 2 s warm-up, over --headline-rounds interleaved rounds of our engine, flash_attn_func with the same inputs and
  flash_attn_func with inputs that do not require grad (the README's setting);
- the engines' host-side cost per call is measured on a tiny shape, engine vs direct call.
JIT is kept out of the timings: every configuration runs once before it is timed; flash-attn-4's first call per
configuration (compile + run) is reported separately, with the compile seconds the engine measured.
One failing cell never stops the others; the JSON goes to --out and a table is printed last.
Usage: python3 benchmarks/bench_flash.py --out $OUT/flash.json [--quick] [--rounds 3] [--budget 150]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attn_dispatch.backends.base import AttnAux, AttnConfig  # noqa: E402
from gpu_timing import bench, tflops  # noqa: E402  (benchmarks/, the script's own folder)

GRID = [  # (D, S, B, H) from the device README
    (64, 1024, 32, 16), (64, 4096, 8, 16), (64, 16384, 2, 16),
    (128, 1024, 32, 16), (128, 4096, 8, 16), (128, 16384, 2, 16),
    (256, 1024, 32, 8), (256, 4096, 8, 8), (256, 16384, 2, 8),
]
HEADLINE = (128, 4096, 8, 16)
ENGINES = ("flash_attn_4:cute", "flash_attn_3:interface", "flash_attn_2:package", "flash_attn_2:torch")
REFERENCE = {"flash_attn_4:cute": "fa4_direct", "flash_attn_2:torch": "sdpa_flash"}  # ours -> the same kernels
TARGET_FA4_FWD = 680.0        # TFLOP/s, D=128 S=4k non-causal: within a few % of flash-attn-4's own call there
TARGET_TORCH_VS_SDPA = 0.97   # flash_attn_2:torch within 3% of torch's SDPA flash path
KINDS = ("fwd", "fwd_bwd")


# --------------------------------------------------------------------------------------------------------------
# GPU state: nvidia-smi in a background thread
# --------------------------------------------------------------------------------------------------------------
class GpuSampler:
    """Samples SM clock, power, temperature and clock-event reasons every `interval` s while the benchmark runs."""

    BASE = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")
    REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer, older drivers

    def __init__(self, interval: float = 0.25):
        self.interval, self.samples, self.error = interval, [], None
        self._stop = threading.Event()
        self._fields = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        self._device = device if device.isdigit() else "0"

    def _query(self, fields) -> list[str]:
        out = subprocess.run(["nvidia-smi", "-i", self._device, f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip() or out.stdout.strip())
        return [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]

    def start(self) -> "GpuSampler":
        for reasons in self.REASONS + (None,):
            fields = self.BASE + ((reasons,) if reasons else ())
            try:
                self._query(fields)
                self._fields = fields
                break
            except Exception as exc:  # noqa: BLE001 - no nvidia-smi: the benchmark runs without clock data
                self.error = f"{type(exc).__name__}: {exc}"
        if self._fields:
            self.error = None
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                values = self._query(self._fields)
                self.samples.append((time.perf_counter(), parse_sample(self._fields, values)))
            except Exception as exc:  # noqa: BLE001
                self.error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def during(self, t0: float, t1: float) -> dict:
        return summarize_samples([s for t, s in self.samples if t0 <= t <= t1]
                                 or [s for t, s in self.samples if t0 - self.interval <= t <= t1 + self.interval])


def parse_sample(fields, values) -> dict:
    names = {"clocks.sm": "sm_mhz", "clocks.max.sm": "max_sm_mhz", "power.draw": "power_w",
             "power.limit": "power_limit_w", "temperature.gpu": "temp_c"}
    sample = {}
    for field, value in zip(fields, values):
        if field in names:
            try:
                sample[names[field]] = float(value)
            except ValueError:
                sample[names[field]] = None
        else:
            sample["reasons"] = value
    return sample


# nvidia-smi clock-event reason bits that lower the clock (idle and application settings excluded)
REASON_BITS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
               0x80: "hw_power_brake"}


def decode_reasons(value: str | None) -> list[str]:
    try:
        bits = int(value, 16) if value else 0
    except ValueError:
        return []
    return [name for bit, name in REASON_BITS.items() if bits & bit]


def summarize_samples(samples: list[dict]) -> dict:
    if not samples:
        return {}
    out = {"samples": len(samples)}
    for key in ("sm_mhz", "power_w", "temp_c"):
        values = [s[key] for s in samples if s.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 1)
    out["max_sm_mhz"] = samples[-1].get("max_sm_mhz")
    out["power_limit_w"] = samples[-1].get("power_limit_w")
    reasons = sorted({r for s in samples for r in decode_reasons(s.get("reasons"))})
    if reasons:
        out["clock_limited_by"] = reasons
    return out


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------
def timing_groups(names: list[str], passes: int) -> list[list[str]]:
    """Each provider next to the same kernels called directly (timed back to back, kind by kind), the groups in an
    order rotated every pass and each group's members swapped every other pass, so drift favours no one."""
    groups, placed = [], set()
    for ours, theirs in REFERENCE.items():
        if ours in names and theirs in names:
            group = [ours, theirs] + [n for n in names if n.startswith(theirs + "_")]
            groups.append(group)
            placed.update(group)
    groups += [[n] for n in names if n not in placed]
    shift = passes % max(len(groups), 1)
    groups = groups[shift:] + groups[:shift]
    return [g[::-1] if passes % 2 else g for g in groups]


def paired_ratio(ours: list[float | None], theirs: list[float | None]) -> float | None:
    """Median over passes of theirs_ms / ours_ms (> 1: ours faster), from timings taken back to back."""
    ratios = [t / o for o, t in zip(ours, theirs) if o and t]
    return round(statistics.median(ratios), 3) if ratios else None


# --------------------------------------------------------------------------------------------------------------
# what runs
# --------------------------------------------------------------------------------------------------------------
def installed_engines() -> tuple[dict, dict]:
    """{provider: engine} for every FlashAttention provider whose table passes its platform/package checks here."""
    from attn_dispatch import AttentionParams, EnvFlags, Platform
    from attn_dispatch.backends import get_engine
    from attn_dispatch.constraints import TABLES

    platform, env = Platform.detect(), EnvFlags.from_environ({})
    probe = AttentionParams(dtype="bf16", batch_size=1, num_heads=16, head_dim_qk=128, max_seqlen_q=1024)
    engines, absent = {}, {}
    for provider in ENGINES:
        table = TABLES[provider]
        topics = {c.code: c.topic for c in table.checks}
        reasons = [r.message for r in table.evaluate(probe, platform, env).reasons
                   if topics.get(r.code) in ("platform", "package", "environment")]
        if reasons:
            absent[provider] = reasons
            continue
        start = time.perf_counter()
        try:
            engines[provider] = get_engine(provider)
        except Exception as exc:  # noqa: BLE001 - an engine that fails to load is reported, the rest still run
            absent[provider] = [f"failed to load: {type(exc).__name__}: {exc}"]
            continue
        print(f"  loaded {provider} in {time.perf_counter() - start:.1f} s", flush=True)
    return engines, absent


class Inputs:
    """Fresh bshd q, k, v (requiring grad) and dO for one grid point."""

    def __init__(self, d: int, s: int, b: int, h: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.q, self.k, self.v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                                  .requires_grad_() for _ in range(3))
        self.dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def clear_grads(self) -> None:
        for t in (self.q, self.k, self.v):
            t.grad = None


def implementations(engines: dict, x: Inputs, causal: bool, scale: float, *, readme_style: bool = False,
                    with_sdpa: bool = True) -> dict:
    """name -> (forward callable, forward+backward callable or None). Forward runs under no_grad."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = x.q, x.k, x.v, x.dout
    cfg = AttnConfig(attn_mask_type="causal" if causal else "no_mask", window_size=(-1, 0) if causal else (-1, -1),
                     softmax_scale=scale)
    aux = AttnAux()

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    impls = {}
    for provider, engine in engines.items():
        impls[provider] = (no_grad(lambda e=engine: e(q, k, v, aux, cfg)[0]),
                           lambda e=engine: e(q, k, v, aux, cfg)[0].backward(dout))
    if "flash_attn_4:cute" in engines:
        from flash_attn.cute import flash_attn_func

        impls["fa4_direct"] = (no_grad(lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)[0]),
                               lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)[0].backward(dout))
        if readme_style:  # inputs that do not require grad, no autograd anywhere
            qd, kd, vd = (t.detach() for t in (q, k, v))
            impls["fa4_direct_inference"] = (lambda: flash_attn_func(qd, kd, vd, softmax_scale=scale,
                                                                     causal=causal)[0], None)
    if not with_sdpa:
        return impls
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    impls["sdpa_flash"] = (no_grad(sdpa), lambda: sdpa().backward(dt))
    return impls


def first_call(name: str, fn, x: Inputs, fa4, row: dict, kind: str) -> None:
    """Run a configuration once (JIT compile, handles, allocator) and record flash-attn-4's compile time."""
    events = len(fa4.jit_events) if fa4 is not None and name == "flash_attn_4:cute" else 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    x.clear_grads()
    if fa4 is not None and name == "flash_attn_4:cute":
        row[f"{name}_{kind}_first_call_s"] = round(time.perf_counter() - start, 3)
        row[f"{name}_{kind}_jit_s"] = round(sum(e["seconds"] for e in fa4.jit_events[events:]), 3)


def time_cell(name: str, kind: str, fn, x: Inputs, sampler: GpuSampler | None) -> dict:
    t0 = time.perf_counter()
    ms = bench(fn, grad_to_none=[x.q, x.k, x.v] if kind == "fwd_bwd" else None)
    x.clear_grads()
    cell = {"ms": round(ms, 4)}
    if sampler is not None:
        cell["gpu"] = sampler.during(t0, time.perf_counter())
    return cell


def measure_point(engines: dict, point: tuple, causal: bool, passes: int, row: dict, sampler,
                  *, headline: bool = False) -> float:
    """One pass over a point: every implementation, fwd and fwd+bwd, grouped and ordered by timing_groups.
    Returns the seconds spent on first calls (JIT compiles)."""
    d, s, b, h = point
    x = Inputs(d, s, b, h, seed=passes)
    impls = implementations(engines, x, causal, 1.0 / math.sqrt(d), readme_style=headline, with_sdpa=not headline)
    fa4 = engines.get("flash_attn_4:cute")
    first_seconds = 0.0
    for group in timing_groups(list(impls), passes):
        for index, kind in enumerate(KINDS):
            for name in group:
                fn = impls[name][index]
                if fn is None:
                    continue
                key = f"{name}_{kind}"
                try:
                    if f"{key}_first_call_done" not in row:
                        started = time.perf_counter()
                        first_call(name, fn, x, fa4, row, kind)
                        first_seconds += time.perf_counter() - started
                        row[f"{key}_first_call_done"] = True
                    row.setdefault(f"{key}_passes", []).append(time_cell(name, kind, fn, x, sampler))
                except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the grid
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    row.setdefault(f"{key}_passes", []).append({"ms": None})
    del x, impls
    torch.cuda.empty_cache()
    return first_seconds


def finish_row(row: dict) -> dict:
    """Medians over passes, TFLOP/s, and paired ratios of our providers to the same kernels called directly."""
    d, s, b, h, causal = row["D"], row["S"], row["B"], row["H"], row["causal"]
    names = sorted({k[:-len("_fwd_passes")] for k in row if k.endswith("_fwd_passes")})
    for name in names:
        for kind in KINDS:
            cells = row.get(f"{name}_{kind}_passes")
            if not cells:
                continue
            times = [c["ms"] for c in cells if c.get("ms")]
            if not times:
                continue
            ms = statistics.median(times)
            row[f"{name}_{kind}_ms"] = round(ms, 4)
            row[f"{name}_{kind}_tflops"] = round(tflops(b, h, s, d, causal, ms, kind == "fwd_bwd"), 1)
            row[f"{name}_{kind}_spread"] = round((max(times) - min(times)) / ms, 3)
            clocks = [c["gpu"]["sm_mhz"] for c in cells if c.get("gpu", {}).get("sm_mhz")]
            if clocks:
                row[f"{name}_{kind}_sm_mhz"] = statistics.median(clocks)
    for ours, theirs in REFERENCE.items():
        for kind in KINDS:
            a = [c.get("ms") for c in row.get(f"{ours}_{kind}_passes", [])]
            t = [c.get("ms") for c in row.get(f"{theirs}_{kind}_passes", [])]
            ratio = paired_ratio(a, t)
            if ratio is not None:
                row[f"{ours}_vs_{theirs}_{kind}"] = ratio
    for key in [k for k in row if k.endswith("_first_call_done")]:
        del row[key]
    return row


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------
def headline(engines: dict, rounds: int, sampler) -> dict | None:
    """flash-attn-4 at D=128, S=4k, B=8, H=16, non-causal: round 0 as the README's grid ran (first calls, then
    do_bench's own 25 ms warm-up: 'cold'), then 2 s of load to bring the clocks to their steady state under it,
    then rounds 1.. ('steady'). Each kind's cold and steady medians are kept apart, with the SM clock of each."""
    if "flash_attn_4:cute" not in engines:
        return None
    d, s, b, h = HEADLINE
    only = {"flash_attn_4:cute": engines["flash_attn_4:cute"]}
    row = {"D": d, "S": s, "B": b, "H": h, "causal": False}
    measure_point(only, HEADLINE, False, 0, row, sampler, headline=True)
    x = Inputs(d, s, b, h, seed=123)
    warm = implementations(only, x, False, 1.0 / math.sqrt(d), readme_style=True, with_sdpa=False)["fa4_direct"][0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(20):
            warm()
        torch.cuda.synchronize()
    row["warmup_gpu"] = sampler.during(t0, time.perf_counter()) if sampler else {}
    del x, warm
    for r in range(1, max(rounds, 2)):
        measure_point(only, HEADLINE, False, r, row, sampler, headline=True)
    for key in [k for k in row if k.endswith("_passes")]:
        name_kind = key[:-len("_passes")]
        kind_is_bwd = name_kind.endswith("_fwd_bwd")
        times = [c.get("ms") for c in row[key]]
        for label, part in (("cold", times[:1]), ("steady", times[1:])):
            part = [t for t in part if t]
            if part:
                ms = statistics.median(part)
                row[f"{name_kind}_{label}_tflops"] = round(tflops(b, h, s, d, False, ms, kind_is_bwd), 1)
        clocks = [c.get("gpu", {}).get("sm_mhz") for c in row[key]]
        row[f"{name_kind}_cold_sm_mhz"], row[f"{name_kind}_steady_sm_mhz"] = clocks[0], (
            statistics.median([c for c in clocks[1:] if c]) if any(clocks[1:]) else None)
    return finish_row(row)


def host_overhead(engines: dict) -> dict:
    """Host-side microseconds per call on a tiny shape (GPU time negligible): engine vs flash_attn_func."""
    if "flash_attn_4:cute" not in engines:
        return {}
    x = Inputs(128, 512, 1, 1, seed=7)  # several tiles each way: the grid's compile keys, not a one-block one
    impls = implementations({"flash_attn_4:cute": engines["flash_attn_4:cute"]}, x, False, 0.125, with_sdpa=False)
    out = {}
    for name in ("flash_attn_4:cute", "fa4_direct"):
        for kind, fn in zip(KINDS, impls[name]):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            x.clear_grads()
            out[f"{name}_{kind}_us_per_call"] = round((time.perf_counter() - start) / 200 * 1e6, 1)
    return out


def versions(absent: dict) -> dict:
    meta = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "flash-attn", "flash-attn-3", "triton"):
        try:
            meta[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            meta[dist] = None
    meta["not_benchmarked"] = absent
    return meta


def summary(rows: list[dict], head: dict | None) -> dict:
    out = {}
    if head:
        out["fa4_fwd_d128_s4k_tflops"] = head.get("flash_attn_4:cute_fwd_tflops")
        out["fa4_direct_fwd_d128_s4k_tflops"] = head.get("fa4_direct_fwd_tflops")
        out["fa4_direct_inference_fwd_d128_s4k_tflops"] = head.get("fa4_direct_inference_fwd_tflops")
        out["fa4_fwd_bwd_d128_s4k_tflops"] = head.get("flash_attn_4:cute_fwd_bwd_tflops")
        out["fa4_fwd_d128_s4k_cold_steady_tflops"] = (head.get("flash_attn_4:cute_fwd_cold_tflops"),
                                                      head.get("flash_attn_4:cute_fwd_steady_tflops"))
        out["fa4_engine_vs_direct_headline"] = {k: head.get(f"flash_attn_4:cute_vs_fa4_direct_{k}") for k in KINDS}
        value = out["fa4_fwd_d128_s4k_tflops"]
        out["fa4_fwd_target_met"] = bool(value and value >= TARGET_FA4_FWD)
    for ours, theirs in REFERENCE.items():
        for kind in KINDS:
            ratios = [r[f"{ours}_vs_{theirs}_{kind}"] for r in rows if f"{ours}_vs_{theirs}_{kind}" in r]
            if ratios:
                out[f"{ours}_vs_{theirs}_{kind}_min"] = min(ratios)
                out[f"{ours}_vs_{theirs}_{kind}_median"] = round(statistics.median(ratios), 3)
    for kind in KINDS:
        key = f"flash_attn_2:torch_vs_sdpa_flash_{kind}_min"
        if key in out:
            out[f"torch_vs_sdpa_{kind}_target_met"] = out[key] >= TARGET_TORCH_VS_SDPA
    jit = [(r["D"], r["causal"], kind, r.get(f"flash_attn_4:cute_{kind}_jit_s"))
           for r in rows for kind in KINDS if r.get(f"flash_attn_4:cute_{kind}_jit_s")]
    out["fa4_jit_s"] = [{"D": d, "causal": c, "phase": kind, "compile_s": s} for d, c, kind, s in jit]
    return out


SHORT = {"flash_attn_4:cute": "fa4", "fa4_direct": "fa4-direct", "flash_attn_3:interface": "fa3",
         "flash_attn_2:package": "fa2-pkg", "flash_attn_2:torch": "fa2-torch", "sdpa_flash": "sdpa-flash",
         "fa4_direct_inference": "fa4-direct-inf"}


def _cell(r: dict, name: str) -> str:
    f, fb = r.get(f"{name}_fwd_tflops"), r.get(f"{name}_fwd_bwd_tflops")
    return f"{(f'{f:.0f}' if f else '-'):>7} / {(f'{fb:.0f}' if fb else '-'):<5}"


def print_table(rows: list[dict], names: list[str], result: dict) -> None:
    m, s, head = result["machine"], result["summary"], result.get("headline")
    lines = [""]
    if head and "error" in head:
        lines.append(f"Headline failed: {head['error']}")
    elif head:
        gpu = head.get("flash_attn_4:cute_fwd_passes", [{}])[-1].get("gpu", {})
        rounds = len(head.get("flash_attn_4:cute_fwd_passes", []))
        lines.append(f"Headline D={head['D']} S={head['S']} B={head['B']} H={head['H']} non-causal, {rounds} "
                     "interleaved rounds (TFLOP/s fwd / fwd+bwd, median of all; fwd cold = round 0, steady = after "
                     "2 s of load):")
        for name in ("flash_attn_4:cute", "fa4_direct", "fa4_direct_inference"):
            lines.append(f"  {SHORT[name]:>15} {_cell(head, name)}  fwd cold {head.get(f'{name}_fwd_cold_tflops')} "
                         f"({head.get(f'{name}_fwd_cold_sm_mhz')} MHz), steady "
                         f"{head.get(f'{name}_fwd_steady_tflops')} ({head.get(f'{name}_fwd_steady_sm_mhz')} MHz), "
                         f"spread {head.get(f'{name}_fwd_spread')}")
        lines.append(f"  GPU during warm-up: {head.get('warmup_gpu')}; last round: {gpu}")
    lines += [f"FlashAttention TFLOP/s (fwd / fwd+bwd), bf16, {m['device']}, torch {m['torch']}, flash-attn-4 "
              f"{m.get('flash-attn-4')}; median of up to {result['passes']} pass(es) per cell",
              f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} " + " ".join(f"{SHORT.get(n, n):>15}" for n in names)
              + "   fa2/sdpa fa4/direct (paired, fwd|fwd+bwd)"]
    for r in rows:
        ratios = " ".join(f"{r.get(f'{o}_vs_{t}_fwd', '-')}|{r.get(f'{o}_vs_{t}_fwd_bwd', '-')}"
                          for o, t in (("flash_attn_2:torch", "sdpa_flash"), ("flash_attn_4:cute", "fa4_direct")))
        lines.append(f"{r['D']:>4} {r['S']:>6} {str(r['B']) + 'x' + str(r['H']):>6} {str(r['causal']):>6} "
                     + " ".join(f"{_cell(r, n):>15}" for n in names) + "   " + ratios)
        for key in sorted(k for k in r if k.endswith("_error")):
            lines.append(f"      {key}: {r[key][:140]}")
    if s.get("fa4_fwd_d128_s4k_tflops") is not None:
        cold, steady = s["fa4_fwd_d128_s4k_cold_steady_tflops"]
        lines.append(f"flash-attn-4 engine fwd D=128 S=4k non-causal: {s['fa4_fwd_d128_s4k_tflops']} TFLOP/s (cold "
                     f"{cold}, steady {steady}; target >= {TARGET_FA4_FWD:.0f}: "
                     f"{'met' if s['fa4_fwd_target_met'] else 'NOT met'}); flash_attn_func "
                     f"{s['fa4_direct_fwd_d128_s4k_tflops']}, without grad "
                     f"{s['fa4_direct_inference_fwd_d128_s4k_tflops']}")
    for ours, theirs in REFERENCE.items():
        for kind in KINDS:
            key = f"{ours}_vs_{theirs}_{kind}"
            if f"{key}_min" in s:
                target = (f" (target >= {TARGET_TORCH_VS_SDPA}: "
                          f"{'met' if s[f'torch_vs_sdpa_{kind}_target_met'] else 'NOT met'})"
                          if ours == "flash_attn_2:torch" else "")
                lines.append(f"{ours} speed / {theirs}, {kind}: min {s[f'{key}_min']}, median {s[f'{key}_median']}"
                             + target)
    if result.get("host_overhead"):
        lines.append(f"host us per call (tiny shape): {result['host_overhead']}")
    if s.get("fa4_jit_s"):
        lines.append("flash-attn-4 JIT compile seconds per configuration (first call, excluded from timings): "
                     + ", ".join(f"D{j['D']}{'c' if j['causal'] else ''}/{j['phase']}={j['compile_s']}"
                                 for j in s["fa4_jit_s"]))
    if m["not_benchmarked"]:
        lines.append("not benchmarked: " + "; ".join(f"{p}: {' / '.join(r)[:120]}"
                                                     for p, r in m["not_benchmarked"].items()))
    gpu = result.get("gpu", {})
    lines.append(f"GPU over the run: {gpu.get('whole_run') or gpu.get('error')}")
    lines.append(f"total {result['seconds']} s")
    print("\n".join(lines), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="S = 1k and 4k only")
    ap.add_argument("--rounds", type=int, default=3, help="most passes over the grid")
    ap.add_argument("--budget", type=float, default=150.0,
                    help="seconds (from the start) within which later passes must fit, point by point")
    ap.add_argument("--headline-rounds", type=int, default=7)
    args = ap.parse_args()
    started = time.perf_counter()
    sampler = GpuSampler().start()
    engines, absent = installed_engines()
    head = None
    try:
        head = headline(engines, args.headline_rounds, sampler)
    except Exception as exc:  # noqa: BLE001
        head = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
    print(f"  headline done at {time.perf_counter() - started:.0f} s", flush=True)
    host = {}
    try:
        host = host_overhead(engines)
    except Exception as exc:  # noqa: BLE001
        host = {"error": f"{type(exc).__name__}: {exc}"}
    points = [(p, c) for p in GRID if not (args.quick and p[1] > 4096) for c in (False, True)]
    rows = {key: {"D": key[0][0], "S": key[0][1], "B": key[0][2], "H": key[0][3], "causal": key[1]} for key in points}
    cost: dict = {}  # seconds a point's timings took in the last pass (first calls and JIT excluded)
    passes = 0
    for n in range(args.rounds):
        if n > 0 and time.perf_counter() - started + min(cost.values(), default=0.0) > args.budget:
            break
        for key in points:
            if n > 0 and time.perf_counter() - started + cost.get(key, 0.0) > args.budget:
                break  # medians take the passes each cell got
            point, causal = key
            start = time.perf_counter()
            try:
                first = measure_point(engines, point, causal, n, rows[key], sampler)
            except Exception as exc:  # noqa: BLE001
                rows[key]["error"] = f"{type(exc).__name__}: {exc}"
                rows[key]["trace"] = traceback.format_exc(limit=3)
                first = 0.0
            cost[key] = time.perf_counter() - start - first
            if n == 0:
                print(f"  D={point[0]} S={point[1]} causal={causal} done at {time.perf_counter() - started:.0f} s",
                      flush=True)
        passes = n + 1
        print(f"  pass {passes} ended at {time.perf_counter() - started:.0f} s", flush=True)
    sampler.stop()
    grid = [finish_row(rows[key]) for key in points]
    names = list(engines) + (["fa4_direct"] if "flash_attn_4:cute" in engines else []) + ["sdpa_flash"]
    result = {"machine": versions(absent), "implementations": names, "passes": passes, "headline": head,
              "host_overhead": host, "grid": grid, "seconds": round(time.perf_counter() - started, 1),
              "gpu": {"whole_run": summarize_samples([s for _, s in sampler.samples]), "error": sampler.error,
                      "samples": [(round(t - started, 2), s) for t, s in sampler.samples]}}
    result["summary"] = summary(grid, head if head and "error" not in head else None)
    if "flash_attn_4:cute" in engines:
        result["fa4_jit_events"] = engines["flash_attn_4:cute"].jit_events
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print_table(grid, names, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
