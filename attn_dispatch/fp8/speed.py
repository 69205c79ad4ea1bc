"""What FP8 attention gains or costs against bf16 for a call: a prediction from one measurement.

The rates are cuDNN 9.19's FP8 and bf16 kernels timed against each other on an H100 (h16, d128, b*s = 64k tokens,
bf16 cuDNN as the baseline), recorded in benchmarks/results/fp8/bench_fp8_h100.json ('speed' rows). The table
below holds those rows' times; tests/test_fp8.py checks it against the file. A call's prediction scales the bf16
cuDNN step the shipped profile predicts for it by the measured FP8/bf16 time ratio of each pass, at the nearest
measured sequence length, for its mask (causal or not). Kernels only: the module's quantization passes come on top
(the same file's module rows show what they cost when it was recorded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SOURCE = "benchmarks/results/fp8/bench_fp8_h100.json"
MEASURED_ON = "H100, cuDNN 9.19, h16 d128"
MEASURED_SM = 90

# (causal, pass, sequence length) -> (FP8 kernel ms, bf16 cuDNN kernel ms), from SOURCE's 'speed' rows
KERNEL_MS: dict[tuple[bool, str, int], tuple[float, float]] = {
    (True, "fwd", 4096): (1.7305, 1.842), (True, "bwd", 4096): (10.9571, 5.695),
    (False, "fwd", 4096): (2.487, 3.5344), (False, "bwd", 4096): (9.3284, 10.4148),
    (True, "fwd", 8192): (3.0622, 3.5426), (True, "bwd", 8192): (20.7412, 10.2156),
    (False, "fwd", 8192): (4.9181, 6.8203), (False, "bwd", 8192): (17.8379, 20.6147),
    (True, "fwd", 16384): (5.0103, 6.8114), (True, "bwd", 16384): (38.5317, 20.4027),
    (False, "fwd", 16384): (9.8173, 13.666), (False, "bwd", 16384): (34.0591, 40.4947),
}
# (causal, pass, sequence length) -> bf16 module time / FP8 module time, measured in the same run ('fwd': forward;
# 'step': forward and backward): what the quantization passes of that commit added to the kernels
MODULE_SPEEDUP: dict[tuple[bool, str, int], float] = {
    (True, "fwd", 4096): 0.537, (True, "step", 4096): 0.501,
    (False, "fwd", 4096): 0.838, (False, "step", 4096): 0.95,
    (True, "fwd", 8192): 0.726, (True, "step", 8192): 0.523,
    (False, "fwd", 8192): 0.982, (False, "step", 8192): 1.102,
    (True, "fwd", 16384): 1.019, (True, "step", 16384): 0.592,
    (False, "fwd", 16384): 1.161, (False, "step", 16384): 1.196,
}
BANDS = (4096, 8192, 16384)


def band(seqlen: int) -> int:
    """The measured sequence length nearest to seqlen, on a log scale."""
    if seqlen < 1:
        raise ValueError(f"seqlen={seqlen}: a sequence length is a positive int")
    return min(BANDS, key=lambda b: abs(math.log2(seqlen / b)))


def time_ratio(causal: bool, pass_: str, seqlen: int) -> float:
    """FP8 kernel time / bf16 cuDNN kernel time for a pass ('fwd' or 'bwd') at the nearest measured length."""
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_={pass_!r}; expected 'fwd' or 'bwd'")
    fp8, bf16 = KERNEL_MS[(causal, pass_, band(seqlen))]
    return fp8 / bf16


@dataclass(frozen=True)
class Estimate:
    """Predicted times (ms) of one call: bf16 cuDNN, FP8 forward and backward, FP8 forward with the bf16
    backward (NVTE_FP8_DPA_BWD=0; the forward alone in inference)."""
    training: bool
    causal: bool
    band: int
    bf16_ms: float
    fp8_ms: float
    fp8_f16_backward_ms: float
    fwd_speedup: float

    @property
    def speedup(self) -> float:
        return self.bf16_ms / self.fp8_ms

    @property
    def f16_backward_speedup(self) -> float:
        return self.bf16_ms / self.fp8_f16_backward_ms


def estimate(bf16_ms: float, *, causal: bool, seqlen: int, training: bool) -> Estimate:
    """The FP8 times of a call whose bf16 cuDNN step is predicted at bf16_ms. A training step is split into its
    forward and backward as the measured bf16 kernels split it at that length."""
    if not bf16_ms > 0:
        raise ValueError(f"bf16_ms={bf16_ms}: a predicted time is a positive number")
    at = band(seqlen)
    r_fwd, r_bwd = time_ratio(causal, "fwd", seqlen), time_ratio(causal, "bwd", seqlen)
    if not training:
        fp8 = bf16_ms * r_fwd
        return Estimate(False, causal, at, bf16_ms, fp8, fp8, 1.0 / r_fwd)
    fwd_ms, bwd_ms = KERNEL_MS[(causal, "fwd", at)][1], KERNEL_MS[(causal, "bwd", at)][1]
    fwd = bf16_ms * fwd_ms / (fwd_ms + bwd_ms)
    bwd = bf16_ms - fwd
    return Estimate(True, causal, at, bf16_ms, fwd * r_fwd + bwd * r_bwd, fwd * r_fwd + bwd, 1.0 / r_fwd)


def describe(e: Estimate, fp8_dpa_bwd: bool, fp8_backward_possible: bool = True) -> str:
    """The estimate in words, saying when FP8 costs time and what NVTE_FP8_DPA_BWD=0 would give (or, with it set,
    what the FP8 backward would give where it can run the call)."""
    where = (f"predicted from the {MEASURED_ON} measurement ({SOURCE}, the {e.band // 1024}k "
             f"{'causal' if e.causal else 'unmasked'} rows) applied to this call's bf16 cuDNN time from the profile")
    if not e.training:
        verdict = "FP8 costs time here" if e.speedup < 1 else "FP8 saves time here"
        return (f"{verdict}: FP8 forward ~{e.speedup:.2f}x bf16 ({e.fp8_ms:.3f} ms vs {e.bf16_ms:.3f} ms); {where}; "
                f"kernels only, the module's quantization passes come on top (measured through the module then: "
                f"{MODULE_SPEEDUP[(e.causal, 'fwd', e.band)]:.2f}x)")
    step = e.speedup if fp8_dpa_bwd else e.f16_backward_speedup
    step_ms = e.fp8_ms if fp8_dpa_bwd else e.fp8_f16_backward_ms
    verdict = "FP8 costs time here" if step < 1 else "FP8 saves time here"
    bwd_ratio = 1.0 / time_ratio(e.causal, "bwd", e.band)
    text = (f"{verdict}: FP8 forward ~{e.fwd_speedup:.2f}x bf16; training step ~{step:.2f}x bf16 "
            f"({step_ms:.3f} ms vs {e.bf16_ms:.3f} ms")
    if fp8_dpa_bwd:
        text += (f"; cuDNN's FP8 {'causal ' if e.causal else ''}backward runs at {bwd_ratio:.2f}x bf16's)")
        if e.f16_backward_speedup > e.speedup:
            text += (f"; set NVTE_FP8_DPA_BWD=0 for an FP8 forward with a bf16 backward "
                     f"(~{e.f16_backward_speedup:.2f}x, {e.fp8_f16_backward_ms:.3f} ms)")
    else:
        text += ", FP8 forward with the bf16 backward of NVTE_FP8_DPA_BWD=0" + (
            f"; the FP8 backward would give ~{e.speedup:.2f}x)" if fp8_backward_possible else ")")
    return (text + f"; {where}; kernels only, the module's quantization passes come on top (measured through the "
            f"module then, FP8 backward: step {MODULE_SPEEDUP[(e.causal, 'step', e.band)]:.2f}x)")
