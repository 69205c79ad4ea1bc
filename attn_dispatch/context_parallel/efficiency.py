"""Predicted context-parallel efficiency: a step's fwd+bwd time on P GPUs against one GPU on the whole sequence,
from measured compute and transfer rates, so a comm type can be picked without a trial run. Pure arithmetic.

The model (per comm type, one rank; t(bytes) = bytes / rate):
- p2p: P ring steps of equal work (load-balanced); step i's K/V hop hides under step i-1's compute, each step's
  critical path being the longer of the two plus a per-step cost (host issue, merge):
  forward = c + (P-1) (max(c, t(kv)) + step). Backward (p2p.py) runs the ring reversed from the K/V block the
  forward ended on and ends on the local diagonal block: step i computes while the next step's K/V (none for the
  diagonal) and the previous block's dK/dV sum (float32, 2 t(kv), for P > 2; one engine result, t(kv), for P = 2)
  travel, so backward = sum_i max(c_bwd, moving_i) + (P-1) step: the last hop, the sum to its owner, runs under
  the diagonal block and nothing is left exposed. With a window (window_ring.py), only the steps the window
  reaches, the forward's ring again (K/V and a float32 sum triple the bytes for P > 2), then one exposed hop of
  dK/dV to the owner; p2p's backward ran so too before the reversed ring (exposed_dkv_hop=True: runs recorded
  then). A window within the neighbouring chunks moves only its keys, as all_gather does (window_exchange.py); so
  does a2a.
  A ring hop's rate is its transport's (copy_engine.ring_for): the copy engines' pull, which needs no SMs and runs
  as fast beside attention as alone, or NCCL's send/recv, whose kernels slow down beside attention kernels
  (nccl_ring_gbps; an exposed hop, with nothing beside it, runs at link_gbps).
- a2a: q, k, v (then out) cross all-to-alls around whole-sequence attention on heads / P; with G head groups the
  exchanges overlap attention except 1/G of them: max(c, comm) (G-1)/G + (c + comm)/G, and the same backward.
- a2a+p2p: one-shot all-to-alls over the a2a group of A ranks (q, k, v to heads, out back; dout, then dq, dk, dv),
  nothing overlapped, around the p2p ring of P / A ranks on heads / A (its K/V hop: as many bytes as p2p's on P).
- all_gather: the K/V it needs gathered before, the float32 dK/dV reduce-scattered after; nothing overlaps.
Every call adds `call_ms` and every merged block `step_ms`.
Timing: what a model's step sees, its layers' calls back to back (bench_cp.py --chain 4), the host issuing kernels
while the GPU still runs earlier ones. A fwd+bwd started from an idle GPU (--chain 1) gives the host no head start, so
the GPU waits wherever the host issues kernels no faster than the GPU runs them (a 4x32k ring: about as fast), and
the ranks' launch skew shows: `idle_ms` more per fwd+bwd (from_idle=True), charged to the backward (a p2p forward
alone measured 0.05-0.18 ms slower from idle).
One GPU: compute alone at the same rates. FLOPs: 4 b h d per (query, key) pair forward, 2.5x that backward
(five matrix products against two, FlashAttention-2's accounting).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..constraints.cp_bands import key_exchange, steps_needed
from .copy_engine import TRANSPORT_ENV, TRANSPORTS, requested_transport
from .head_groups import resolve_head_groups

BWD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class Rates:
    machine: str
    fwd_tflops: float   # attention forward, measured
    bwd_tflops: float   # attention backward, measured (FLOPs = BWD_FLOPS_RATIO x forward's)
    link_gbps: float    # one rank's rate through NCCL with nothing beside it: collectives, an exposed hop (fitted)
    call_ms: float      # fixed cost of each CP forward or backward call, calls back to back (fitted)
    step_ms: float      # cost of each ring step or merged block beyond its compute (fitted)
    source: str
    # where a windowed call runs another engine than an unwindowed one (torch's cuDNN SDPA takes no window), that
    # engine's measured rates; None: the same engine, the rates above
    windowed_fwd_tflops: float | None = None
    windowed_bwd_tflops: float | None = None
    # a ring hop's rate beside attention kernels (p2p, the ring of a2a+p2p): NCCL's send/recv (None: link_gbps) and
    # the copy engines' pull (copy_engine.py; None: not measured on this GPU, where 'auto' is predicted as NCCL)
    nccl_ring_gbps: float | None = None
    copy_engine_gbps: float | None = None
    # what a fwd+bwd adds when it starts from an idle GPU (measured); None: this GPU's runs were all timed so, and the
    # fitted costs above hold it (calls back to back are predicted at those costs, which are then too high)
    idle_ms: float | None = None


# fwd/bwd: the one-GPU rows (flash-attn-4, b1 h16 d128, causal, 32k and 128k). link_gbps, call_ms and step_ms are
# fitted to the 2-GPU rows (tests/test_cp_efficiency.py refits them); the 4-GPU rows check them. Timed one call from
# an idle GPU. Fit and check errors: benchmarks/results/README.md, "The CP efficiency model".
H100_NVLINK = Rates(
    "H100 80GB HBM3 SXM, NVLink (NV18)", fwd_tflops=680.0, bwd_tflops=624.0, link_gbps=110.0, call_ms=0.35,
    step_ms=0.64,
    source="benchmarks/results/cp/cp_h100x2.json and benchmarks/results/cp/cp_h100x4.json (bench_cp.py, torch "
           "2.11, NCCL 2.28.9, 2026-11-26)")
# fwd/bwd: the one-GPU rows (torch's cuDNN SDPA; FlashAttention-2 under a window, as the windowed CP rows ran).
# copy_engine_gbps and idle_ms are measured; link_gbps, call_ms, step_ms and nccl_ring_gbps are fitted to the 18 CP
# rows of the source (calls back to back, each with the transport it ran; tests/test_cp_efficiency.py refits them).
# Fit and check errors, and the runs left out that check it: benchmarks/results/README.md, "The CP efficiency model".
H200_NVLINK = Rates(
    "H200, NVLink (torch 2.11's cuDNN SDPA; FlashAttention-2 under a window)", fwd_tflops=605.0,
    bwd_tflops=526.0, link_gbps=335.0, call_ms=0.42, step_ms=0.19,
    source="benchmarks/results/cp/cp_h200x4_sm_copy.json (bench_cp.py --chain 4, torch 2.11, NCCL 2.28.9, "
           "2026-11-28)",
    windowed_fwd_tflops=289.0, windowed_bwd_tflops=308.0, nccl_ring_gbps=110.0, copy_engine_gbps=320.0, idle_ms=0.88)
RATES = {"h100": H100_NVLINK, "h200": H200_NVLINK}
MODELLED = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass(frozen=True)
class Call:
    """One CP call: total sequence length (all ranks), heads, head dim, batch, mask and window, bytes per element."""
    cp_size: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    causal: bool = True
    window: tuple[int, int] | None = None
    elem_bytes: int = 2
    a2a_size: int = 2  # a2a+p2p: ranks in the a2a group (the ring has cp_size / a2a_size)


@dataclass(frozen=True)
class Prediction:
    comm: str
    fwd_ms: float
    fwd_bwd_ms: float
    one_gpu_fwd_bwd_ms: float
    efficiency: float


def pairs(seqlen: int, causal: bool, window) -> float:
    """(query, key) pairs attended over one sequence."""
    left, right = window if window else (-1, 0 if causal else -1)
    right = 0 if causal else right
    total = 0.0
    for width in (left, right):  # keys on each side of the diagonal
        w = seqlen - 1 if width < 0 else min(width, seqlen - 1)
        total += w * seqlen - w * (w + 1) / 2
    return total + seqlen


def rates_for(device_name: str) -> Rates:
    """The rates recorded on the named GPU (a platform's device name, 'NVIDIA H200'); the H100's for any other."""
    return next((rates for key, rates in RATES.items() if key in device_name.lower()), H100_NVLINK)


def one_gpu_ms(call: Call, rates: Rates) -> tuple[float, float]:
    flops = 4 * call.batch * call.heads * call.head_dim * pairs(call.seqlen, call.causal, call.window)
    fwd_tflops, bwd_tflops = rates.fwd_tflops, rates.bwd_tflops
    if call.window and rates.windowed_fwd_tflops and rates.windowed_bwd_tflops:
        fwd_tflops, bwd_tflops = rates.windowed_fwd_tflops, rates.windowed_bwd_tflops
    return flops / (fwd_tflops * 1e9), BWD_FLOPS_RATIO * flops / (bwd_tflops * 1e9)


def ring_transport(rates: Rates, transport: str = "auto") -> str:
    """The transport a ring's hops are predicted with: 'auto' is copy_engine.ring_for's default, the copy engines
    where they were measured on this GPU (NVLink), else NCCL's send/recv."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not modelled; use one of {', '.join(sorted(TRANSPORTS))}")
    if transport == "auto":
        return "copy_engine" if rates.copy_engine_gbps else "nccl"
    if transport == "copy_engine" and not rates.copy_engine_gbps:
        raise ValueError(f"transport='copy_engine': no copy-engine rate was measured on {rates.machine}; "
                         "use 'nccl' or 'auto'")
    return transport


def _ring(p: int, steps: int, cf: float, cb: float, hop: float, lone_hop: float, step: float,
          exposed_dkv_hop: bool) -> tuple[float, float]:
    """(forward, backward) ms of a ring of p ranks over `steps` blocks of cf / cb ms each: a K/V hop takes `hop` beside
    a block's compute, `lone_hop` with nothing beside it (the exposed dK/dV hop)."""
    fwd = cf + (steps - 1) * (max(cf, hop) + step)
    if exposed_dkv_hop:  # the forward's ring again, then the sums' hop to their owners
        travel = hop if p == 2 else 3 * hop
        return fwd, cb + (steps - 1) * (max(cb, travel) + step) + (lone_hop if steps > 1 else 0.0)
    # reversed: step i moves the next K/V (none for the diagonal, the last) and the previous block's sum
    dkv_sum = hop if p == 2 else 2 * hop
    moving = [(hop if i + 1 < p - 1 else 0.0) + (dkv_sum if i > 0 else 0.0) for i in range(p)]
    return fwd, sum(max(cb, m) for m in moving) + (p - 1) * step


def predict(comm: str, call: Call, rates: Rates = H100_NVLINK, a2a_head_groups: int = 1, *,
            transport: str = "auto", exposed_dkv_hop: bool = False, from_idle: bool = False) -> Prediction:
    """transport: the ring's hops (p2p, the ring of a2a+p2p): 'auto' (what runs by default), 'copy_engine', 'nccl'.
    exposed_dkv_hop: p2p's backward without a window as it ran before the reversed ring (runs recorded then).
    from_idle: the fwd+bwd starts from an idle GPU (bench_cp.py --chain 1) instead of following a model's earlier
    layers."""
    if comm not in MODELLED:
        raise ValueError(f"comm={comm!r} has no efficiency model; modelled: {', '.join(MODELLED)}")
    p = call.cp_size
    a2a_size = call.a2a_size if comm == "a2a+p2p" else 1
    if p % a2a_size:
        raise ValueError(f"call.a2a_size={a2a_size} must divide call.cp_size={p} for comm='a2a+p2p'")
    ring_size = p // a2a_size
    fwd1, bwd1 = one_gpu_ms(call, rates)
    local = call.batch * call.seqlen / p  # tokens per rank
    kv = 2 * local * call.kv_heads * call.head_dim * call.elem_bytes  # also a2a+p2p's hop: P/A tokens, heads / A
    q = local * call.heads * call.head_dim * call.elem_bytes
    t = lambda n: n / (rates.link_gbps * 1e6)  # noqa: E731 - ms through NCCL with nothing beside it
    if ring_transport(rates, transport) == "copy_engine":
        hop = lone_hop = kv / (rates.copy_engine_gbps * 1e6)  # the copy engines need no SMs: the same beside compute
    else:
        hop, lone_hop = kv / ((rates.nccl_ring_gbps or rates.link_gbps) * 1e6), t(kv)
    step = rates.step_ms
    exchange = comm == "all_gather" or (call.window is not None
                                        and key_exchange(comm, "bshd", call.seqlen // (2 * p), call.window))
    if comm in ("p2p", "a2a+p2p") and not exchange:
        windowed = call.window is not None
        steps = steps_needed(ring_size, call.seqlen // (2 * ring_size), call.window) if windowed else ring_size
        fwd, bwd = _ring(ring_size, steps, fwd1 / p / steps, bwd1 / p / steps, hop, lone_hop, step,
                         windowed or exposed_dkv_hop)
        if comm == "a2a+p2p":  # one-shot all-to-alls: q, k, v to heads and out back; dout, then dq, dk, dv
            share = (a2a_size - 1) / a2a_size
            fwd += t((2 * q + kv) * share)
            bwd += t((2 * q + kv) * share)
    elif comm == "a2a" and not exchange:
        share, g = (p - 1) / p, a2a_head_groups
        cf, cb = fwd1 / p, bwd1 / p
        comm_f = t((2 * q + kv) * share)  # q, k, v in; out (q's size: one head_dim for q, k, v) back
        comm_b = t((2 * q + kv) * share)  # dout in; dq, dk, dv back
        fwd = max(cf, comm_f) * (g - 1) / g + (cf + comm_f) / g
        bwd = max(cb, comm_b) * (g - 1) / g + (cb + comm_b) / g
    else:
        moved = (p - 1) * kv
        if call.window:  # each of the rank's two query chunks fetches at most the window's keys
            moved = min(moved, 2 * kv * (call.window[0] + max(call.window[1], 0)) / (call.seqlen / p))
        blocks = 2 if call.causal or call.window else 1
        fwd = t(moved) + fwd1 / p + blocks * step
        bwd = bwd1 / p + 2 * t(moved) + blocks * step
    fwd, bwd = fwd + rates.call_ms, bwd + rates.call_ms + (rates.idle_ms or 0.0) * from_idle
    return Prediction(comm, fwd, fwd + bwd, fwd1 + bwd1, (fwd1 + bwd1) / (p * (fwd + bwd)))


def explain_lines(params, a2a_head_groups: int | None = None, rates: Rates = H100_NVLINK,
                  transport: str | None = None) -> list[str]:
    """What `attn-dispatch explain --cp-size N` prints under the decision: each comm type's predicted efficiency.
    params: AttentionParams with max_seqlen_q the LOCAL length (the CP convention). transport: the ring's, as
    ATTN_DISPATCH_CP_TRANSPORT names it; None: what that variable asks for now."""
    window = tuple(params.window_size) if params.has_sliding_window else None
    a2a_size = params.cp_a2a_size or 2
    call = Call(params.cp_size, params.max_seqlen_q * params.cp_size, params.num_heads, params.num_gqa_groups,
                params.head_dim_qk, params.batch_size, params.is_causal, window,
                elem_bytes=4 if str(params.dtype) in ("fp32", "float32") else 2, a2a_size=a2a_size)
    wanted = requested_transport() if transport is None else transport
    ring = ring_transport(rates, "auto" if wanted == "copy_engine" else wanted)  # unmeasured copy engines: NCCL's
    other = "nccl" if ring == "copy_engine" else ("copy_engine" if rates.copy_engine_gbps else None)
    lines = [f"predicted CP efficiency on {params.cp_size} GPUs: fwd+bwd against one GPU on the whole sequence "
             f"({call.seqlen} tokens = --seqlen x --cp-size)",
             f"  rates of {rates.machine}: {rates.source}; model: attn_dispatch/context_parallel/efficiency.py",
             "  " + _timing_words(rates)]
    for comm in MODELLED:
        note, groups = "", 1
        split = {"a2a": call.cp_size, "a2a+p2p": a2a_size}.get(comm)
        if split and (params.num_heads % split or params.num_gqa_groups % split or call.cp_size % split):
            lines.append(f"  {comm:<10}    n/a  heads {params.num_heads}/{params.num_gqa_groups} or cp size "
                         f"{call.cp_size} not divisible by {split}")
            continue
        if comm == "a2a":
            groups = resolve_head_groups(a2a_head_groups, params.num_heads, params.num_gqa_groups, call.cp_size,
                                         call.batch * params.max_seqlen_q * params.head_dim_qk)
            note = f"  ({groups} head groups; 1 group: {100 * predict(comm, call, rates, 1).efficiency:.1f}%)"
        if other and (comm == "p2p" or comm == "a2a+p2p" and call.cp_size > a2a_size):
            alt = predict(comm, call, rates, transport=other).efficiency
            note = f"  ({'NCCL send/recv' if other == 'nccl' else 'copy engines'}: {100 * alt:.1f}%)"
        if comm == "a2a+p2p":
            note = f"  (a2a group of {a2a_size}, ring of {call.cp_size // a2a_size})" + note
        pred = predict(comm, call, rates, groups, transport=ring)
        lines.append(f"  {comm:<10} {100 * pred.efficiency:5.1f}%  {pred.fwd_bwd_ms:8.2f} ms fwd+bwd per rank "
                     f"(one GPU {pred.one_gpu_fwd_bwd_ms:.2f} ms){note}")
    return lines + ["  " + _ring_words(rates, wanted, ring)]


def _timing_words(rates: Rates) -> str:
    if rates.idle_ms is None:
        return ("timing: one fwd+bwd from an idle GPU, the only timing recorded on this GPU (a model's layers back to "
                "back hide part of each call's fixed cost)")
    return (f"timing: a model's layers back to back (bench_cp.py --chain 4); one fwd+bwd from an idle GPU takes "
            f"{rates.idle_ms:.2f} ms more (--chain 1)")


def _ring_words(rates: Rates, wanted: str, ring: str) -> str:
    if ring == "copy_engine":
        return (f"ring hops (p2p, a2a+p2p): pulled by the copy engines, {rates.copy_engine_gbps:.0f} GB/s "
                f"({TRANSPORT_ENV}={wanted}: where the group's self-check passes)")
    rate = f"NCCL's send/recv, {rates.nccl_ring_gbps or rates.link_gbps:.0f} GB/s beside attention"
    if wanted == "nccl":
        return f"ring hops (p2p, a2a+p2p): {rate} ({TRANSPORT_ENV}=nccl)"
    return (f"ring hops (p2p, a2a+p2p): {rate} (the copy-engine ring, what {TRANSPORT_ENV}={wanted} runs where "
            f"its self-check passes, was not measured on this GPU)")
