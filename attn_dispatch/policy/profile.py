"""The performance profile shipped with the package, and how it predicts an engine's cost for an unmeasured call.

A profile (profiles/<arch>.json) holds, per measured call and machine, what a user's step cost with each eligible
provider forced (benchmarks/bench_user_step.py: the module called as a user calls it, forward, or forward and
backward into the leaves' .grad; interleaved on the same inputs). One architecture's machines differ (the H200 has
more memory bandwidth and other clocks than the H100, and some crossovers move), so each entry names its machine,
and a prediction uses the machine's own entries where it has enough of that kind of call, else every machine's.

The cost model: a step costs its host time or its GPU time, whichever dominates (the GPU runs behind the host),
combined smoothly as t = (H^8 + G^8)^(1/8).
- H, the host floor of a provider, is a low quantile of what it was measured to cost on calls of the same training
  mode and packing (the least but for a timer's outliers): the tiniest calls are host-bound (flash-attn-4's Python
  launch costs ~0.15-0.2 ms a forward on the H100's host), and packed (thd) calls cost more per call than dense ones.
- G = work / rate: the work is the call's matmul flops counted in the 128 x 128 tiles of the score matrix that a
  tiled kernel computes (a 257-key band costs 3 key tiles per query tile, not 2), and the rate is taken from the
  nearest measured call of the same kind (training or inference; causal, a causal window, a two-sided window or
  neither; packed/padded or dense), nearness being a weighted distance over log2 sizes (head dims, query and key
  lengths, the key span a window leaves, batch x heads, GQA ratio) plus a penalty for another memory format. The
  GPU part of a measured time is what remains of it above the host floor; a neighbour within 3x of its floor hides
  it, and gives no rate to a call bigger than itself (the next nearest does). A provider whose backward skips no
  tile under a two-sided window (CostModel.unwindowed_backward: cuDNN) has its training work counted so, in the
  call and in the neighbours alike.
Where the profile holds a provider's step measured apart as host time and GPU time (bench_user_step.py --split-only:
the GPU time of calls queued behind a spin kernel, the wall time of enqueueing them), those predict it instead: G
from the nearest split entry's GPU rate (no host floor to subtract, so no neighbour's host time leaks into a rate),
H the median host time of the host_k nearest split entries (one host's noise averaged out; flash-attn-4's training
host time is ~1.7x cuDNN's there, where the least step times put it at 1.15x), and t = (H^4 + G^4)^(1/4): a
steady loop of one module costs a little more than the larger of the two where they are close.
A packed (thd) call is predicted from its dense twin (every sequence as long as the longest, the same mask and
window): G is the twin's GPU time x the pack's share of the work (packed_fill; packed_window_fill under a window)
x the engine's varlen factor, and H is the packed calls' host time (Profile.parts; CostModel.packed_twin says why).
A provider no profile-source run timed on a plain call (FlexAttention's) has no rate; on a packed call it is
predicted relative to the providers the decision compares, from the profile's `packed` entries (the packed fit grids,
every provider forced): its time over theirs on the nearest measured packed calls of the same kind and head dims, x
their predicted times (Profile.relative); on a dense call likewise, from the dense entries that timed it.
benchmarks/results/README.md has the leave-one-out and leave-one-grid-out numbers that chose the model;
predict(leave_out=True) leaves every measured entry of the call's own shape (on any machine) out of the neighbours
and the host floors, for that check.
A call with a modifier (modifiers(): softcap, a bias or ALiBi, an arbitrary mask, a user's mask_mod / score_mod,
dropout, ...) is a kind of its own: the rate model's rows have none, so it is predicted from none of them. The
profile's `masked` entries hold what bench_masks.py measured of such calls (policy/modified.py ranks by them).
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

from ..params import AttentionParams
from ..platform import Platform
from .cost_model import (COST_MODEL, FEATURES, CostModel, dense_twin, features, packed_gpu_factor,
                         packed_mean_length, provider_work, two_sided_training, unwindowed_work, without_window, work)

PROFILE_DIR = Path(__file__).with_name("profiles")


def machine_shifts(entries: list[Entry], model: CostModel = COST_MODEL) -> dict[tuple, dict[str, float]]:
    """(provider, training, head dim, machine) -> {other machine: the median of log(time on machine / time on the
    other)} over the dense calls of that pass and head dim both machines timed (the same shape), each provider's time
    at least model.machine_pair_ms on both (GPU-bound), where at least model.machine_pairs such calls exist and the
    median is at least model.machine_shift_min either way. Padded and packed calls are left out: each run drew its
    own lengths."""
    by_shape: dict[tuple, list[Entry]] = {}
    for e in entries:
        if not e.kind[2]:
            by_shape.setdefault(e.shape, []).append(e)
    found: dict[tuple, list[float]] = {}
    for same in by_shape.values():  # every pair of entries of one shape on two machines
        for ea, eb in itertools.permutations(same, 2):
            a, b = ea.machine, eb.machine
            if a == b:
                continue
            head_dim = round(2.0 ** ea.log2["d_qk"])
            for provider, ms in ea.times_ms.items():
                other = eb.times_ms.get(provider)
                if other is not None and min(ms, other) >= model.machine_pair_ms:
                    found.setdefault((provider, ea.kind[0], head_dim, a, b), []).append(math.log(ms / other))
    shifts: dict[tuple, dict[str, float]] = {}
    for (provider, training, head_dim, a, b), logs in sorted(found.items()):
        if len(logs) >= model.machine_pairs and abs(statistics.median(logs)) >= model.machine_shift_min:
            shifts.setdefault((provider, training, head_dim, a), {})[b] = statistics.median(logs)
    return shifts


def _shape(kind: tuple, sizes: tuple[float, ...], fmt: str) -> tuple:
    """What identifies a measured call to the model (leave-one-out leaves out every entry of it, on any machine)."""
    return kind, tuple(round(v, 4) for v in sizes), fmt


@dataclass(frozen=True)
class Entry:
    label: str
    kind: tuple
    log2: dict[str, float]
    fmt: str
    work: float
    times_ms: dict[str, float]
    machine: str = ""
    runs: int = 1
    sizes: tuple[float, ...] = field(default=(), compare=False)
    shape: tuple = field(default=(), compare=False)
    host_ms: dict[str, float] = field(default_factory=dict)  # measured apart (bench_user_step.py --split)
    gpu_ms: dict[str, float] = field(default_factory=dict)
    work_unwindowed: float = 0.0  # unwindowed_work(): set where it differs (training under a two-sided window)

    def work_of(self, provider: str, model: CostModel) -> float:
        return provider_work(provider, self.work, self.work_unwindowed or self.work, model)


@dataclass(frozen=True)
class MaskedCall:
    """A call with modifiers() that bench_masks.py measured: each provider's step time (ms) forced through the
    module, on one machine. Not a rate model's row: policy/modified.py ranks the providers of a call with the same
    modifiers by it."""

    label: str
    machine: str
    kind: tuple
    modifiers: tuple[str, ...]
    sizes: tuple[float, ...]
    fmt: str
    times_ms: dict[str, float]
    runs: int = 1

    @property
    def one_query(self) -> bool:
        """A one-query call (a decode step): log2 of its query length is 0."""
        return self.sizes[FEATURES.index("sq")] <= 0.0

    def distance(self, p: AttentionParams, model: CostModel = COST_MODEL) -> float:
        """The rate model's distance from a call: weighted log2 sizes, and the format penalty."""
        _, log2, fmt = features(p, model)
        return (sum(w * abs(log2[f] - v) for w, f, v in zip(model.weights, FEATURES, self.sizes))
                + (model.format_mismatch if fmt != self.fmt else 0.0))


