"""Time engines on synthetic random inputs built from AttentionParams.

Engines that are compared are timed against each other, interleaved: after each one's first (possibly
JIT-compiling) call and a warm period in which they all run (the GPU settles at the clock it sustains under
load), every round times each engine once, in an order balanced over rounds for who goes first and who follows
whom (round_order), and each engine's result is the median over rounds. Timing them one after another instead
hands clock drift to whichever runs first: on the power-capped H100 here, the first engine timed after a pause ran
5-8% faster than in steady state, which was enough to flip close picks. On the GPU, CUDA events; on the CPU,
time.perf_counter. Engines run through the autograd wrapper the module calls (engine_step).

What one sample is (TimerSettings.block_ms):
- 0, per call: each call between two events, launched back to back on one stream, one synchronisation at the
  end. A call's events then measure its GPU time when the calls before it left a deep queue (its host time
  hidden), and host gaps too when they did not: the sample depends on what ran just before. Where a call's host
  time is near its GPU time the samples are bimodal and the median picks a mode by how often the round order put a
  GPU-heavy call first: the same engine in two modules differed by 6-13% on the H100.
- > 0, blocks: a synchronisation (empty queue), one untimed lead-in call, then n back-to-back calls of the same
  function between two events, n = block_ms / its estimate. Every sample is that function in a steady loop of
  itself, whatever ran before: max(host, GPU) per call, the cost a loop of that call pays (host launch overhead
  included where it is not hidden), which is what a user's step costs. The lead-in keeps the
  synchronisation's empty queue out of the timed calls. A function too long for two calls in a block (n < 2)
  is sampled one call at a time as above: its host time is a small share of it, and a lead-in would double what
  timing it costs (the long calls are most of a benchmark's time).

Cutting a far slower function short (cutoff_ratio / cutoff_ms) needs confirmation: its one-call estimate right
after a JIT compile or a graph build is no measurement of it, nor is one call in the shallow queue of the first
timed round, which exposes all of its host time (on the H100 a forward timed at 0.616 ms there ran at 0.113 ms),
so a function is cut only when the least of its estimate and `confirm` more samples (blocks where the timed
rounds use blocks) is still beyond the cutoff.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..params import TOP_LEFT_MASKS, AttentionParams, SeqLengths
from ..synthetic import make_call
from ..backends.base import takes_cached_path

if TYPE_CHECKING:
    import torch

    from ..backends.base import AttnAux, AttnConfig, Engine

MODES = ("fwd", "fwd_bwd")
BACKWARD_FLOP_FACTOR = 2.5  # backward ~ 2.5x forward flops (FlashAttention's accounting): fwd+bwd = 3.5x fwd


@dataclass(frozen=True)
class TimerSettings:
    """warmup: untimed calls per function (at least one: the first may JIT-compile). The second call is timed
    as the estimate that drives cutoffs and sizes the run (with warmup <= 1, no warm period and per-call samples it
    is also the first sample); a function over a cutoff is timed `confirm` more times before it is cut. Then
    warm_ms of untimed interleaved rounds (the clock settles), then timed rounds: at least `reps` samples per
    function, more (up to max_reps) until the fastest has run for target_ms. block_ms: 0 for one call per
    sample, else the length of a sample's block of back-to-back calls (see the module docstring)."""
    warmup: int = 3
    reps: int = 10
    max_reps: int = 100
    target_ms: float = 50.0
    warm_ms: float = 0.0
    confirm: int = 2
    block_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("warmup", "reps", "max_reps", "confirm"):
            value = getattr(self, name)
            least = 0 if name in ("warmup", "confirm") else 1
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        if self.max_reps < self.reps:
            raise ValueError(f"max_reps={self.max_reps} must be >= reps={self.reps}")
        for name in ("target_ms", "warm_ms", "block_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int
    samples_ms: list[float] = field(default_factory=list, repr=False)
    cut_short: bool = False  # stopped after its estimate (and confirmation): far slower than the cutoff
    calls_per_sample: int = 1  # > 1: each sample is a block of that many calls, divided by their number

    def to_dict(self) -> dict[str, Any]:
        result = {"median_ms": self.median_ms, "min_ms": self.min_ms, "reps": self.reps}
        if self.cut_short:
            result["cut_short"] = True
        if self.calls_per_sample > 1:
            result["calls_per_sample"] = self.calls_per_sample
        return result


def mode_of(params: AttentionParams) -> str:
    """What a call costs: forward alone in inference, forward + backward in training."""
    return "fwd_bwd" if params.is_training else "fwd"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; expected one of {', '.join(MODES)}")
    return mode


# --- flops ----------------------------------------------------------------------------------------------

def attended_pairs(params: AttentionParams) -> int:
    """(query, key) pairs one head of one sequence attends to under the mask and window (full-length sequences),
    in closed form (a fresh decision under the default policy asks; a loop over rows cost ~1 ms at 16k)."""
    sq, skv = params.max_seqlen_q, params.max_seqlen_kv
    left, right = params.window_size
    if left < 0 and right < 0:
        return sq * skv
    # 'causal' aligns the diagonal top-left; every other mask (Transformer Engine's rule) bottom-right
    offset = 0 if params.attn_mask_type in TOP_LEFT_MASKS else skv - sq
    far = 1 << 62
    c_hi = offset + right if right >= 0 else far   # row i sees keys up to min(skv - 1, i + c_hi)
    c_lo = offset - left if left >= 0 else -far    # and from max(0, i + c_lo)
    return band_sum(0, sq, skv, c_hi, c_lo)


def band_sum(start: int, stop: int, cols: int, a: int, b: int) -> int:
    """sum over rows i in [start, stop) of max(0, min(cols - 1, i + a) - max(0, i + b) + 1): the columns a band
    [i + b, i + a] keeps of [0, cols), in closed form (piecewise linear between the rows where a clip starts)."""
    total = 0
    cuts = sorted({start, stop, min(max(cols - 1 - a, start), stop), min(max(-b, start), stop)})
    for i0, i1 in zip(cuts, cuts[1:]):
        hi_moves, lo_moves = i0 + a < cols - 1, i0 + b >= 0  # both hold across [i0, i1)
        count_at_0 = (a if hi_moves else cols - 1) - (b if lo_moves else 0) + 1
        total += _sum_clipped(count_at_0, int(hi_moves) - int(lo_moves), i0, i1)
    return total


def _sum_clipped(a: int, slope: int, i0: int, i1: int) -> int:
    """sum over i in [i0, i1) of max(0, a + slope * i), slope in {-1, 0, 1}."""
    if slope == 0:
        return max(0, a) * (i1 - i0)
    if slope == 1:
        start = max(i0, -a)
        n = i1 - start
        return n * a + (start + i1 - 1) * n // 2 if n > 0 else 0
    end = min(i1, a + 1)
    n = end - i0
    return n * a - (i0 + end - 1) * n // 2 if n > 0 else 0


def attention_flops(params: AttentionParams, mode: str, pairs: int | None = None) -> float:
    """Matmul flops: 2 per multiply-add for QK^T (d_qk) and PV (d_v); backward counted as 2.5x forward. `pairs`:
    attended_pairs(params), where the caller has it already."""
    check_mode(mode)
    pairs = attended_pairs(params) if pairs is None else pairs
    fwd = 2.0 * pairs * (params.head_dim_qk + params.head_dim_v) * params.batch_size * params.num_heads
    return fwd * (1.0 + BACKWARD_FLOP_FACTOR) if mode == "fwd_bwd" else fwd


# --- synthetic inputs ------------------------------------------------------------------------------------

@dataclass
class SyntheticCall:
    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    aux: "AttnAux"
    cfg: "AttnConfig"
    dout: "torch.Tensor | None" = None


def device_for(params: AttentionParams) -> "torch.device":
    import torch

    if params.device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device_type='cuda' but this machine has no CUDA GPU; time on the CPU with "
                             "device_type='cpu'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_inputs(params: AttentionParams, *, seed: int = 0, with_dout: bool = False,
                 lengths: SeqLengths | None = None) -> SyntheticCall:
    """Random q, k, v (and the per-call tensors the params imply) in the call's layout, drawn on the device
    (attn_dispatch.synthetic builds them): full-length sequences, so that the flop count is exact, or a packed
    call's own per-sequence (query, key) lengths."""
    import torch


    call = make_call(params, device=device_for(params), seed=seed, requires_grad=False, full_lengths=True,
                     lengths=lengths)
    dout = None
    if with_dout:
        gen = torch.Generator(device=call.q.device).manual_seed(seed + 1)
        dout = torch.randn(*call.q.shape[:-1], params.head_dim_v, generator=gen, device=call.q.device,
                           dtype=torch.float32).to(call.q.dtype)
    return SyntheticCall(call.q, call.k, call.v, call.aux, call.cfg, dout)


