"""The `checked` policy (opt in: ATTN_DISPATCH_POLICY=checked): the shipped profile's pick where its prediction is
clear, timing only where the prediction is too close to call.

Where the profile predicts every other eligible provider at least `margin` slower than its pick, the pick stands
untimed, as under `auto`. Otherwise the providers predicted within the margin of the fastest are timed against each
other, once per shape bucket, by the measured policy (its timer, its persistent cache: the user's step at this call's
shape), and the fastest measured wins. Every decision `auto` makes otherwise (a bucket tuned here, a decode step, no
profile for the architecture, a single candidate) is auto's.

Why: the profile's misses are close calls. Offline over every run of twelve held-out grids (pick / fastest, mean),
timing only the providers within 10% of the predicted best, with the times the measured policy's tuner recorded in
those runs, scored 1.0052 / 1.0044 / 1.0023 on three groups of them (5 / 5 / 2 grids, full-stack runs) against the
profile's 1.0150 / 1.0098 / 1.0060, timing ~45% of those buckets (~3% on stock torch). Timed on two held-out grids
drawn after it was written (two H100 leases): 1.0072 against the default's 1.0117 on the full stack, timing 45 of 96
buckets, and 1.0011 against 0.9997 on stock torch, timing 1 of 96; the measured policy, timing every bucket, scored
1.0022 there (benchmarks/results/README.md). Unlike `auto`, it times at run time, so it is not
the default.
"""
from __future__ import annotations

from ..params import AttentionParams, SeqLengths
from ..platform import Platform
from .auto import PREDICTED, AutoPolicy
from .base import Choice
from .measured import MeasuredPolicy, fastest, why_not_tunable

CHECK_MARGIN = 0.10


class CheckedPolicy:
    name = "checked"

    def __init__(self, auto: AutoPolicy, measured: MeasuredPolicy, margin: float = CHECK_MARGIN):
        if not 0.0 < margin:
            raise ValueError(f"margin={margin!r} must be > 0 (0.10: time the providers predicted within 10%)")
        self.auto, self.measured, self.margin = auto, measured, margin

    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice:
        predicted = self.auto.choose(params, platform, eligible, lengths)
        if predicted.unit != PREDICTED or predicted.chosen is None:
            return predicted
        best = predicted.estimates[predicted.chosen]
        close = [p for p in eligible if p in predicted.estimates and predicted.estimates[p] < best * (1 + self.margin)]
        if len(close) < 2:
            return Choice(predicted.chosen, f"{predicted.reason}; not timed: every other provider is predicted "
                                            f"{self.margin:.0%} or more slower", predicted.estimates, PREDICTED)
        why_not = why_not_tunable(params, platform)
        if why_not is None:
            result = self.measured.tune_bucket(params, platform, close, lengths=lengths)
            entry, chosen, how = result.entry, result.chosen, "timed now" if result.tuned_now else "timed earlier"
        else:  # a bucket timed earlier still answers (the measured policy's warning would name the wrong fallback)
            entry, chosen, how = self.measured.lookup(params, platform) or {}, None, "timed earlier"
        times = {**entry.get("probe_ms", {}), **entry.get("times_ms", {})}
        if why_not is not None and all(times.get(p) is not None for p in close):
            chosen = fastest(entry, close)
        if chosen is None:
            why_not = why_not or "each failed while being timed: the measured policy's log says why"
            return Choice(predicted.chosen, f"{predicted.reason}; {', '.join(close)} are predicted within "
                                            f"{self.margin:.0%} of each other but were not timed ({why_not})",
                          predicted.estimates, PREDICTED)
        timed = {p: round(times[p], 4) for p in close if times.get(p) is not None}
        forecast = ", ".join(f"{p} {predicted.estimates[p]:.3f}" for p in close)
        shape = AttentionParams(**entry["shape"]).describe() if "shape" in entry else params.describe()
        return Choice(chosen, f"measured fastest of the providers the profile could not separate (predicted within "
                              f"{self.margin:.0%}: {forecast} ms; {how} on this machine, bucket "
                              f"{self.measured.scheme.key(params)}, at {shape}): {timed[chosen]:.3f} ms per step",
                      timed, "ms per step, measured here")
