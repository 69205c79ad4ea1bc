"""Building the performance profile (profiles/<arch>.json) from measured runs: bench_user_step.py runs become its
entries (each call on each machine one entry, its provider times combined over the runs, with the host and GPU
times some run split), bench_masks.py runs its `masked` entries and the packed grids' runs its `packed` entries.
benchmarks/build_profile.py calls build(); evaluate_profile.py and fit_packed.py pool runs the same way.
"""
from __future__ import annotations

import json
import math
import statistics
from typing import Any

from ..params import AttentionParams, packed_fields
from .cost_model import (COST_MODEL, CostModel, features, modifiers, packed_mean_length, two_sided_training,
                         unwindowed_work, work)


def _provider_times(row: dict) -> dict[str, float]:
    return {n: t for n, t in row.get("times_ms", {}).items() if ":" in n}  # SDPA, policy columns left out


def combine_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    """One call's provider times from several runs (other stacks' too: a stock-torch run times torch's providers
    only): each run is scaled onto the one with the most providers by the median ratio over the providers both
    timed (two runs' clocks differ by a few percent), then each provider's time is the median over the runs. A run
    that shares no provider with it (a re-measure of one provider alone) is taken unscaled, not dropped."""
    reference = max(runs, key=len)
    scaled = [reference]
    for run in runs:
        if run is reference:
            continue
        shared = [p for p in run if p in reference]
        scale = statistics.median(reference[p] / run[p] for p in shared) if shared else 1.0
        scaled.append({p: t * scale for p, t in run.items()})
    providers = sorted({p for run in scaled for p in run})
    return {p: statistics.median(run[p] for run in scaled if p in run) for p in providers}


def group_runs(runs: list[dict]) -> dict[tuple[str, str], tuple[str, dict, list[dict[str, float]]]]:
    """Rows of bench_user_step.py runs ({"machine": device name, "rows": its rows}) by (machine, call parameters):
    (the first row's label, the parameters, each run's provider times). The calls a run with "replaces" set
    measured on its machine take their times from such runs alone (a re-measure after an engine's path changed).
    A call no run timed interleaved on its machine takes the steps a split run measured (--split-only: each
    provider's step in a steady block of its own calls, the block timer's measure). A FlexAttention provider some run
    timed settled on its dynamic compile takes that call's time from such runs alone (_settled_times)."""
    grouped: dict[tuple[str, str], tuple[str, dict, list[dict[str, float]]]] = {}
    replaced = {(run["machine"], _call_key(row["params"])) for run in runs if run.get("replaces")
                for row in run["rows"] if _provider_times(row)}
    settled = {(run["machine"], _call_key(row["params"]), provider) for run in runs for row in run["rows"]
               for provider in row.get("flex_settled_dynamic", ())}
    split_only = []  # (key, row, its steps) of split rows: used where no run timed the call
    for run in runs:
        for row in run["rows"]:
            key = (run["machine"], _call_key(row["params"]))
            times = _settled_times(row, key, settled)
            if times and (run.get("replaces") or key not in replaced):
                grouped.setdefault(key, (row["label"], row["params"], []))[2].append(times)
            elif not times and row.get("split"):
                split_only.append((key, row, {n: s["step_ms"] for n, s in row["split"].items() if ":" in n}))
    timed = set(grouped)
    for key, row, steps in split_only:
        if steps and key not in timed:
            grouped.setdefault(key, (row["label"], row["params"], []))[2].append(steps)
    return grouped


def _settled_times(row: dict, key: tuple[str, str], settled: set[tuple[str, str, str]]) -> dict[str, float]:
    """The row's provider times, without a FlexAttention provider's where another run timed the same call after
    settling that provider on its dynamic compile (bench_user_step.settle_flex_on_packs; the row's
    flex_settled_dynamic) and this row did not: a row that did not settle timed whichever compile the process's
    history left (static for its first pack length), and flex's packed training step ran up to 1.9x slower
    dynamic (results/README.md)."""
    own = set(row.get("flex_settled_dynamic", ()))
    return {n: t for n, t in _provider_times(row).items() if (*key, n) not in settled or n in own}