def engine_step(engine: "Engine", call: SyntheticCall, mode: str) -> Callable[[], None]:
    """One timed unit of work, as a user's step costs it: the engine called as DotProductAttention's repeat calls
    call it (its bind_fast function where the module's cached path takes one, else through the autograd wrapper
    with merged heads out), under no_grad in inference; in training, forward then backward into the leaf tensors'
    .grad (reset to None first, as optimizer.zero_grad does). Timing the functional forward/backward pair instead
    missed host and autograd costs: on the H100 one engine's pair took 0.40 ms where the module's training step
    took 0.83 ms."""
    import torch


    check_mode(mode)
    aux, cfg = call.aux, call.cfg
    if mode == "fwd_bwd" and call.dout is None:
        raise ValueError("mode='fwd_bwd' needs inputs built with with_dout=True")
    q, k, v = call.q, call.k, call.v
    if mode == "fwd_bwd":
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bound = engine.bind_fast(q, k, v, aux, cfg) if takes_cached_path(aux, cfg) and not cfg.return_max_logit \
        else None

    def attend() -> "torch.Tensor":
        if bound is not None:
            return bound(q, k, v)
        return engine(q, k, v, aux, cfg, flatten_heads=True)[0]

    if mode == "fwd":
        def step() -> None:
            with torch.no_grad():
                attend()
        return step
    dout = call.dout.flatten(-2)

    def step_bwd() -> None:
        q.grad = k.grad = v.grad = None
        with torch.enable_grad():
            attend().backward(dout)
    return step_bwd


