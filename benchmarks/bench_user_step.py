"""What a user's step costs, per engine: the performance profile's measurements and the default policy's check.

Each row is one attention call as a model makes it: `DotProductAttention` called as a user calls it (module
__call__, autograd, forward then backward into the leaf tensors' .grad in training; forward under no_grad in
inference). For every eligible provider a module is built with that provider forced; beside them run
  - `default`: the module with nothing forced (the default policy's pick), and `order` (ATTN_DISPATCH_POLICY=order
    semantics: Transformer Engine's order) when --policies asks for them;
  - `measured` (--measured): a module deciding under ATTN_DISPATCH_POLICY=measured (it times the candidates on its
    first call, into a tuning cache of its own; the default module reads an empty one, so that the profile alone
    decides there);
  - `checked` (--checked): a module deciding under ATTN_DISPATCH_POLICY=checked (the profile, and on its first call
    timing the candidates the profile predicts within 10% of each other, into a third cache);
  - `pick_twin` (with --policies): a second module with the default's pick forced: the A/A control. It and the
    pick's own column run the same engine on the same inputs, so `aa_ratio` (pick_twin / pick forced) is the
    timer's own spread on that row; a difference between columns of that order is noise, not a finding;
  - `sdpa`: torch.nn.functional.scaled_dot_product_attention on [b, h, s, d] views of the same tensors, with its
    output brought back to the module's [.., h*d] layout, wherever SDPA can express the call (not thd, not
    padding, not sliding windows, not bottom-right causal with sq != skv).
All of them are timed interleaved on the same inputs (attn_dispatch.policy.timing.time_interleaved: CUDA events,
a warm period, balanced round orders, median). --timer block (the default): a sample of a call under 2 ms is a ~3 ms
block of back-to-back calls of one function after a synchronisation and a lead-in call: every function is timed in a
steady loop of itself, whatever ran before it (longer calls: one call per sample). --timer call: one call per
sample, back to back on one stream (how the first fit and eval runs were timed): a short call's sample then depends
on the queue the previous function left (host time hidden or not), and the same engine in two modules differed by up
to 13%. The JSON's settings record which (block_ms 0 or absent: per call); `calls_per_sample` per row.
--split adds, per provider (and SDPA), its step split into host and GPU time (split_times): the GPU time alone
is the calls' time queued behind a spin kernel, the host time the wall time of enqueueing them; --split-only
records that alone (no interleaved timing): the profile's host/GPU measurements; with --refreshes P (a provider
whose host path changed), the profile takes P's splits of this run's calls from this run alone. --grid takes a
comma list, run in one process (flash-attn-4 compiles each kernel variant once per process).
A packed (thd) row first steps each FlexAttention provider once on the pack one token shorter (settle_flex_on_packs):
its compiled copy then runs the dynamic graph a training loop's packs of varying length run, whatever the
process's history (the row's flex_settled_dynamic). JSON is rewritten after every row.

    python3 benchmarks/bench_user_step.py --grid fit --out $OUT/fit.json            # profile measurements
    python3 benchmarks/bench_user_step.py --grid eval --policies --out $OUT/eval.json # held-out check
    python3 benchmarks/bench_user_step.py --grid eval-fresh --policies --measured --out $OUT/fresh.json
--tag stock checks that neither cudnn-frontend nor flash-attn-4 can be imported (a stock `pip install torch`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import platform as py_platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from attn_dispatch import DotProductAttention, Platform, selection
from attn_dispatch.benchmarking.cases import CASE_GRIDS, Case
from attn_dispatch.decision import NoBackendAvailableError
from attn_dispatch.policy.timing import TimerSettings, attention_flops, time_interleaved
from host_probe import cpu_model, measured_launch_us, python_us  # benchmarks/: a diagnostic of the run's host

SETTINGS = TimerSettings(warmup=2, reps=12, max_reps=200, target_ms=40.0, warm_ms=40.0)  # --timer call
BLOCK_MS = 3.0  # --timer block: one sample's block of calls (calls over 2 ms: one call per sample)
USER_COLUMNS = frozenset({"default", "measured", "checked", "sdpa", "pick_twin"})  # always timed in full


def settings_for(timer: str) -> TimerSettings:
    if timer not in ("block", "call"):
        raise ValueError(f"timer={timer!r} is not a timer; expected 'block' or 'call'")
    return dataclasses.replace(SETTINGS, block_ms=BLOCK_MS if timer == "block" else 0.0)
DTYPE = torch.bfloat16


def make_tensors(case: Case, device: torch.device, seed: int):
    """Leaf q, k, v in the case's layout (+ thd offsets), and the output gradient."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(DTYPE)

    kwargs = {}
    if case.fmt == "thd":
        if case.seqlens:  # lengths the grid fixed when it was drawn
            lens = list(case.seqlens)
        else:
            lo = max(1, case.s // 2)
            lens = torch.randint(lo, case.s + 1, (case.b,), generator=torch.Generator().manual_seed(seed)).tolist()
            lens[0] = case.s  # the longest sequence is the case's length
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        t = int(cu[-1])
        q, k, v = draw(t, case.h, case.d), draw(t, case.hkv, case.d), draw(t, case.hkv, case.dv)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=case.s, max_seqlen_kv=case.s)
        out_shape = (t, case.h * case.dv)
    elif case.fmt == "sbhd":
        q, k, v = (draw(case.s, case.b, case.h, case.d), draw(case.skv, case.b, case.hkv, case.d),
                   draw(case.skv, case.b, case.hkv, case.dv))
        out_shape = (case.s, case.b, case.h * case.dv)
    else:
        q, k, v = (draw(case.b, case.s, case.h, case.d), draw(case.b, case.skv, case.hkv, case.d),
                   draw(case.b, case.skv, case.hkv, case.dv))
        out_shape = (case.b, case.s, case.h * case.dv)
    for x in (q, k, v):
        x.requires_grad_(case.train)
    dout = draw(*out_shape)
    return q, k, v, dout, kwargs