@dataclass(frozen=True)
class _Neighbours:
    """The entries a prediction compares, in the order that breaks ties of distance (the platform's machine's
    first, then the profile's order), with each entry's sizes and format as indices into the distinct `values` of
    each feature and `formats`: a fresh decision computes each distinct value's weighted distance once, then an
    entry's distance as the sum of its terms looked up, added in the same order as the weighted sum (the same
    float)."""

    entries: tuple[Entry, ...]
    codes: tuple[tuple[int, ...], ...]
    values: tuple[tuple[float, ...], ...]
    formats: tuple[str, ...]

    @classmethod
    def of(cls, entries: list[Entry]) -> _Neighbours:
        values = tuple(tuple(sorted({e.sizes[f] for e in entries})) for f in range(len(FEATURES)))
        formats = tuple(sorted({e.fmt for e in entries}))
        index = [{v: i for i, v in enumerate(vs)} for vs in values]
        fmt_index = {f: i for i, f in enumerate(formats)}
        codes = tuple(tuple(ix[v] for ix, v in zip(index, e.sizes)) + (fmt_index[e.fmt],) for e in entries)
        return cls(tuple(entries), codes, values, formats)

    def without(self, shape: tuple) -> _Neighbours:
        kept = [i for i, e in enumerate(self.entries) if e.shape != shape]
        return _Neighbours(tuple(self.entries[i] for i in kept), tuple(self.codes[i] for i in kept), self.values,
                           self.formats)

    def distances(self, here: tuple[float, ...], fmt: str, model: CostModel) -> list[float]:
        """Each entry's distance from a call of these log2 sizes and format: the sum over the features of
        weight x |difference|, plus model.format_mismatch for another format."""
        t0, t1, t2, t3, t4, t5, t6 = ([w * abs(h - v) for v in vs] for w, h, vs in zip(model.weights, here,
                                                                                       self.values))
        mismatch = [model.format_mismatch if f != fmt else 0.0 for f in self.formats]
        return [t0[a] + t1[b] + t2[c] + t3[d] + t4[e] + t5[f] + t6[g] + mismatch[x]
                for a, b, c, d, e, f, g, x in self.codes]


