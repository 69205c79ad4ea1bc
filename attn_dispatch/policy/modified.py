"""Calls with a modifier (cost_model.modifiers: softcap, a bias or ALiBi, an arbitrary mask, a user's mask_mod or
score_mod, dropout, ...): the profile's rate model has no row of any, so it predicts none of them. What ranks their
providers instead is a measurement: the nearest call with the same modifiers that bench_masks.py timed (the profile's
`masked` entries, built from the manifest's profile-source bench_masks.py runs), its eligible providers fastest
first. A provider it did not time is not passed over for want of a row: the measurement rules out only the providers
it timed slower than its fastest, and among that one and the untimed ones the preference order decides. It is another
call's time, so no time is claimed for this one: the reason names the call, its machine and its times."""
from __future__ import annotations

from dataclasses import dataclass

from ..params import AttentionParams
from .cost_model import features, modifiers
from .profile import MaskedCall, Profile


@dataclass(frozen=True)
class Ranking:
    call: MaskedCall
    fastest_first: tuple[str, ...]  # the eligible providers the call timed
    untimed: tuple[str, ...]        # eligible providers it did not time, in the preference order
    chosen: str                     # the first in the preference order of the fastest timed and the untimed


def nearest_ranking(profile: Profile, params: AttentionParams, machine: str | None,
                    eligible: list[str]) -> Ranking | None:
    """The ranking by the masked call with the call's modifiers and training mode that timed the most of the eligible
    providers (at least two: one alone ranks nothing), one-query calls (decode steps) only by one-query calls and the
    others only by others (a step's kernels are another regime: split keys, one row per head); of those, the
    platform's machine's first, then the same mask and padding, then the nearest in size (the rate model's weights
    over log2 sizes, and its format penalty)."""
    found = modifiers(params)
    kind = features(params, profile.model)[0]
    one_query = params.max_seqlen_q == 1
    best, best_key = None, None
    for call in profile.masked:
        timed = [p for p in eligible if p in call.times_ms]
        if call.modifiers != found or call.kind[0] != params.is_training or len(timed) < 2 \
                or call.one_query != one_query:
            continue
        key = (-len(timed), call.machine != machine, call.kind[1:3] != kind[1:3],
               call.distance(params, profile.model))
        if best_key is None or key < best_key:
            best, best_key = call, key
    if best is None:
        return None
    timed = sorted((p for p in eligible if p in best.times_ms), key=best.times_ms.__getitem__)
    untimed = tuple(p for p in eligible if p not in best.times_ms)
    chosen = next(p for p in eligible if p == timed[0] or p in untimed)
    return Ranking(best, tuple(timed), untimed, chosen)


def ranking_reason(profile: Profile, ranking: Ranking, params: AttentionParams) -> str:
    call, order = ranking.call, ranking.fastest_first
    fastest = call.times_ms[order[0]]
    times = ", ".join(f"{p} {call.times_ms[p]:.3f} ms" + (f" ({call.times_ms[p] / fastest:.2f}x)" if i else "")
                      for i, p in enumerate(order))
    mods = " and ".join(call.modifiers)
    reason = (f"{'measured fastest' if ranking.chosen == order[0] else 'ranked'} on the nearest measured call with "
              f"{mods} (the rate model's rows have no call with {mods}, so none is predicted): {call.label} "
              f"({call.machine}; bench_masks.py, a user's {'training ' if params.is_training else ''}step with each "
              f"provider forced): {times}")
    if ranking.untimed:
        reason += (f"; not timed there: {', '.join(ranking.untimed)}: of {order[0]} and "
                   f"{'it' if len(ranking.untimed) == 1 else 'those'}, Transformer Engine's preference order puts "
                   f"{ranking.chosen} first")
    return f"{reason}; from {profile.describe()}"


def unranked_reason(profile: Profile, params: AttentionParams, eligible: list[str]) -> str:
    return (f"{profile.describe()} has no measured call with {' and '.join(modifiers(params))} (which changes each "
            f"engine's kernel and cost) that timed two or more of {', '.join(eligible)}; Transformer Engine's "
            "preference order decides")