# --- timing --------------------------------------------------------------------------------------------

def time_interleaved(fns: dict[str, Callable[[], None]], device_type: str,
                     settings: TimerSettings = TimerSettings(), *, cutoff_ratio: float | None = None,
                     cutoff_ms: float | None = None, never_cut: frozenset = frozenset()
                     ) -> tuple[dict[str, Timing], dict[str, Exception]]:
    """Time several functions against each other (see the module docstring): ({name: Timing}, {name: error}).
    A function that raises is left out with its exception. cutoff_ratio / cutoff_ms: a function whose least time
    over its estimate and settings.confirm more samples exceeds that multiple of the best / that many ms is reported
    from those calls (cut_short) and not timed further: it cannot be the fastest, and a benchmark should not spend
    minutes on it. Names in never_cut are always timed in full (what a benchmark reports as the user's time)."""
    import torch

    errors: dict[str, Exception] = {}
    timings: dict[str, Timing] = {}
    with torch.no_grad():
        live = _call_each(fns, list(fns), errors)  # the first calls may JIT-compile or build graphs: untimed
        # The estimate: one timed call each (the second warm-up call); it drives the cutoffs and sizes the run.
        early = _timed_rounds(fns, live, 1, errors, device_type)
        live = [name for name in live if name in early]
        if _over_cutoff(early, live, cutoff_ratio, cutoff_ms, never_cut) and settings.confirm:
            # Confirm before cutting: more samples of every function (the best is re-measured too), taken as the
            # timed rounds take theirs (a far slower function: single calls, `confirm` calls of it and no more).
            calls = _blocks({name: early[name][0] for name in live}, settings.block_ms)
            for name, times in _timed_rounds(fns, live, settings.confirm, errors, device_type, calls).items():
                early[name] += times
            live = [name for name in live if name not in errors]
        for name in _over_cutoff(early, live, cutoff_ratio, cutoff_ms, never_cut):
            times = early[name]
            timings[name] = Timing(statistics.median(times), min(times), len(times), times, cut_short=True)
            live.remove(name)
        if not live:
            return timings, errors
        estimates = {name: min(early[name]) for name in live}
        round_ms = sum(estimates.values())
        settle_rounds = max(0, settings.warmup - 2)
        settle_rounds += math.ceil(settings.warm_ms / round_ms) if round_ms > 0 else 0
        for r in range(settle_rounds):
            _call_each(fns, round_order(live, r), errors)
        live = [name for name in live if name not in errors]
        calls = _blocks(estimates, settings.block_ms)
        # With a single warm-up call, no warm period and per-call samples, the estimate is the first sample.
        first_is_sample = settings.warmup <= 1 and settle_rounds == 0 and not settings.block_ms
        samples = {name: (list(early[name]) if first_is_sample else []) for name in live}
        sample_ms = min(estimates[name] * calls.get(name, 1) for name in live)
        already = len(early[live[0]]) if first_is_sample else 0  # every live name has as many early samples
        reps = _reps_for(sample_ms, settings) - already
        for name, times in _timed_rounds(fns, live, max(reps, 0), errors, device_type, calls).items():
            samples[name] += times
    for name, times in samples.items():
        if name not in errors and times:
            timings[name] = Timing(statistics.median(times), min(times), len(times), times,
                                   calls_per_sample=calls.get(name, 1))
    return timings, errors