def with_settled_flex(run: dict, runs: list[dict]) -> list[dict]:
    """The run's rows, each FlexAttention provider's time replaced where another of the runs timed the same call with
    that provider settled on its dynamic compile and this row did not (what the profile reads, _settled_times): the
    settled time scaled onto this row's clock by the median ratio of the providers both timed. What a run's picks are
    scored against where its flex rows were timed again."""
    settled: dict[tuple[str, str], dict] = {}
    for other in runs:
        if other is not run:
            for row in other["rows"]:
                if row.get("flex_settled_dynamic"):
                    settled.setdefault((other["machine"], _call_key(row["params"])), row)
    rows = []
    for row in run["rows"]:
        again = settled.get((run["machine"], _call_key(row["params"])))
        own, times = set(row.get("flex_settled_dynamic", ())), _provider_times(row)
        if again is None or not times:
            rows.append(row)
            continue
        fresh = _provider_times(again)
        shared = [p for p in times if p in fresh and p not in again["flex_settled_dynamic"]]
        scale = statistics.median(times[p] / fresh[p] for p in shared) if shared else 1.0
        replaced = {p: fresh[p] * scale for p in again["flex_settled_dynamic"] if p in times and p in fresh
                    and p not in own}
        rows.append({**row, "times_ms": {**row["times_ms"], **replaced}})
    return rows


def _call_key(params: dict) -> str:
    return json.dumps(AttentionParams(**params).to_dict(), sort_keys=True)  # older runs lack newer fields' defaults


def _without_impossible(training: dict[str, float], inference: tuple | None) -> dict[str, float]:
    """A training step's times without a provider's that is under its forward alone on the same call (a timer
    artefact: one measured flash-attn-4 step read 0.195 ms against 0.292 for its forward)."""
    if inference is None:
        return training
    forward = inference[2]
    return {p: t for p, t in training.items() if p not in forward or t >= forward[p]}


def pooled_calls(runs: list[dict]) -> dict[tuple[str, str], tuple[str, dict, dict[str, float], int]]:
    """(machine, call) -> (label, parameters, provider times combined over the runs, how many runs): what a
    profile entry holds, and what the protocols score against."""
    grouped = {key: (label, params, combine_runs(times), len(times))
               for key, (label, params, times) in group_runs(runs).items()}
    for (machine, _), (label, params, times, count) in list(grouped.items()):
        if params.get("is_training"):
            forward = grouped.get((machine, _call_key({**params, "is_training": False})))
            grouped[(machine, _)] = (label, params, _without_impossible(times, forward), count)
    return grouped


REFRESH_REFERENCE = "sdpa"  # torch's own call, split in every run: its host path is the same in each of them
MIN_REFERENCE_CALLS = 5  # calls a refresh shares with the other runs, per pass, to read its lease's host speed


def refresh_host_scales(runs: list[dict]) -> dict[tuple[int, bool], float]:
    """(index of a refresh run, training) -> the factor putting its host times on the other runs' scale. A lease's
    host speed differs by up to ~1.7x from another's (H200/H100 leases 0.62-0.68x; the FA2 refresh's
    lease ran F.sdpa at 0.60x the split fit's): so the refresh's own F.sdpa split, against the other runs' of the
    same calls on its machine, gives the median ratio by which the refresh's host times are scaled."""
    def host(row: dict) -> float | None:
        split = row.get("split", {}).get(REFRESH_REFERENCE, {})
        return split["host_ms"] if split.get("covered") == 1 else None

    others: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        if not run.get("refreshes"):
            for row in run["rows"]:
                if (h := host(row)) is not None:
                    others.setdefault((run["machine"], _call_key(row["params"])), []).append(h)
    scales = {}
    for index, run in enumerate(runs):
        if not run.get("refreshes"):
            continue
        ratios: dict[bool, list[float]] = {}  # per pass the run has rows of
        for row in run["rows"]:
            found = ratios.setdefault(AttentionParams(**row["params"]).is_training, [])
            theirs = others.get((run["machine"], _call_key(row["params"])))
            if theirs and (mine := host(row)) is not None:
                found.append(statistics.median(theirs) / mine)
        for training, found in ratios.items():
            if len(found) < MIN_REFERENCE_CALLS:
                raise ValueError(f"refresh run {run.get('path', index)!r}: {len(found)} "
                                 f"{'training' if training else 'inference'} calls with a {REFRESH_REFERENCE!r} "
                                 f"split shared with the other runs on {run['machine']!r}, need "
                                 f"{MIN_REFERENCE_CALLS} to scale its host times onto theirs")
            scales[(index, training)] = statistics.median(found)
    return scales