@dataclass(frozen=True)
class Prediction:
    """Predicted step time (ms) of each provider the profile knows for this kind of call, the measured calls
    nearest to it, and whose measurements they were: `machine` when the platform's own machine had enough entries
    of this kind, else None (every machine of the architecture)."""

    times_ms: dict[str, float]
    neighbours: tuple[str, ...]
    machine: str | None = None
    own_entries: int = 0  # this machine's entries of this kind of call
    # providers predicted relative to others (Profile.relative): the measured packed calls each was read off
    relative: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def best(self, candidates: list[str]) -> str | None:
        known = [(self.times_ms[c], i, c) for i, c in enumerate(candidates) if c in self.times_ms]
        return min(known)[2] if known else None


@dataclass(frozen=True)
class Parts:
    """A prediction's pieces per provider: host time and GPU time (ms), which providers were predicted from entries
    that split their step (combined with split_combine, else combine), the nearest calls shown, whose machine."""

    hosts: dict[str, float]
    gpus: dict[str, float]
    split: frozenset[str]
    shown: tuple[str, ...]
    own: str | None
    own_entries: int

    def prediction(self, model: CostModel) -> Prediction:
        times = {}
        for provider, gpu in self.gpus.items():
            power = model.split_combine if provider in self.split else model.combine
            times[provider] = (self.hosts[provider] ** power + gpu ** power) ** (1.0 / power)
        return Prediction(times, self.shown, self.own, self.own_entries)


