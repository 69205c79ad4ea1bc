"""Time one engine on synthetic random inputs built from AttentionParams.

On the GPU each repetition sits between two CUDA events, after warm-up (which also absorbs JIT compilation);
the result is the median. On the CPU, time.perf_counter around each repetition. Engines are called through
their functional forward/backward pair under no_grad, the context autograd runs them in.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..params import AttentionParams

if TYPE_CHECKING:
    import torch

    from ..backends.base import AttnAux, AttnConfig, Engine

MODES = ("fwd", "fwd_bwd")
BACKWARD_FLOP_FACTOR = 2.5  # backward ~ 2.5x forward flops (FlashAttention's accounting): fwd+bwd = 3.5x fwd


@dataclass(frozen=True)
class TimerSettings:
    """warmup calls (untimed; at least one), then at least `reps` timed ones, more (up to max_reps) until
    target_ms is covered."""

    warmup: int = 3
    reps: int = 10
    max_reps: int = 100
    target_ms: float = 50.0

    def __post_init__(self) -> None:
        for name in ("warmup", "reps", "max_reps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}={value!r} must be an integer >= {0 if name == 'warmup' else 1}")
        if self.max_reps < self.reps:
            raise ValueError(f"max_reps={self.max_reps} must be >= reps={self.reps}")
        if not self.target_ms >= 0:
            raise ValueError(f"target_ms={self.target_ms!r} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int
    samples_ms: list[float] = field(default_factory=list, repr=False)
    cut_short: bool = False  # stopped after one call: far slower than the cutoff

    def to_dict(self) -> dict[str, Any]:
        result = {"median_ms": self.median_ms, "min_ms": self.min_ms, "reps": self.reps}
        if self.cut_short:
            result["cut_short"] = True
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
    """(query, key) pairs one head of one sequence attends to under the mask and window (full-length sequences)."""
    sq, skv = params.max_seqlen_q, params.max_seqlen_kv
    left, right = params.window_size
    if left < 0 and right < 0:
        return sq * skv
    # 'causal' aligns the diagonal top-left; every other mask (Transformer Engine's rule) bottom-right
    offset = 0 if params.attn_mask_type in ("causal", "padding_causal") else skv - sq
    total = 0
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + offset - left)
        hi = skv - 1 if right < 0 else min(skv - 1, i + offset + right)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(params: AttentionParams, mode: str) -> float:
    """Matmul flops: 2 per multiply-add for QK^T (d_qk) and PV (d_v); backward counted as 2.5x forward."""
    check_mode(mode)
    fwd = 2.0 * attended_pairs(params) * (params.head_dim_qk + params.head_dim_v) * params.batch_size \
        * params.num_heads
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


def build_inputs(params: AttentionParams, *, seed: int = 0, with_dout: bool = False) -> SyntheticCall:
    """Random q, k, v (and the per-call tensors the params imply) in the call's layout, drawn on the device;
    full-length sequences, so that the flop count is exact (attn_dispatch.synthetic builds them)."""
    import torch

    from ..synthetic import make_call

    call = make_call(params, device=device_for(params), seed=seed, requires_grad=False, full_lengths=True)
    dout = None
    if with_dout:
        gen = torch.Generator(device=call.q.device).manual_seed(seed + 1)
        dout = torch.randn(*call.q.shape[:-1], params.head_dim_v, generator=gen, device=call.q.device,
                           dtype=torch.float32).to(call.q.dtype)
    return SyntheticCall(call.q, call.k, call.v, call.aux, call.cfg, dout)


def engine_step(engine: "Engine", call: SyntheticCall, mode: str) -> Callable[[], None]:
    """One timed unit of work: the forward, or forward then backward."""
    check_mode(mode)
    q, k, v, aux, cfg = call.q, call.k, call.v, call.aux, call.cfg
    if mode == "fwd":
        def step() -> None:
            engine.forward(q, k, v, aux, cfg)
        return step
    if call.dout is None:
        raise ValueError("mode='fwd_bwd' needs inputs built with with_dout=True")
    dout = call.dout

    def step_bwd() -> None:
        res = engine.forward(q, k, v, aux, cfg)
        engine.backward(dout, q, k, v, res.out, res.lse, res.state, aux, cfg)
    return step_bwd


# --- timing --------------------------------------------------------------------------------------------

def time_fn(fn: Callable[[], None], device_type: str, settings: TimerSettings = TimerSettings(), *,
            cutoff_ms: float | None = None) -> Timing:
    """Call fn once untimed (it may JIT-compile), time one call as an estimate, finish the warm-up, then time
    enough calls (settings) and return the median. With warmup <= 1 the estimate is the first sample.
    cutoff_ms: an engine whose estimate exceeds it is reported from that one call (cut_short), which keeps a
    benchmark from spending minutes on an engine that is far behind."""
    import torch

    timer = _CudaTimer() if device_type == "cuda" else _CpuTimer()
    with torch.no_grad():
        fn()
        estimate = timer.time([fn])[0]
        if cutoff_ms is not None and estimate > cutoff_ms:
            return Timing(estimate, estimate, 1, [estimate], cut_short=True)
        for _ in range(settings.warmup - 2):  # the estimate call was the second warm-up call
            fn()
        samples = [estimate] if settings.warmup <= 1 else []
        reps = _reps_for(estimate, settings)
        samples += timer.time([fn] * (reps - len(samples)))
    return Timing(statistics.median(samples), min(samples), len(samples), samples)


def _reps_for(estimate_ms: float, settings: TimerSettings) -> int:
    if estimate_ms <= 0:
        return settings.max_reps
    return max(settings.reps, min(settings.max_reps, math.ceil(settings.target_ms / estimate_ms)))


class _CpuTimer:
    @staticmethod
    def time(fns: list[Callable[[], None]]) -> list[float]:
        samples = []
        for fn in fns:
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples


class _CudaTimer:
    """A CUDA event pair around each call, launched back to back; one synchronisation at the end."""

    @staticmethod
    def time(fns: list[Callable[[], None]]) -> list[float]:
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
        for fn, (start, end) in zip(fns, events):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]


def time_engine(engine: "Engine", params: AttentionParams, mode: str | None = None,
                settings: TimerSettings = TimerSettings(), *, seed: int = 0,
                cutoff_ms: float | None = None) -> Timing:
    """Median time of one call of `engine` at params' shape, in `mode` (default: what the params' call costs).
    The caller's random state is left as it was (dropout draws from the default generator)."""
    import torch

    mode = check_mode(mode or mode_of(params))
    call = build_inputs(params, seed=seed, with_dout=mode == "fwd_bwd")
    devices = [call.q.device.index] if call.q.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return time_fn(engine_step(engine, call, mode), params.device_type, settings, cutoff_ms=cutoff_ms)