def pooled_splits(runs: list[dict]) -> dict[tuple[str, str], dict[str, tuple[float, float]]]:
    """(machine, call) -> {provider: (host ms, GPU ms)}, medians over the runs' rows with a split
    (bench_user_step.py --split): of the samples where the spin kernel outlasted the enqueueing alone (covered 1; a
    provider that synchronises inside its call has none, and keeps the step-time model). A run whose "refreshes"
    names a provider (its host path changed since the other runs: --refreshes) is the only source of that
    provider's split for the calls it split on its machine (of several such runs, the newest by "date"); its host
    times are scaled onto the other runs' lease by refresh_host_scales. (Its step times stay combined with the
    other runs': where a provider has a split, the model reads host and GPU time alone.)"""
    def usable(split: dict) -> bool:
        return split.get("covered") == 1

    scales = refresh_host_scales(runs)
    newest: dict[tuple[str, str, str], str] = {}  # (machine, call, provider) -> the newest refresh's date
    for run in runs:
        for provider in run.get("refreshes", ()):
            for row in run["rows"]:
                if usable(row.get("split", {}).get(provider, {})):
                    key = (run["machine"], _call_key(row["params"]), provider)
                    newest[key] = max(newest.get(key, ""), run.get("date", ""))
    found: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for index, run in enumerate(runs):
        refreshing = set(run.get("refreshes", ()))
        for row in run["rows"]:
            key = (run["machine"], _call_key(row["params"]))
            scale = scales.get((index, AttentionParams(**row["params"]).is_training), 1.0) if refreshing else 1.0
            for provider, split in row.get("split", {}).items():
                if ":" not in provider or not usable(split):
                    continue
                if (*key, provider) in newest and (provider not in refreshing
                                                   or run.get("date", "") < newest[(*key, provider)]):
                    continue  # measured before the provider's path last changed: the newest refresh replaces it
                host = split["host_ms"] * scale
                found.setdefault(key, {}).setdefault(provider, []).append((host, split["gpu_ms"]))
    return {key: {p: (statistics.median(h for h, _ in v), statistics.median(g for _, g in v)) for p, v in by.items()}
            for key, by in found.items()}


def build(runs: list[dict], *, arch: str, stack: dict[str, str], date: str,
          model: CostModel = COST_MODEL, masked: list[dict] = (), packed: list[dict] = ()) -> dict[str, Any]:
    """A profile from bench_user_step.py runs, each {"machine": device name, "rows": its rows}. Rows of one call
    (the same parameters) on one machine, from any number of runs, make one entry (combine_runs), with the host and
    GPU times of the providers some run split (pooled_splits). `masked`: runs of the same form whose calls have
    modifiers() (bench_masks.py's, as rows), kept apart as the profile's `masked` entries (MaskedCall). `packed`:
    bench_user_step.py runs of packed grids, kept apart as its `packed` entries (packed_entries)."""
    machines = sorted({run["machine"] for run in [*runs, *masked, *packed]})
    entries = []
    splits = pooled_splits(runs)
    for key, (label, params_dict, times, count) in pooled_calls(runs).items():
        machine = key[0]
        params = AttentionParams(**params_dict)
        kind, log2, fmt = features(params, model)
        entries.append({"label": label, "machine": machines.index(machine), "runs": count, "kind": list(kind),
                        "log2": {k: round(v, 4) for k, v in log2.items()}, "fmt": fmt, "work": work(params, model),
                        "times_ms": {k: float(f"{v:.5g}") for k, v in times.items()}})
        unwindowed = unwindowed_work(params, model) if two_sided_training(params) else entries[-1]["work"]
        if unwindowed != entries[-1]["work"]:
            entries[-1]["work_unwindowed"] = unwindowed
        split = {p: hg for p, hg in splits.get(key, {}).items() if p in times}
        if split:
            entries[-1]["host_ms"] = {p: float(f"{h:.4g}") for p, (h, _) in split.items()}
            entries[-1]["gpu_ms"] = {p: float(f"{g:.4g}") for p, (_, g) in split.items()}
    profile = {"arch": arch, "machines": machines, "stack": stack, "date": date, "entries": entries}
    if masked:
        profile["masked"] = masked_entries(masked, machines, model)
    if packed:
        profile["packed"] = packed_entries(packed, machines, model)
    return profile