class Profile:
    def __init__(self, data: dict[str, Any], source: str = "", model: CostModel = COST_MODEL):
        self.source = source
        self.model = model
        self.arch: str = data["arch"]
        self.machines: list[str] = data.get("machines", [])
        self.stack: dict[str, str] = data.get("stack", {})
        self.date: str = data.get("date", "")
        # A relative_only provider's dense times are kept apart (what it is predicted relative to the others off), and
        # out of the rate model's entries.
        self.entries: list[Entry] = []
        self._dense_relative: dict[tuple, list[Entry]] = {}
        for e in map(self._entry, data["entries"]):
            if any(p in e.times_ms for p in model.relative_only):
                if e.kind[1] in model.relative_dense_kinds:
                    self._dense_relative.setdefault(e.kind, []).append(e)
                e = replace(e, **{name: {p: t for p, t in getattr(e, name).items() if p not in model.relative_only}
                                  for name in ("times_ms", "host_ms", "gpu_ms")})
            if e.times_ms:
                self.entries.append(e)
        # The packed fit grids' calls (every provider's step time): what a provider without a rate is read off, per
        # kind of call (Profile.relative). Never a neighbour of the rate model.
        self._packed: dict[tuple, list[Entry]] = {}
        for e in data.get("packed", ()):
            entry = self._entry(e)
            self._packed.setdefault(entry.kind, []).append(entry)
        self._relative_slopes: dict[tuple[str, str], float] = {}  # relative_slope's answers, computed once each
        self.masked: list[MaskedCall] = [
            MaskedCall(e["label"], self.machines[e["machine"]], tuple(e["kind"]), tuple(e["modifiers"]),
                       tuple(e["log2"][f] for f in FEATURES), e["fmt"], e["times_ms"], e.get("runs", 1))
            for e in data.get("masked", ())]
        # Host floors per (machine or None for all, provider, training, packed or None for either): the few least
        # times with their calls' shapes (leave-one-out leaves a shape out of the floor too), and how many calls.
        self._floors: dict[tuple, list[tuple[float, tuple]]] = {}
        self._timed: dict[tuple, int] = {}
        self.host_ms: dict[tuple[str, bool], float] = {}  # (provider, training): the least time of any call
        for e in self.entries:
            for provider, ms in e.times_ms.items():
                for scope in (e.machine, None):
                    for packed in (e.kind[2], None):
                        key = (scope, provider, e.kind[0], packed)
                        self._floors[key] = sorted(self._floors.get(key, []) + [(ms, e.shape)])[:model.floor_rank + 1]
                        self._timed[key] = self._timed.get(key, 0) + 1
                self.host_ms[(provider, e.kind[0])] = min(self.host_ms.get((provider, e.kind[0]), math.inf), ms)
        self._machine_shifts = machine_shifts(self.entries, model) if model.machine_shift else {}
        # _host's answers without leave-one-out (what a fresh decision asks), looked up once here; kind[1] unused.
        self._host_floor = {(scope, provider, training, packed): self._host(provider, (training, None, packed), scope)
                            for scope, provider, training, _ in self._floors for packed in (False, True)}
        # Per kind of call, its entries: a fresh decision compares only these. And per (machine, kind), how many.
        self._by_kind: dict[tuple, list[Entry]] = {}
        self._providers: dict[tuple, set[str]] = {}
        self._count: dict[tuple, int] = {}
        for e in self.entries:
            self._by_kind.setdefault(e.kind, []).append(e)
            self._providers.setdefault(e.kind, set()).update(e.times_ms)
            self._count[(e.machine, e.kind)] = self._count.get((e.machine, e.kind), 0) + 1
        # Per kind, the providers some entry holds a host/GPU split of, sorted (the times' order must not depend on
        # set hashing).
        self._split: dict[tuple, tuple[str, ...]] = {
            kind: tuple(sorted({p for e in entries for p in e.gpu_ms}))
            for kind, entries in self._by_kind.items()} if model.use_split else {}
        # What a prediction compares, per (kind, machine, own machine's entries alone): see _Neighbours.
        self._neighbours: dict[tuple, _Neighbours] = {}
        for kind, entries in self._by_kind.items():
            self._neighbours[(kind, None, False)] = _Neighbours.of(entries)
            for machine in {e.machine for e in entries}:
                self._neighbours[(kind, machine, True)] = _Neighbours.of([e for e in entries if e.machine == machine])
                self._neighbours[(kind, machine, False)] = _Neighbours.of(
                    [e for e in entries if e.machine == machine] + [e for e in entries if e.machine != machine])

    def _entry(self, e: dict[str, Any]) -> Entry:
        kind = tuple(e["kind"])
        sizes = tuple(e["log2"][f] for f in FEATURES)
        machine = e.get("machine", self.machines[0] if len(self.machines) == 1 else "")
        if isinstance(machine, int):
            machine = self.machines[machine]
        return Entry(e["label"], kind, e["log2"], e["fmt"], e["work"], e["times_ms"], machine, e.get("runs", 1), sizes,
                     _shape(kind, sizes, e["fmt"]), e.get("host_ms", {}), e.get("gpu_ms", {}),
                     e.get("work_unwindowed", 0.0))

    def describe(self) -> str:
        stack = ", ".join(f"{k} {v}" for k, v in self.stack.items())
        return f"the {self.arch} profile measured on {' and '.join(self.machines)} ({stack}; {self.date})"

    def own_machine(self, kind: tuple, machine: str | None) -> str | None:
        """The machine whose entries alone predict this kind of call: the platform's own if the profile has at
        least min_own of them, else None (every machine's entries)."""
        if machine and self._count.get((machine, kind), 0) >= self.model.min_own:
            return machine
        return None

    def predict(self, params: AttentionParams, *, machine: str | None = None, leave_out: bool = False,
                among: list[str] | None = None) -> Prediction:
        """Each provider's step time for the call on `machine` (the platform's device name; None: any machine).
        `among`: the providers the decision compares; those of them without a rate are predicted relative to the others
        (relative())."""
        found = self.parts(params, machine=machine, leave_out=leave_out).prediction(self.model)
        if among is None:
            return found
        relative = self.relative(params, found.times_ms, among, machine=machine, leave_out=leave_out)
        if not relative:
            return found
        return Prediction({**found.times_ms, **{p: t for p, (t, _) in relative.items()}}, found.neighbours,
                          found.machine, found.own_entries, {p: calls for p, (_, calls) in relative.items()})

    def relative(self, params: AttentionParams, predicted: dict[str, float], among: list[str], *,
                 machine: str | None = None, leave_out: bool = False) -> dict[str, tuple[float, tuple[str, ...]]]:
        """The providers of `among` without a prediction on this call, each as (step ms, the measured calls it was read
        off): on the relative_k nearest entries of the call's kind and head dims that timed it (a packed call: the
        profile's packed entries; a dense one: its dense entries that timed a relative_only provider) (the rate
        model's distance; the machine's own first among equals) that timed it and some of the predicted providers of
        `among`, its time over each of those there x their work ratio here over there (the geometric mean; the work
        ratio differs from 1 where one of them skips no window tile in its backward: provider_work), moved to the
        call's mean sequence length (relative_slope, with model.relative_length_slope; at most to the longest mean
        length of those entries), x that provider's predicted time here; averaged in log, weighted 1 / (distance +
        0.25) as the rate model weights its neighbours; on a packed call x model.relative_packed_margin. Fewer than
        relative_k such entries: none. leave_out leaves the call's own shape out (of the slope's fit too)."""
        m = self.model
        references = [p for p in among if p in predicted]
        missing = [p for p in among if p not in predicted]
        if not references or not missing or m.relative_k < 1:
            return {}
        kind, log2, fmt = features(params, m)
        here = tuple(log2[f] for f in FEATURES)
        packed = params.qkv_format == "thd"
        length = math.log2(packed_mean_length(params, m)) if packed else 0.0  # dense entries keep no mean length
        dims = tuple(round(v, 4) for v in here[:2])  # head dims qk and v, as entries keep their sizes
        skip = _shape(kind, here, fmt) if leave_out else None
        pool = (self._packed if packed else self._dense_relative).get(kind, ())
        near = sorted(((sum(w * abs(h - v) for w, h, v in zip(m.weights, here, e.sizes))
                        + (m.format_mismatch if e.fmt != fmt else 0.0), e.machine != machine, i, e)
                       for i, e in enumerate(pool) if e.sizes[:2] == dims and e.shape != skip),
                      key=lambda found: found[:3])
        measured = [e.log2["mean_length"] for *_, e in near if "mean_length" in e.log2]
        if measured:  # never moved past the longest mean length measured
            length = min(length, max(measured))
        windowed = work(params, m)
        unwindowed = unwindowed_work(params, m) if two_sided_training(params) else windowed
        out = {}
        for provider in missing:
            used = [(dist, e) for dist, _, _, e in near
                    if provider in e.times_ms and any(r in e.times_ms for r in references)][:m.relative_k]
            if len(used) < m.relative_k:
                continue
            logs, weights = [], []
            for dist, e in used:
                shared = [r for r in references if r in e.times_ms]
                moved = [self.relative_slope(provider, r, skip) * (length - e.log2["mean_length"])
                         if m.relative_length_slope and "mean_length" in e.log2 else 0.0 for r in shared]
                here_over_there = [provider_work(provider, windowed, unwindowed, m)
                                   / provider_work(r, windowed, unwindowed, m)
                                   / (e.work_of(provider, m) / e.work_of(r, m)) for r in shared]
                logs.append(sum(math.log(predicted[r] * e.times_ms[provider] / e.times_ms[r] * works) + shift
                                for r, shift, works in zip(shared, moved, here_over_there)) / len(shared))
                weights.append(1.0 / (dist + 0.25))
            ms = math.exp(sum(w * lg for w, lg in zip(weights, logs)) / sum(weights))
            ms *= self.relative_margin(params)
            out[provider] = (ms, tuple(e.label + ("" if len(self.machines) < 2 else f" ({e.machine})")
                                       for _, e in used))
        return out

    def relative_margin(self, params: AttentionParams) -> float:
        """The factor on a provider's time read relative to others (relative): model.relative_packed_margin on a
        packed call, 1 elsewhere."""
        return self.model.relative_packed_margin if params.qkv_format == "thd" else 1.0

    def relative_slope(self, provider: str, reference: str, skip: tuple | None = None) -> float:
        """The slope of log(provider's time / reference's time) over log2 of the mean sequence length, on the
        profile's packed entries that timed both (but those of the shape skip): least squares within each kind and
        head dims (each group's own mean taken out), pooled; 0 where no group holds two different mean lengths."""
        key = (provider, reference)
        if skip is None and key in self._relative_slopes:
            return self._relative_slopes[key]
        products = squares = 0.0
        for entries in self._packed.values():
            groups: dict[tuple, list[tuple[float, float]]] = {}
            for e in entries:
                if provider in e.times_ms and reference in e.times_ms and "mean_length" in e.log2 and e.shape != skip:
                    groups.setdefault(e.sizes[:2], []).append(
                        (e.log2["mean_length"], math.log(e.times_ms[provider] / e.times_ms[reference])))
            for points in groups.values():
                x0 = sum(x for x, _ in points) / len(points)
                y0 = sum(y for _, y in points) / len(points)
                products += sum((x - x0) * (y - y0) for x, y in points)
                squares += sum((x - x0) ** 2 for x, _ in points)
        slope = products / squares if squares > 0 else 0.0
        if skip is None:
            self._relative_slopes[key] = slope
        return slope

    def parts(self, params: AttentionParams, *, machine: str | None = None, leave_out: bool = False) -> Parts:
        """predict()'s host and GPU time of each provider, apart."""
        if params.qkv_format == "thd" and self.model.packed_twin:
            return self._packed_parts(params, machine, leave_out)
        return self._parts(params, machine, leave_out)

    def _packed_parts(self, params: AttentionParams, machine: str | None, leave_out: bool) -> Parts:
        """A packed call: the GPU time of its dense twin (dense_twin: every sequence the longest, the same mask and
        window) from the dense calls' rates, times the pack's share of the work and the provider's varlen factor
        (packed_gpu_factor); the host time of the packed calls measured (of the same training mode and mask; a
        window changes no host path). Only the providers measured on packed calls are predicted (all of the twin's
        where the profile has no packed call of this kind)."""
        m = self.model
        twin = self._parts(dense_twin(params), machine, False)  # a dense call: never the packed call left out
        hostly = self._parts(params if not params.has_sliding_window else without_window(params), machine, leave_out)
        packed = [p for p in twin.gpus if p in hostly.hosts or not hostly.hosts]  # the providers measured packed
        gpus = {p: twin.gpus[p] * packed_gpu_factor(p, params, m, machine) for p in packed}
        hosts = {p: hostly.hosts.get(p, twin.hosts[p]) for p in packed}
        split = frozenset(p for p in packed if (p in hostly.split if p in hostly.hosts else p in twin.split))
        shown = twin.shown + tuple(f"host: {label}" for label in hostly.shown)
        return Parts(hosts, gpus, split, shown, hostly.own, hostly.own_entries)

    def _parts(self, params: AttentionParams, machine: str | None, leave_out: bool) -> Parts:
        """Each provider's host time and GPU time for the call from the nearest measured calls of its kind."""
        m = self.model
        kind, log2, fmt = features(params, m)
        here = tuple(log2[f] for f in FEATURES)
        skip = _shape(kind, here, fmt) if leave_out else None
        own = self.own_machine(kind, machine)
        if own and leave_out:  # the count must not include the call left out
            mine = sum(1 for e in self._by_kind.get(kind, ()) if e.machine == own and e.shape != skip)
            own = own if mine >= m.min_own else None
        own_entries = self._count.get((machine, kind), 0) if machine else 0
        near = self._candidates(kind, machine, own)
        if near is None:
            return Parts({}, {}, frozenset(), (), own, own_entries)
        if skip is not None:
            near = near.without(skip)
        entries, dist = near.entries, near.distances(here, fmt, m)
        order = sorted(range(len(entries)), key=dist.__getitem__)  # stable: ties keep the neighbours' order
        hosts: dict[str, float] = {}
        rates: dict[str, list[tuple[float, float]]] = {}
        windowed = work(params, m)
        unwindowed = unwindowed_work(params, m) if two_sided_training(params) else windowed
        amounts = {provider: provider_work(provider, windowed, unwindowed, m)
                   for provider in self._providers.get(kind, ())}
        fallback: dict[str, tuple[float, float]] = {}
        split = set()  # providers predicted from split entries: those some neighbour holds a split of
        for provider in self._split.get(kind, ()):
            host = self._split_host(provider, entries, order)
            if host is not None:
                split.add(provider)
                hosts[provider] = host
                rates[provider] = self._split_rates(provider, entries, order, dist, amounts[provider], fallback,
                                                    self._shifts_to(provider, params, machine))
        pending = set(self._providers.get(kind, ())) - split  # providers still short of k rates (or a fallback)
        shifts = {provider: self._shifts_to(provider, params, machine) for provider in pending}
        for i in order:
            if not pending:
                break
            e = entries[i]
            for provider, ms in e.times_ms.items():
                if provider in split:
                    continue
                shift = shifts[provider].get(e.machine, 0.0)
                found = rates.setdefault(provider, [])
                if len(found) >= m.k:
                    continue
                host = hosts.get(provider)
                if host is None:
                    host = hosts[provider] = (self._host_floor.get((own, provider, kind[0], kind[2]), 0.0)
                                              if skip is None else self._host(provider, kind, own, skip))
                gpu = max(ms ** m.combine - host ** m.combine, (0.05 * ms) ** m.combine) ** (1.0 / m.combine)
                done = e.work_of(provider, m)
                if ms < m.host_bound * host and amounts[provider] > done:
                    fallback.setdefault(provider, (dist[i], math.log(done / gpu) - shift))
                    continue
                found.append((dist[i], math.log(done / gpu) - shift))
                if len(found) >= m.k:
                    pending.discard(provider)
        for provider, found in rates.items():
            if not found:
                found.append(fallback[provider])
        gpus = {}
        for provider, found in rates.items():
            weights = [1.0 / (dist + 0.25) for dist, _ in found]
            rate = math.exp(sum(w * lr for w, (_, lr) in zip(weights, found)) / sum(weights))
            gpus[provider] = amounts[provider] / rate
        shown = tuple(entries[i].label + ("" if own or len(self.machines) < 2 else f" ({entries[i].machine})")
                      for i in order[:max(1, m.k)])
        return Parts(hosts, gpus, frozenset(split), shown, own, own_entries)

    def _split_host(self, provider: str, entries: tuple[Entry, ...], order: list[int]) -> float | None:
        """The median host time of the host_k nearest entries that split the provider's step, x host_scale (None:
        no neighbour does)."""
        found = list(islice((entries[i].host_ms[provider] for i in order if provider in entries[i].host_ms),
                            self.model.host_k))
        return statistics.median(found) * self.model.host_scale if found else None

    def _shifts_to(self, provider: str, params: AttentionParams, machine: str | None) -> dict[str, float]:
        """Per other machine, log(the provider's time on `machine` / its time there) for calls of this pass and head
        dim (machine_shifts); empty where none is known."""
        if not machine or not self._machine_shifts:
            return {}
        return self._machine_shifts.get((provider, params.is_training, params.head_dim_qk, machine), {})

    def _split_rates(self, provider: str, entries: tuple[Entry, ...], order: list[int], dist: list[float],
                     amount: float, fallback: dict[str, tuple[float, float]],
                     shifts: dict[str, float]) -> list[tuple[float, float]]:
        """(distance, log GPU rate) of the k nearest entries that split the provider's step, each on the asked
        machine's scale (shifts); a neighbour whose GPU time is under min_rate_gpu_ms gives none to a call of more
        work (its first one becomes the fallback)."""
        found = []
        for i in order:
            e = entries[i]
            gpu = e.gpu_ms.get(provider)
            if gpu is None:
                step = e.times_ms.get(provider, 0.0)
                if not self.model.unsplit_gpu_bound_ms or step < self.model.unsplit_gpu_bound_ms:
                    continue
                gpu = step
            done = e.work_of(provider, self.model)
            shift = shifts.get(e.machine, 0.0)
            if gpu < self.model.min_rate_gpu_ms and amount > done:
                fallback.setdefault(provider, (dist[i], math.log(done / gpu) - shift))
                continue
            found.append((dist[i], math.log(done / gpu) - shift))
            if len(found) >= self.model.k:
                break
        return found

    def _candidates(self, kind: tuple, machine: str | None, own: str | None) -> _Neighbours | None:
        """The entries a prediction compares, ordered as ties of distance are broken: the own machine's alone, or
        every machine's with `machine`'s first (the profile's order where it has none of them)."""
        if own:
            return self._neighbours.get((kind, own, True))
        return self._neighbours.get((kind, machine, False)) or self._neighbours.get((kind, None, False))

    def _host(self, provider: str, kind: tuple, machine: str | None = None, skip: tuple | None = None) -> float:
        """The provider's host floor for this kind of call: a low quantile of the times of calls of the same training
        mode and packing, else of that training mode, on the machine (None: any machine), leaving the shape skip
        out."""
        for packed in (kind[2], None):
            key = (machine, provider, kind[0], packed)
            found = [ms for ms, shape in self._floors.get(key, ()) if shape != skip]
            if found:  # a low quantile (~1 in 10 calls), robust to a timer's outlier, at most floor_rank up
                return found[min(self.model.floor_rank, self._timed[key] // 10, len(found) - 1)]
        return 0.0


def arch_of(platform: Platform) -> str | None:
    return f"sm{platform.sm}" if platform.device_type == "cuda" and platform.sm else None


@lru_cache(maxsize=8)
def _load(path: str) -> Profile:
    return Profile(json.loads(Path(path).read_text()), source=path)


def profile_for(platform: Platform, directory: Path = PROFILE_DIR) -> Profile | None:
    """The shipped profile for the platform's architecture, or None."""
    arch = arch_of(platform)
    if arch is None:
        return None
    path = directory / f"{arch}.json"
    return _load(str(path)) if path.is_file() else None
