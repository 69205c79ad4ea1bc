"""The probe: run boundary configurations on the real engines and hold the constraint tables to them.

Each (provider, configuration) is run for real, forward and backward, against the unfused engine in
float64 on the same device, and classed:
  agreed      - declared eligible and works, or declared ineligible and fails
  too_strict  - declared ineligible but works (a table rule that costs users a backend)
  too_loose   - declared eligible but fails or is wrong (a table rule that lets a crash or a wrong result through)
Engines run in a worker process: a call that breaks the CUDA context only costs that worker.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

from .params import AttentionParams
from .backends import get_engine
from .synthetic import cast_call, make_call
from .env import EnvFlags
from .platform import Platform
from .constraints import TABLES

TOLERANCE = {"float16": 5e-3, "bfloat16": 2.5e-2, "float32": 2e-3, "float64": 1e-6}  # fp32: engines may use TF32
STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
          "CUDA error: an illegal instruction")


def boundary_configs(device_type: str = "cuda") -> list[AttentionParams]:
    """Configurations at and around each limit the tables declare, one or two factors at a time."""
    dtype = "bfloat16" if device_type == "cuda" else "float32"
    base = AttentionParams(dtype=dtype, qkv_format="bshd", batch_size=2, num_heads=4, head_dim_qk=64,
                           max_seqlen_q=128, attn_mask_type="no_mask", device_type=device_type)
    out: list[AttentionParams] = [base]
    add = out.append
    for d in ("float16", "float32"):
        add(base.replace(dtype=d))
    for hd in (8, 32, 40, 72, 80, 96, 100, 128, 160, 192, 200, 224, 256, 264, 320):
        add(base.replace(head_dim_qk=hd))
    for hd_qk, hd_v in ((128, 64), (64, 128), (192, 128), (128, 256), (256, 128), (64, 512)):
        add(base.replace(head_dim_qk=hd_qk, head_dim_v=hd_v))
    for sq, skv in ((1, 1), (17, 17), (63, 63), (64, 64), (65, 65), (127, 127), (129, 129), (500, 500), (512, 512),
                    (513, 513), (1000, 1000), (64, 128), (128, 64), (100, 300), (1, 512), (512, 1)):
        add(base.replace(max_seqlen_q=sq, max_seqlen_kv=skv))
    for heads, groups in ((8, 1), (8, 2), (8, 4), (12, 3), (16, 16)):
        add(base.replace(num_heads=heads, num_gqa_groups=groups))
    for fmt in ("bshd", "sbhd", "thd"):
        for mask in ("no_mask", "padding", "causal", "causal_bottom_right", "padding_causal",
                     "padding_causal_bottom_right", "arbitrary"):
            if fmt == "thd" and mask in ("no_mask", "causal", "causal_bottom_right", "arbitrary"):
                continue  # thd is padded by construction
            add(base.replace(qkv_format=fmt, attn_mask_type=mask))
            if "causal" in mask:
                add(base.replace(qkv_format=fmt, attn_mask_type=mask, max_seqlen_q=64, max_seqlen_kv=192))
    for mask, window in (("no_mask", (32, 32)), ("no_mask", (0, 0)), ("no_mask", (64, -1)), ("causal", (16, 0)),
                         ("causal", (100, 0)), ("causal_bottom_right", (16, 0)), ("padding_causal", (24, 0))):
        add(base.replace(attn_mask_type=mask, window_size=window))
        add(base.replace(attn_mask_type=mask, window_size=window, max_seqlen_q=96, max_seqlen_kv=160))
    for kind in ("pre_scale_bias", "post_scale_bias"):
        for shape in ("1hss", "b1ss", "bhss", "11ss"):
            add(base.replace(bias_type=kind, bias_shape=shape))
        add(base.replace(bias_type=kind, bias_shape="1hss", bias_requires_grad=True))
    for slopes in ("h", "bh"):
        add(base.replace(bias_type="alibi", alibi_slopes_shape=slopes))
        add(base.replace(bias_type="alibi", alibi_slopes_shape=slopes, attn_mask_type="causal"))
    for softmax in ("off-by-one", "learnable"):
        add(base.replace(softmax_type=softmax))
        add(base.replace(softmax_type=softmax, attn_mask_type="causal"))
    add(base.replace(dropout=0.1))
    add(base.replace(deterministic=True))
    add(base.replace(deterministic=True, attn_mask_type="causal", num_heads=8, num_gqa_groups=2))
    add(base.replace(is_training=False))
    add(base.replace(is_training=False, attn_mask_type="causal", max_seqlen_q=1, max_seqlen_kv=700))
    add(base.replace(return_max_logit=True))
    return out


@dataclass
class ProbeResult:
    provider: str
    params: dict[str, Any]
    declared_eligible: bool
    declared_reasons: list[str]
    ran: bool
    works: bool
    error: str | None
    errors: dict[str, float] = field(default_factory=dict)  # relative errors: out, dq, dk, dv, ...
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.declared_eligible == self.works:
            return "agreed"
        return "too_loose" if self.declared_eligible else "too_strict"

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "verdict": self.verdict}


def _rel(a, b) -> float:
    import torch

    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    # A gradient that is exactly zero in theory (one key per row) makes a pure relative error meaningless:
    # the floor treats errors under 1e-2 per element (rms) as relative to 1.
    floor = 1e-2 * math.sqrt(max(b.numel(), 1))
    return (a - b).norm().item() / max(b.norm().item(), floor)


def _valid_rows(t, call, params: AttentionParams, which: str):
    """Rows past a sequence's real length are unspecified for padded bshd/sbhd: compare only real ones."""
    import torch

    if params.qkv_format == "thd" or not params.has_padding:
        return t
    lens = call.seqlens_q if which == "q" else call.seqlens_kv
    seq_dim = 1 if params.qkv_format == "bshd" else 0
    keep = torch.zeros(t.shape[seq_dim], t.shape[1 - seq_dim], dtype=torch.bool, device=t.device)
    for i, n in enumerate(lens):
        keep[:n, i] = True
    if seq_dim == 1:
        keep = keep.t()
    return t[keep]