def module_for(case: Case, backend: str | None, device: torch.device) -> DotProductAttention:
    m = DotProductAttention(case.h, (case.d, case.dv), num_gqa_groups=case.hkv, qkv_format=case.fmt,
                            attn_mask_type=case.mask, window_size=case.window, backend=backend)
    return m.to(device).train(case.train)


def sdpa_fn(case: Case):
    """SDPA as a user writes it for this call, or None where it cannot express it."""
    if case.fmt == "thd" or case.mask not in ("no_mask", "causal") or case.window is not None:
        return None
    causal, gqa = case.mask == "causal", case.h != case.hkv
    perm, back = ((0, 2, 1, 3), (0, 2, 1, 3)) if case.fmt == "bshd" else ((1, 2, 0, 3), (2, 0, 1, 3))

    def run(q, k, v):
        o = F.scaled_dot_product_attention(q.permute(*perm), k.permute(*perm), v.permute(*perm), is_causal=causal,
                                           enable_gqa=gqa)
        o = o.permute(*back)
        return o.reshape(*o.shape[:2], -1)
    return run


def sdpa_choice(case: Case, q, k, v) -> str | None:
    """Which kernel SDPA dispatches to (torch._fused_sdp_choice), for the record."""
    try:
        perm = (0, 2, 1, 3) if case.fmt == "bshd" else (1, 2, 0, 3)
        idx = torch._fused_sdp_choice(q.permute(*perm), k.permute(*perm), v.permute(*perm), None, 0.0,
                                      case.mask == "causal", enable_gqa=case.h != case.hkv)
        return torch.nn.attention.SDPBackend(idx).name
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"unknown ({type(exc).__name__})"


SPIN_CYCLES_PER_MS = 2.0e6  # torch.cuda._sleep spins GPU clock cycles: ~1.7-2 GHz on the H100 and H200