# A time over this many times the fastest provider's on the same call is no compiled kernel's: flex_attention:torch
# ran a grid's last packs eagerly, materialising the scores (175-504x the fastest), once its compiled code passed
# torch.compile's recompile limit (the engine now keeps a copy per head configuration and grad mode); every compiled
# kernel of the packed grids ran within 8.1x of the fastest.
EAGER_FALLBACK = 20.0


def packed_entries(runs: list[dict], machines: list[str], model: CostModel = COST_MODEL) -> list[dict[str, Any]]:
    """The profile's `packed` entries: each packed (thd) call of the runs on one machine, pooled over the runs as
    build() pools its entries (a stock run's times scaled onto the full stack's by the providers both timed), with
    every provider's time within EAGER_FALLBACK x the call's fastest, and the log2 of its mean sequence length
    (packed_mean_length) beside its sizes. Profile.relative reads a provider without a rate off them."""
    entries = []
    for (machine, _), (label, params_dict, times, count) in pooled_calls([_with_fills(run) for run in runs]).items():
        params = AttentionParams(**params_dict)
        if params.qkv_format != "thd":
            raise ValueError(f"{label!r} ({params.describe()}) is not a packed call: packed entries hold thd calls")
        fastest = min(times.values())
        kind, log2, fmt = features(params, model)
        log2["mean_length"] = math.log2(packed_mean_length(params, model))
        entries.append({"label": label, "machine": machines.index(machine), "runs": count, "kind": list(kind),
                        "log2": {k: round(v, 4) for k, v in log2.items()}, "fmt": fmt, "work": work(params, model),
                        "times_ms": {k: float(f"{v:.5g}") for k, v in times.items()
                                     if v <= EAGER_FALLBACK * fastest}})
        if two_sided_training(params):
            entries[-1]["work_unwindowed"] = unwindowed_work(params, model)
    return entries


def fills_of(params: dict, lengths: tuple[int, ...]) -> dict[str, float | None]:
    """A recorded packed row's fills (packed_fields) from its case's lengths, keys as many as queries."""
    return packed_fields(lengths, lengths, params["max_seqlen_q"], params["max_seqlen_kv"], params["attn_mask_type"],
                         tuple(params.get("window_size") or (-1, -1)))


def _with_fills(run: dict) -> dict:
    """The run with each packed row's fills in its parameters, read from its case's lengths where the row has none
    (rows recorded before calls carried them)."""
    rows = []
    for row in run["rows"]:
        params, lengths = row["params"], tuple((row.get("case") or {}).get("seqlens") or ())
        if params.get("qkv_format") == "thd" and lengths:
            params = {**params, **fills_of(params, lengths)}
            row = {**row, "params": params}
        rows.append(row)
    return {**run, "rows": rows}


def masked_entries(runs: list[dict], machines: list[str], model: CostModel = COST_MODEL) -> list[dict[str, Any]]:
    """The profile's `masked` entries: rows of one call (the same parameters: the policy tells two masks of the same
    size apart no more than this) on one machine make one, its label naming every case measured, its times combined
    over the rows as combine_runs combines runs."""
    grouped: dict[tuple[str, str], tuple[list[str], dict, list[dict[str, float]]]] = {}
    for run in runs:
        for row in run["rows"]:
            times = _provider_times(row)
            if times:
                names, _, found = grouped.setdefault((run["machine"], _call_key(row["params"])),
                                                     ([], row["params"], []))
                names.append(row["label"])
                found.append(times)
    entries = []
    for (machine, _), (names, params_dict, found) in grouped.items():
        params = AttentionParams(**params_dict)
        mods = modifiers(params)
        if not mods:
            raise ValueError(f"masked call {names[0]!r} ({params.describe()}) has no modifier: a plain call's times "
                             "belong in a bench_user_step.py run")
        kind, log2, fmt = features(params, model)
        entries.append({"label": f"{' + '.join(dict.fromkeys(names))}: {params.describe()}",
                        "machine": machines.index(machine), "runs": len(found), "kind": list(kind),
                        "modifiers": list(mods), "log2": {k: round(v, 4) for k, v in log2.items()}, "fmt": fmt,
                        "times_ms": {k: float(f"{v:.5g}") for k, v in combine_runs(found).items()}})
    return entries