def run_one(provider: str, params: AttentionParams, device: str, seed: int) -> tuple[dict[str, float], bool]:
    """Run provider and the float64 reference on the same random call; relative errors and 'works'."""
    import torch


    engine, reference = get_engine(provider), get_engine("unfused:pytorch")
    call = make_call(params, device=device, seed=seed)
    ref = cast_call(call, torch.float64)
    out, lse, _ = engine(call.q, call.k, call.v, call.aux, call.cfg)
    errors = {}
    training = params.is_training
    if params.dropout and training:  # no reference for a random mask: finite values and gradients suffice
        out.float().pow(2).sum().backward()
        finite = all(torch.isfinite(t.grad).all().item() for t in (call.q, call.k, call.v))
        return {"finite": 0.0 if finite and torch.isfinite(out).all().item() else math.inf}, finite
    ref_out, _, _ = reference(ref.q, ref.k, ref.v, ref.aux, ref.cfg)
    errors["out"] = _rel(_valid_rows(out, call, params, "q"), _valid_rows(ref_out, call, params, "q"))
    if training:
        dout = torch.randn_like(out, dtype=torch.float64)
        (out.double() * dout).sum().backward()
        (ref_out * dout).sum().backward()
        for name, mine, theirs, rows in (("dq", call.q, ref.q, "q"), ("dk", call.k, ref.k, "kv"),
                                         ("dv", call.v, ref.v, "kv")):
            errors[name] = _rel(_valid_rows(mine.grad, call, params, rows),
                                _valid_rows(theirs.grad, call, params, rows))
        for name, mine, theirs in (("dbias", call.aux.bias, ref.aux.bias),
                                   ("dsink", call.aux.softmax_offset, ref.aux.softmax_offset)):
            if mine is not None and mine.requires_grad:
                errors[name] = _rel(mine.grad, theirs.grad) if mine.grad is not None else math.inf
    torch.cuda.synchronize() if device == "cuda" else None
    tolerance = TOLERANCE[params.dtype]
    return errors, all(e <= tolerance for e in errors.values())


def _worker(jobs, results, device: str, seed: int) -> None:
    platform, env = Platform.detect(), EnvFlags.from_environ()
    while True:
        job = jobs.get()
        if job is None:
            return
        index, provider, params_dict = job
        params = AttentionParams(**params_dict)
        verdict = TABLES[provider].evaluate(params, platform, env)
        start = time.perf_counter()
        try:
            errors, works = run_one(provider, params, device, seed + index)
            error, ran = None, True
        except Exception as exc:  # noqa: BLE001 - the probe records every failure as data
            errors, works, ran = {}, False, False
            error = f"{type(exc).__name__}: {str(exc).strip()[:600]}"
            if not any(s in error for s in STICKY) and "NotImplementedError" not in error:
                error += "\n" + traceback.format_exc(limit=3)[-600:]
        result = ProbeResult(provider, params_dict, verdict.eligible, [r.code for r in verdict.reasons], ran,
                             works, error, errors, time.perf_counter() - start)
        results.put((index, result))
        if error and any(s in error for s in STICKY):
            return  # the CUDA context is gone: the parent starts a fresh worker


def _next_result(results, worker, timeout: float):
    """The worker's next result; None when it died or hung on the job in hand."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not worker.is_alive():
                try:
                    return results.get(timeout=1.0)
                except queue.Empty:
                    return None
    return None


def probe(providers: list[str], configs: list[AttentionParams], *, device: str, seed: int = 0,
          per_call_timeout: float = 180.0) -> Iterator[ProbeResult]:
    """Yield one result per (provider, configuration), restarting the worker after a fatal error."""
    ctx = mp.get_context("spawn")
    pending = [(i, p, c.to_dict()) for p in providers for i, c in enumerate(configs)]
    while pending:
        jobs, results = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=_worker, args=(jobs, results, device, seed), daemon=True)
        worker.start()
        for job in pending:
            jobs.put(job)
        jobs.put(None)
        done = 0
        for index, provider, params_dict in pending:
            item = _next_result(results, worker, per_call_timeout)
            done += 1
            if item is None:
                worker.kill()
                declared = TABLES[provider].evaluate(AttentionParams(**params_dict), Platform.detect(),
                                                     EnvFlags.from_environ())
                yield ProbeResult(provider, params_dict, declared.eligible, [r.code for r in declared.reasons],
                                  False, False, "the worker died or hung on this configuration")
                break
            yield item[1]
            if not worker.is_alive() and results.empty():
                break
        worker.join(timeout=5)
        pending = pending[done:]