def block_ms_per_call(run, calls: int) -> float:
    """Milliseconds per call of `calls` calls of run enqueued back to back between two CUDA events (no
    synchronisation before them: a steady loop of one function)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        run()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def calls_per_block(first_ms: float, block_ms: float) -> int:
    """How many back-to-back calls of a step that took first_ms fill a block of ~block_ms (1 to 16)."""
    return max(1, min(16, round(block_ms / max(first_ms, 1e-3))))


@torch.no_grad()  # as time_interleaved runs steps: a training step enables grad itself
def split_times(run, samples: int = 5, block_ms: float = 3.0) -> dict[str, float]:
    """One function's step split into host and GPU time, medians over `samples` samples of n calls (n: a block of
    ~block_ms, at most 16):
    - step_ms: n calls back to back between two events (a steady loop of one function);
    - gpu_ms: the same n calls enqueued behind a spin kernel (torch.cuda._sleep, private: a benchmark's tool)
      that keeps the GPU busy until all n are queued: events after the spin bracket the GPU's work alone;
    - host_ms: the wall time of enqueueing the n calls behind the spin (no launch waits on the GPU);
    - covered: the share of samples whose spin outlasted the enqueueing. Under 1, the GPU idled before the host
      finished: a provider that synchronises inside its call (host_ms then includes the wait), or a spin too short.
    """
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    n = calls_per_block(first_ms, block_ms)
    spin_ms = 6.0 + 3.0 * n * min(first_ms, 4.0)  # host time per call is at most the call's, and a few ms
    step, gpu, host, covered = [], [], [], 0
    for _ in range(samples):
        step.append(block_ms_per_call(run, n))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_ms * SPIN_CYCLES_PER_MS))
        a.record()
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        host.append((time.perf_counter() - t0) * 1e3 / n)
        covered += not a.query()  # the spin (ahead of event a) still running
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / n)
    return {"step_ms": statistics.median(step), "gpu_ms": statistics.median(gpu),
            "host_ms": statistics.median(host), "covered": covered / samples, "calls_per_sample": n}


def one_token_shorter(q, k, v, dout, kwargs):
    """A packed call's inputs with its last sequence one token shorter (dropped where it holds one): the next batch
    of a training loop, of another total length."""
    cu = kwargs["cu_seqlens_q"]
    t = int(cu[-1])
    last = t - int(cu[-2])
    cut = cu[:-1].clone() if last <= 1 and cu.numel() > 2 else torch.cat([cu[:-1], cu[-1:] - 1])
    keep = int(cut[-1])

    def part(x):
        return x.detach()[:keep].clone().requires_grad_(x.requires_grad)
    return part(q), part(k), part(v), dout[:keep], {**kwargs, "cu_seqlens_q": cut, "cu_seqlens_kv": cut}


def settle_flex_on_packs(case: Case, eligible: list[str], q, k, v, dout, kwargs) -> list[str]:
    """A packed call through FlexAttention: one step on a pack of another total length first. Its compiled copy
    turns dynamic at a second length (and a later process on the same machine can start dynamic, from torch's saved
    automatic-dynamic state); a training loop's packs differ in length every step, so the dynamic graph is what a user
    times. Measured on the H200, the dynamic one ran 0.88-1.33x the static one (results/masks/
    flex_packed_dynamic_h200.json): timed from whichever the process's history gave, flex's rows scattered. The
    flex providers that were settled."""
    if case.fmt != "thd":
        return []
    settled = []
    shorter = one_token_shorter(q, k, v, dout, kwargs)
    for provider in eligible:
        if provider.startswith("flex_attention"):
            try:  # the engine's compiled copies are shared by every module of it: one step settles them all
                step_fn(module_for(case, provider, q.device), *shorter, case.train)()
            except Exception:  # noqa: BLE001 - the timed calls record the provider's error
                continue
            settled.append(provider)
    return settled


def step_fn(call, q, k, v, dout, kwargs, train: bool):
    if train:
        def step():
            q.grad = k.grad = v.grad = None  # optimizer.zero_grad(set_to_none=True), as a training loop does
            with torch.enable_grad():
                out = call(q, k, v, **kwargs)
                out.backward(dout)
        return step

    def infer():
        call(q, k, v, **kwargs)
    return infer


@contextlib.contextmanager
def environment_set(**values: str):
    """os.environ with these values for the block (the policy and its cache are read when a module decides)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_case(case: Case, policies: bool, seed: int, only: set[str] | None, device: torch.device,
             measured_cache: str | None = None, settings: TimerSettings = SETTINGS, split: str = "",
             checked_cache: str | None = None) -> dict:
    """One row. split: "" (none), "also" (the interleaved times and each provider's split_times), "only"."""
    q, k, v, dout, kwargs = make_tensors(case, device, seed)
    default = module_for(case, None, device)
    t0 = time.perf_counter()
    selection.clear_cache()
    with torch.no_grad():
        default(q.detach(), k.detach(), v.detach(), **kwargs)
    first_decision_ms = (time.perf_counter() - t0) * 1e3
    decision = default.last_decision
    params = decision.params
    eligible = [vd.id for vd in decision.verdicts if vd.eligible and (only is None or vd.id in only)]
    if case.s > 4096 or case.skv > 4096:  # the unfused engine at long lengths: minutes and tens of GB
        eligible = [p for p in eligible if not p.startswith("unfused")]
    fns = {}
    for provider in eligible:
        fns[provider] = step_fn(module_for(case, provider, device), q, k, v, dout, kwargs, case.train)
    settled = settle_flex_on_packs(case, eligible, q, k, v, dout, kwargs)
    never_cut = set(USER_COLUMNS)
    if policies:
        fns["default"] = step_fn(default, q, k, v, dout, kwargs, case.train)
        order_pick = selection.explain(selection_params(decision), policy="order").chosen
        if decision.chosen in fns:  # the A/A control: the pick forced in a second module
            fns["pick_twin"] = step_fn(module_for(case, decision.chosen, device), q, k, v, dout, kwargs, case.train)
            never_cut.add(decision.chosen)
    measured = measured_module = None
    if measured_cache is not None:
        # selection.clear_cache() before it, never after: that makes every module's plan stale, and this one would
        # plan again under the restored environment (the auto policy) and its column would time the default's pick
        # under the measured policy's name.
        measured_module, fns["measured"], first_ms = first_call_under("measured", measured_cache, case, device, q, k,
                                                                      v, dout, kwargs, clear=True)
        measured = (measured_module.last_decision.chosen, first_ms)
    checked = checked_module = None
    if checked_cache is not None:
        # No clear_cache() here: the measured module would plan again under the restored environment. The decision
        # is cached apart all the same (the environment's policy is part of its key).
        checked_module, fns["checked"], first_ms = first_call_under("checked", checked_cache, case, device, q, k, v,
                                                                    dout, kwargs, clear=False)
        checked = (checked_module.last_decision.chosen, first_ms)
    sdpa = sdpa_fn(case)
    if sdpa is not None:
        fns["sdpa"] = step_fn(sdpa, q, k, v, dout, {}, case.train)
    if split == "only":
        timings, errors = {}, {}
    else:
        timings, errors = time_interleaved(fns, device.type, settings, cutoff_ratio=4.0,
                                           never_cut=frozenset(never_cut))
    splits = {}
    if split:
        for name in [*eligible, "sdpa"]:
            if name in fns:
                try:
                    splits[name] = split_times(fns[name])
                except Exception as exc:  # noqa: BLE001 - recorded with the row's errors
                    errors[f"split {name}"] = exc
        q.grad = k.grad = v.grad = None
    from attn_dispatch.params import AttentionParams

    p = AttentionParams(**params)
    flops = attention_flops(p, "fwd_bwd" if case.train else "fwd")
    if case.fmt == "thd":  # attention_flops counts full-length sequences; thd's are shorter
        lens = (kwargs["cu_seqlens_q"][1:] - kwargs["cu_seqlens_q"][:-1]).tolist()
        flops *= sum(x * x for x in lens) / (len(lens) * case.s * case.s)
    row = {
        "label": case.label, "case": case.to_dict(), "params": params,
        "times_ms": {n: t.median_ms for n, t in timings.items()},
        "cut_short": sorted(n for n, t in timings.items() if t.cut_short),
        "tflops": {n: flops / (t.median_ms * 1e9) for n, t in timings.items()},
        "errors": {n: error_text(e) for n, e in errors.items()},
        "default_pick": decision.chosen, "policy": decision.policy,
        "first_decision_ms": first_decision_ms,
        "sdpa_kernel": sdpa_choice(case, q, k, v) if sdpa is not None else None,
    }
    if splits:
        row["split"] = splits
    if settled:
        row["flex_settled_dynamic"] = settled
    if any(t.calls_per_sample > 1 for t in timings.values()):
        row["calls_per_sample"] = {n: t.calls_per_sample for n, t in timings.items()}
    if policies:
        row["order_pick"] = order_pick
        row["default_reason"] = decision.policy_reason
        times = row["times_ms"]
        if "pick_twin" in times and decision.chosen in times:
            row["aa_ratio"] = times["pick_twin"] / times[decision.chosen]
    if measured is not None:
        row["measured_pick"], row["measured_first_ms"] = measured
        ran = measured_module.last_decision.chosen  # what the timed calls ran (a plan made again would differ)
        if ran != measured[0]:
            row["errors"]["measured"] = f"the measured module ran {ran}, not its tuned pick {measured[0]}"
        # what the tuning itself recorded (its times, the candidates it cut, errors), to tell a tuning miss from the
        # timer's noise afterwards
        from attn_dispatch.policy.measured import MeasuredPolicy

        entry = MeasuredPolicy(directory=measured_cache).lookup(p, Platform.detect()) or {}
        row["measured_entry"] = {k: entry.get(k) for k in ("times_ms", "probe_ms", "errors", "skipped", "tuning_s",
                                                          "lengths")}
    if checked is not None:
        row["checked_pick"], row["checked_first_ms"] = checked
        decision = checked_module.last_decision
        row["checked_reason"] = decision.policy_reason[:600]
        if decision.chosen != checked[0] or decision.policy != "checked":
            row["errors"]["checked"] = f"the checked module ran {decision.chosen} under {decision.policy}"
        from attn_dispatch.policy.measured import MeasuredPolicy

        entry = MeasuredPolicy(directory=checked_cache).lookup(p, Platform.detect())  # None: nothing was timed
        row["checked_entry"] = None if entry is None else {k: entry.get(k) for k in ("times_ms", "probe_ms",
                                                                                     "tuning_s")}
    return row


def first_call_under(policy: str, cache: str, case: Case, device: torch.device, q, k, v, dout, kwargs, *,
                     clear: bool) -> tuple[DotProductAttention, object, float]:
    """A module deciding under `policy` (its policy= setting) with a tuning cache of its own, called once: it decides
    (and tunes) on that call, with the very tensors it is then timed on; later calls take its plan. (module, its
    step, the first call's ms). clear: selection.clear_cache() first."""
    with environment_set(ATTN_DISPATCH_CACHE_DIR=cache):
        if clear:
            selection.clear_cache()
        module = module_for(case, None, device)
        module.policy = policy
        step = step_fn(module, q, k, v, dout, kwargs, case.train)
        t0 = time.perf_counter()
        step()
        first_ms = (time.perf_counter() - t0) * 1e3
    q.grad = k.grad = v.grad = None
    return module, step, first_ms


def selection_params(decision):
    from attn_dispatch.params import AttentionParams

    return AttentionParams(**decision.params)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": py_platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "platform": Platform.detect().describe(), "launch_us": measured_launch_us(),
            "cpu": cpu_model(), "python_us": python_us()}
    from importlib import metadata

    for name, dist in (("cudnn_frontend", "nvidia-cudnn-frontend"), ("flash_attn_4", "flash-attn-4"),
                       ("transformers", "transformers")):
        try:
            info[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[name] = "absent"
    return info


def error_text(exc: BaseException) -> str:
    """A failure as a row records it: a forced provider's refusal as its own reasons (the message's head repeats the
    call and platform, which the row has), anything else as its type and message, cut to 400 characters."""
    if isinstance(exc, NoBackendAvailableError) and exc.decision.forced:
        forced = [v for v in exc.decision.verdicts if v.id == exc.decision.forced]
        reasons = "; ".join(f"[{r.code}] {r.message}" for v in forced for r in v.reasons)
        return f"{type(exc).__name__}: {exc.decision.forced} refused: {reasons or 'no reason recorded'}"[:1000]
    return f"{type(exc).__name__}: {exc}"[:400]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", required=True, help=f"a grid, or a comma list run in one process: {sorted(CASE_GRIDS)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", action="store_true", help="also time the default module (and record order's pick)")
    ap.add_argument("--providers", default=None, help="comma list: time only these providers")
    ap.add_argument("--tag", default="", help="a label for this stack ('stock': checked to lack the extra engines)")
    ap.add_argument("--measured", action="store_true",
                    help="also time a module under ATTN_DISPATCH_POLICY=measured (tuned on its first call)")
    ap.add_argument("--checked", action="store_true",
                    help="also time a module under ATTN_DISPATCH_POLICY=checked (timing close calls on its first)")
    ap.add_argument("--max-seconds", type=float, default=540.0, help="stop starting new rows after this")
    ap.add_argument("--start", type=int, default=0, help="skip the first N cases")
    ap.add_argument("--match", default=None, help="only the cases whose label contains this text")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the harness")
    ap.add_argument("--timer", default="block", choices=("block", "call"),
                    help="a short call's sample: a ~3 ms block of back-to-back calls after a sync (block) or one "
                         "call (call; how the first fit and eval runs were timed)")
    ap.add_argument("--split", action="store_true", help="also split each provider's step into host and GPU time")
    ap.add_argument("--split-only", action="store_true", help="the split alone, no interleaved timing")
    ap.add_argument("--refreshes", default="",
                    help="comma list of providers whose host path changed since the profile's runs: in the "
                         "profile, this run's splits of them replace every earlier run's for the calls it measured, "
                         "scaled onto those runs' host speed by F.sdpa's host times (split here too)")
    ap.add_argument("--reps", type=int, default=SETTINGS.reps,
                    help="least samples per function (a long call gets this many; short ones more, to target_ms)")
    args = ap.parse_args()
    settings = dataclasses.replace(settings_for(args.timer), reps=args.reps,
                                   max_reps=max(SETTINGS.max_reps, args.reps))
    if args.tag == "stock":
        extra = [m for m in ("cudnn", "flash_attn.cute") if _importable(m)]
        if extra:
            sys.exit(f"--tag stock, but {', '.join(extra)} can be imported here: run without the wheel bundles on "
                     "PYTHONPATH")
    measured_cache = checked_cache = None
    if args.measured or args.checked:
        # The default module must not read the other modules' tunings (auto prefers a bucket tuned here).
        os.environ["ATTN_DISPATCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn-dispatch-auto-")
    if args.measured:
        measured_cache = tempfile.mkdtemp(prefix="attn-dispatch-measured-")
    if args.checked:
        checked_cache = tempfile.mkdtemp(prefix="attn-dispatch-checked-")
    grids = args.grid.split(",")
    unknown = [g for g in grids if g not in CASE_GRIDS]
    if unknown:
        ap.error(f"--grid {','.join(unknown)}: not a grid; expected a comma list of {', '.join(sorted(CASE_GRIDS))}")
    if (args.split or args.split_only) and args.device != "cuda":
        ap.error(f"--split needs a CUDA device (its spin kernel); got --device {args.device}")
    split = "only" if args.split_only else ("also" if args.split else "")
    cases = [c for g in grids for c in CASE_GRIDS[g]()][args.start:]
    if args.match:
        cases = [c for c in cases if args.match in c.label]
    only = set(args.providers.split(",")) if args.providers else None
    refreshes = [p for p in args.refreshes.split(",") if p]
    if refreshes and not split:
        ap.error("--refreshes replaces providers' host/GPU splits: it needs --split or --split-only")
    bad = [p for p in refreshes if ":" not in p or (only is not None and p not in only)]
    if bad:
        ap.error(f"--refreshes {','.join(bad)}: not a provider id this run times (family:provider"
                 + (f", one of --providers {args.providers}" if only is not None else "") + ")")
    result = {"grid": args.grid, "split": split, "tag": args.tag, "refreshes": refreshes,
              "settings": settings.to_dict(),
              "environment": environment(),
              "rows": [], "failed": []}
    out = Path(args.out)
    started = time.perf_counter()
    for i, case in enumerate(cases):
        if time.perf_counter() - started > args.max_seconds:
            result["stopped_at"] = i + args.start
            break
        try:
            row = run_case(case, args.policies, args.seed + i, only, torch.device(args.device), measured_cache,
                           settings, split, checked_cache)
            result["rows"].append(row)
            times = row["times_ms"] or {n: r["step_ms"] for n, r in row.get("split", {}).items()}
            best = min((t for n, t in times.items() if ":" in n), default=float("nan"))
            extra = ""
            if "default" in times:
                extra += f" default {row['default_pick']} {times['default'] / best:.3f}"
            if "measured" in times:
                extra += f" measured {row['measured_pick']} {times['measured'] / best:.3f}"
            if "checked" in times:
                extra += f" checked {row['checked_pick']} {times['checked'] / best:.3f}"
            if "sdpa" in times:
                extra += f" sdpa {times['sdpa'] / best:.3f}"
            if "aa_ratio" in row:
                extra += f" A/A {row['aa_ratio']:.3f}"
            if "split" in row:
                extra += " host/GPU " + " ".join(f"{n} {r['host_ms']:.2f}/{r['gpu_ms']:.2f}"
                                              + ("" if r["covered"] == 1 else f" (covered {r['covered']:.1f})")
                                              for n, r in row["split"].items())
            fastest = min(((t, n) for n, t in times.items() if ":" in n), default=(0, "-"))[1]
            print(f"[{i + args.start:3d}] {case.label:44s} best {fastest:22s} {best:8.3f} ms{extra}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one row failing is recorded, the grid goes on
            result["failed"].append({"label": case.label, "error": traceback.format_exc()[-2000:]})
            print(f"[{i + args.start:3d}] {case.label}: FAILED {type(exc).__name__}: {exc}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(result, indent=1))
    print(f"{len(result['rows'])} rows, {len(result['failed'])} failed, {result['seconds']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