def _over_cutoff(early: dict[str, list[float]], live: list[str], cutoff_ratio: float | None,
                 cutoff_ms: float | None, never_cut: frozenset) -> list[str]:
    """The live names whose least early time is beyond a cutoff (the best is the least over all live names)."""
    if not live or (cutoff_ratio is None and cutoff_ms is None):
        return []
    least = {name: min(early[name]) for name in live}
    best = min(least.values())
    return [name for name in live if name not in never_cut and (
        (cutoff_ms is not None and least[name] > cutoff_ms) or
        (cutoff_ratio is not None and least[name] > cutoff_ratio * best))]


MAX_BLOCK_CALLS = 1000


def _blocks(estimates: dict[str, float], block_ms: float) -> dict[str, int]:
    """{name: calls per block} for the functions sampled in blocks (the others: one call at a time). A function
    that fills less than two calls of a block is sampled one call at a time: its host time is a small share of
    it, and a lead-in call would double what it costs to time."""
    if not block_ms:
        return {}
    return {name: n for name, est in estimates.items() if (n := block_calls(est, block_ms)) > 1}


def block_calls(estimate_ms: float, block_ms: float) -> int:
    """Calls in one block: enough to fill block_ms at the estimate, at least one (and at most MAX_BLOCK_CALLS)."""
    if estimate_ms <= 0:
        return MAX_BLOCK_CALLS
    return max(1, min(MAX_BLOCK_CALLS, round(block_ms / estimate_ms)))


def _call_each(fns: dict[str, Callable[[], None]], names: list[str], errors: dict[str, Exception]) -> list[str]:
    """Call each named function once (untimed); those that raise go to errors. Returns the survivors."""
    for name in names:
        try:
            fns[name]()
        except Exception as exc:  # noqa: BLE001 - one function failing is reported, the others go on
            errors[name] = exc
    return [name for name in names if name not in errors]


