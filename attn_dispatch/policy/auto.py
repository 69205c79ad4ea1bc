"""The default policy: the fastest eligible provider by the performance profile shipped for the platform's
architecture, with no timing at run time. A bucket the measured policy has tuned on this machine overrides the
profile (local timings beat a prediction); without a profile for the architecture, Transformer Engine's order
decides, and the reason says so. KV-cache decode steps are predicted by the memory-bound model of
policy/decode.py instead (the profile has no decode rows). A call with a modifier (softcap, a bias, an arbitrary mask,
a mask_mod / score_mod, ...: cost_model.modifiers) is never predicted from the rows, which have none: the nearest masked
call measured with the same modifiers ranks its providers (policy/modified.py), else the order decides, and the
reason says which. A provider without a rate (FlexAttention's: CostModel.relative_only) is predicted relative to the
eligible ones that have one, off the nearest measured calls that timed both (Profile.relative)."""
from __future__ import annotations

from ..params import AttentionParams, SeqLengths
from ..platform import Platform
from . import decode, modified
from .base import Choice
from .cost_model import modifiers, two_sided_training
from .order import without_last_resort
from .profile import PROFILE_DIR, Prediction, Profile, arch_of, profile_for

PREDICTED = "ms per step, predicted"  # the unit of a Choice made from the profile's prediction


class AutoPolicy:
    name = "auto"

    def __init__(self, directory=PROFILE_DIR, measured=None):
        self.directory = directory
        self.measured = measured  # a MeasuredPolicy whose on-disk tuning cache is read (never timed from here)

    def choose(self, params: AttentionParams, platform: Platform, eligible: list[str],
               lengths: SeqLengths | None = None) -> Choice:
        if len(eligible) <= 1:
            return Choice(eligible[0] if eligible else None,
                          "the only eligible provider" if eligible else "no provider is eligible")
        considered = without_last_resort(eligible, params, platform)
        if len(considered) == 1 < len(eligible):
            return Choice(considered[0], "the only eligible provider but unfused (the last resort on a GPU)")
        eligible = considered
        local = self._tuned_here(params, platform, eligible)
        if local is not None:
            return local
        profile = profile_for(platform, self.directory)
        if decode.applies(params, platform):  # the profile has no decode rows, nor the right model for them
            host = {p: profile.host_ms.get((p, False), 0.0) for p in eligible} if profile is not None else {}
            return decode.choose(params, platform, eligible, host)
        if profile is None:
            arch = arch_of(platform) or platform.device_type
            shipped = ", ".join(sorted(p.stem for p in self.directory.glob("*.json"))) or "none"
            return Choice(eligible[0], f"no performance profile for {arch} (shipped: {shipped}); Transformer "
                                       "Engine's preference order decides")
        if modifiers(params):  # the rate model's rows have none: a measured masked call ranks, or the order
            ranking = modified.nearest_ranking(profile, params, platform.device_name, eligible)
            if ranking is None:
                return Choice(eligible[0], modified.unranked_reason(profile, params, eligible))
            return Choice(ranking.chosen, modified.ranking_reason(profile, ranking, params))
        prediction = profile.predict(params, machine=platform.device_name, among=eligible)
        chosen = prediction.best(eligible)
        if chosen is None:
            return Choice(eligible[0], f"{profile.describe()} has no measurement of this kind of call for "
                                       f"{', '.join(eligible)}; Transformer Engine's preference order decides")
        estimates = {p: round(prediction.times_ms[p], 4) for p in eligible if p in prediction.times_ms}
        others = sorted((t, p) for p, t in estimates.items() if p != chosen)
        versus = ", ".join(f"{p} {t / estimates[chosen]:.2f}x" for t, p in others) or "no other measured provider"
        unknown = [p for p in eligible if p not in estimates]
        reason = (f"predicted fastest: {estimates[chosen]:.3f} ms per step, vs {versus}; from {profile.describe()}, "
                  f"{_source(profile, prediction, platform)}, nearest measured calls: "
                  f"{'; '.join(prediction.neighbours)}")
        margin = profile.relative_margin(params)
        untiled = [p for p in estimates if p in profile.model.unwindowed_backward] if two_sided_training(params) else []
        for provider, calls in prediction.relative.items():
            reason += (f"; {provider} has no rate in the profile: its time is the others' predicted here x its "
                       "time over theirs on the nearest measured calls of this kind and head dims "
                       f"({'; '.join(calls)})"
                       + (f", x their work ratio here over there ({', '.join(untiled)}: every key tile in a two-sided "
                          "window's backward)" if untiled else "")
                       + (f", x {margin:g} (a pack picks it only where it reads clearly faster)"
                          if margin != 1.0 else ""))
        if unknown:
            reason += f"; not in the profile: {', '.join(unknown)}"
        drift = _stack_drift(profile, platform)
        if drift:
            reason += f"; this machine's stack differs ({drift})"
        return Choice(chosen, reason, estimates, PREDICTED)

    def _tuned_here(self, params: AttentionParams, platform: Platform, eligible: list[str]) -> Choice | None:
        if self.measured is None:
            return None
        entry = self.measured.lookup(params, platform)
        if not entry:
            return None
        times = {**entry.get("probe_ms", {}), **entry.get("times_ms", {})}
        timed = {p: times[p] for p in eligible if times.get(p) is not None}
        if len(timed) < len(eligible):
            return None  # the tuned bucket does not cover every candidate: the profile decides
        chosen = min(timed, key=timed.get)
        return Choice(chosen, f"tuned on this machine (measured policy cache, bucket "
                              f"{self.measured.scheme.key(params)}): {timed[chosen]:.3f} ms per step",
                      {p: round(t, 4) for p, t in timed.items()}, "ms per step, measured here")


def _source(profile: Profile, prediction: Prediction, platform: Platform) -> str:
    """Whose measurements predicted the call: this machine's own, or every machine's of the architecture."""
    if prediction.machine:
        return f"using this machine's ({prediction.machine}) {prediction.own_entries} measured calls of this kind"
    return (f"using every {profile.arch} machine's measured calls ({platform.device_name} has "
            f"{prediction.own_entries} of this kind, fewer than {profile.model.min_own})")


def _stack_drift(profile: Profile, platform: Platform) -> str:
    """Where this machine's torch or cuDNN differs from the profiled stack (the prediction still stands, flagged)."""
    diffs = []
    torch_here, torch_there = platform.torch_version.split("+")[0], profile.stack.get("torch", "").split("+")[0]
    if torch_there and torch_here != torch_there:
        diffs.append(f"torch {torch_here} here, {torch_there} profiled")
    cudnn_there, cudnn_here = profile.stack.get("cuDNN", ""), platform.cudnn_version or ""
    if cudnn_there and cudnn_here and cudnn_here != cudnn_there:
        diffs.append(f"cuDNN {cudnn_here} here, {cudnn_there} profiled")
    return "; ".join(diffs)
