"""What FP8 attention gains or costs against bf16 for a call: a prediction from one measurement.

The rates are cuDNN 9.19's FP8 and bf16 kernels timed against each other on an H200 (h16, d128, b*s = 64k tokens,
bf16 cuDNN as the baseline), recorded in benchmarks/results/fp8/bench_fp8_h200.json ('speed' rows). The table
below holds those rows' times; tests/test_fp8.py checks it against the file. A call's prediction scales the bf16
cuDNN step the shipped profile predicts for it by the measured FP8/bf16 time ratio of each pass, at the nearest
measured sequence length, for its mask (causal or not). Kernels only: the module's quantization passes come on top
(the same file's module rows show what they cost when it was recorded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SOURCE = "benchmarks/results/fp8/bench_fp8_h200.json"
MEASURED_ON = "H200, cuDNN 9.19, h16 d128"
MEASURED_SM = 90

# (causal, pass, sequence length) -> (FP8 kernel ms, bf16 cuDNN kernel ms), from SOURCE's 'speed' rows
KERNEL_MS: dict[tuple[bool, str, int], tuple[float, float]] = {
    (True, "fwd", 4096): (1.5488, 1.9682), (True, "bwd", 4096): (8.4209, 5.7945),
    (False, "fwd", 4096): (2.541, 3.5417), (False, "bwd", 4096): (9.2683, 10.4144),
    (True, "fwd", 8192): (2.8106, 3.7441), (True, "bwd", 8192): (15.9941, 11.1549),
    (False, "fwd", 8192): (5.024, 6.9421), (False, "bwd", 8192): (17.6414, 20.6542),
    (True, "fwd", 16384): (5.1655, 7.3572), (True, "bwd", 16384): (21.72, 21.0923),
    (False, "fwd", 16384): (9.8013, 13.695), (False, "bwd", 16384): (34.0577, 40.8459),
}
# (causal, pass, sequence length) -> bf16 module time / FP8 module time, measured in the same run ('fwd': forward;
# 'step': forward and backward, the FP8 backward): what the module's quantization passes added to the kernels
MODULE_SPEEDUP: dict[tuple[bool, str, int], float] = {
    (True, "fwd", 4096): 0.878, (True, "step", 4096): 0.731,
    (False, "fwd", 4096): 1.073, (False, "step", 4096): 1.113,
    (True, "fwd", 8192): 1.064, (True, "step", 8192): 0.774,
    (False, "fwd", 8192): 1.189, (False, "step", 8192): 1.196,
    (True, "fwd", 16384): 1.254, (True, "step", 16384): 0.931,
    (False, "fwd", 16384): 1.299, (False, "step", 16384): 1.241,
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