def round_order(names: list[str], r: int) -> list[str]:
    """Round r's calling order: row r of a Williams design (a Latin square balanced for carryover). Over n rounds
    (2n for an odd count) each name goes first equally often and follows every other name equally often.
    What runs just before a call biases it on the GPU (the clock a heavy kernel leaves, a queue that hides host
    time): with the rotation used before, the pick's forced column never followed a call of its own engine in a
    blind row's 16 rounds while the default and its twin did in 8 and 12, and on calls over 3 ms both read 1-2%
    above the forced pick in each of 11 runs (benchmarks/results/README.md)."""
    n = len(names)
    if n < 2:
        return list(names)
    first_row, low, high = [0], 1, n - 1
    while len(first_row) < n:  # 0, 1, n-1, 2, n-2, ...: successive differences cover every non-zero residue once
        first_row.append(low)
        low += 1
        if len(first_row) < n:
            first_row.append(high)
            high -= 1
    shift = r % n
    row = [names[(i + shift) % n] for i in first_row]
    if n % 2 and (r // n) % 2:  # odd n: every other cycle runs the rows reversed, which completes the balance
        row.reverse()
    return row


def _reps_for(estimate_ms: float, settings: TimerSettings) -> int:
    if estimate_ms <= 0:
        return settings.max_reps
    return max(settings.reps, min(settings.max_reps, math.ceil(settings.target_ms / estimate_ms)))


def _timed_rounds(fns: dict[str, Callable[[], None]], names: list[str], reps: int, errors: dict[str, Exception],
                  device_type: str, calls: dict[str, int] | None = None) -> dict[str, list[float]]:
    """reps rounds, each timing every surviving function once (round_order); milliseconds per call.
    A name not in `calls`: one call per sample; on the GPU a CUDA event pair around each call,
    launched back to back, one synchronisation at the end. calls[name] = n: each sample is a block (synchronise, an
    untimed lead-in call, n calls between two marks), divided by n. On the CPU time.perf_counter."""
    import torch

    cuda = device_type == "cuda"

    def mark():
        if not cuda:
            return _clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    marks: dict[str, list] = {name: [] for name in names}
    for r in range(reps):
        for name in round_order([n for n in names if n not in errors], r):
            fn, n = fns[name], (calls or {}).get(name)
            try:
                if n is not None:
                    if cuda:
                        torch.cuda.synchronize()
                    fn()  # the lead-in: the timed calls follow one of their own, not an empty queue
                start = mark()
                for _ in range(n or 1):
                    fn()
            except Exception as exc:  # noqa: BLE001 - one function failing is reported, the others go on
                errors[name] = exc
                continue
            marks[name].append((start, mark(), n or 1))
    if cuda:
        torch.cuda.synchronize()
    return {name: [(start.elapsed_time(end) if cuda else (end - start) * 1e3) / n for start, end, n in triples]
            for name, triples in marks.items() if name not in errors}


def _clock() -> float:
    """The CPU's timer (a function, so that tests can drive time_interleaved with a clock of their own)."""
    return time.perf_counter()


def time_engines(engines: "dict[str, Engine]", params: AttentionParams, mode: str | None = None,
                 settings: TimerSettings = TimerSettings(), *, seed: int = 0, cutoff_ratio: float | None = None,
                 cutoff_ms: float | None = None, lengths: SeqLengths | None = None
                 ) -> tuple[dict[str, Timing], dict[str, Exception]]:
    """Engines timed against each other (time_interleaved) at params' shape (and a packed call's own lengths),
    in `mode` (default: what the params' call costs), on one set of inputs. The caller's random state is left as
    it was (dropout draws from the default generator)."""
    import torch

    mode = check_mode(mode or mode_of(params))
    call = build_inputs(params, seed=seed, with_dout=mode == "fwd_bwd", lengths=lengths)
    steps = {name: engine_step(engine, call, mode) for name, engine in engines.items()}
    devices = [call.q.device.index] if call.q.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return time_interleaved(steps, params.device_type, settings, cutoff_ratio=cutoff_ratio, cutoff_ms=cutoff_ms)


def time_engine(engine: "Engine", params: AttentionParams, mode: str | None = None,
                settings: TimerSettings = TimerSettings(), *, seed: int = 0,
                cutoff_ms: float | None = None) -> Timing:
    """Median time of one call of `engine` alone (time_engines with one entry); its exception propagates."""
    timings, errors = time_engines({"engine": engine}, params, mode, settings, seed=seed, cutoff_ms=cutoff_ms)
    if errors:
        raise errors["engine"]
    return timings["engine"]
