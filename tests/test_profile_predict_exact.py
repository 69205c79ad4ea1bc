"""Profile.predict is a faster form of a plain nearest-neighbour walk: its times must equal, to the last bit, those
of the plain form kept here (recomputed from the profile's JSON on every run, never hard-coded), for every call of
every benchmark grid, on both profiled machines and an unprofiled one, with and without leave-one-out."""
from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import replace

import pytest

from attn_dispatch import AttentionParams
from attn_dispatch.params import packed_fields
from attn_dispatch.benchmarking.cases import CASE_GRIDS, Case
from attn_dispatch.policy.cost_model import COST_MODEL, CostModel, features, measured_pack_fills, tiled_pairs
from attn_dispatch.policy.profile import PROFILE_DIR, Profile
from attn_dispatch.policy.timing import attended_pairs, attention_flops, mode_of

FEATURES = ("d_qk", "d_v", "sq", "skv", "span", "bh", "gqa")
MACHINES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H800", None)


def params_of(case: Case) -> AttentionParams:
    fills = {}
    if case.seqlens:  # a packed case's own lengths, as the module reads them
        fills = packed_fields(case.seqlens, case.seqlens, case.s, case.skv, case.mask, case.window)
    return AttentionParams(**fills, dtype="bfloat16", qkv_format=case.fmt, batch_size=case.b, num_heads=case.h,
                           num_gqa_groups=case.hkv, head_dim_qk=case.d, head_dim_v=case.dv, max_seqlen_q=case.s,
                           max_seqlen_kv=case.skv, attn_mask_type=case.mask, window_size=case.window,
                           is_training=case.train)


def every_grid_call() -> list[AttentionParams]:
    calls = {}
    for grid in CASE_GRIDS.values():
        for case in grid():
            if case.h % case.hkv:  # a few drawn calls Transformer Engine rejects (GQA must divide the heads)
                continue
            for fmt in {case.fmt, "bshd", "sbhd"} if case.fmt != "thd" else {"thd"}:
                for train in (True, False):
                    p = params_of(replace(case, fmt=fmt, train=train, name=""))
                    calls[p] = p
    return list(calls.values())


def plain_work(p: AttentionParams, model: CostModel) -> float:
    flops = attention_flops(p, mode_of(p))
    nominal = flops * tiled_pairs(p, model.tile) / max(1, attended_pairs(p)) if model.tile else flops
    if p.qkv_format != "thd" or not model.packed_lengths:
        return nominal
    # a pack's share of the full-length work: its fills (under a window, its window fill), or the measured packs'
    # expected ones
    if p.has_sliding_window and p.packed_window_fill is not None:
        return nominal * p.packed_window_fill
    fill, tokens = p.packed_fill, p.packed_token_fill
    if fill is None or tokens is None:
        fill, tokens = measured_pack_fills(p.batch_size, p.max_seqlen_q, p.max_seqlen_kv, p.attn_mask_type,
                                           model.tile or 128)
    if not p.has_sliding_window:
        return nominal * min(fill, tokens)
    unbounded = replace(model, packed_lengths=False)
    full = plain_work(p.replace(window_size=(-1, 0) if p.is_causal else (-1, -1)), unbounded)
    return nominal * (min(full * fill, nominal * tokens) / nominal)


def plain_amount(provider: str, windowed: float, unwindowed: float, model: CostModel) -> float:
    """A provider that skips no tile in a two-sided window's backward: the forward's windowed flops (1 part in 3.5)
    and the backward's unwindowed ones (2.5 parts)."""
    if provider in model.unwindowed_backward and unwindowed != windowed:  # (equal: the work itself, to the bit)
        return (windowed + 2.5 * unwindowed) / 3.5
    return windowed


def plain_distance(model: CostModel, here: tuple, sizes: tuple, fmt: str, call_fmt: str) -> float:
    dist = 0.0
    for w, h, z in zip(model.weights, here, sizes):
        dist += w * abs(h - z)
    return dist + (model.format_mismatch if fmt != call_fmt else 0.0)


def shape_of(kind, sizes, fmt):
    return kind, tuple(round(v, 4) for v in sizes), fmt


class PlainProfile:
    """The model as profile.py's docstring states it, one entry at a time, from the JSON."""

    def __init__(self, data: dict, model: CostModel):
        self.model = model
        self.machines = data.get("machines", [])
        self.entries = []
        self.floors = {}  # host floors, memoised: the plain form scans every entry for one
        self.kinds = {}  # each kind's entries, in the JSON's order, the providers split in one of them, and all
        self.distances = {}  # a call's distance to each entry of its kind: the same for every machine and leave-out
        for e in data["entries"]:
            machine = e.get("machine", self.machines[0] if len(self.machines) == 1 else "")
            machine = self.machines[machine] if isinstance(machine, int) else machine
            kind, sizes = tuple(e["kind"]), tuple(e["log2"][f] for f in FEATURES)
            rated = {name: {p: t for p, t in e.get(name, {}).items() if p not in model.relative_only}
                     for name in ("times_ms", "host_ms", "gpu_ms")}  # relative_only providers have no rate
            if not rated["times_ms"]:
                continue
            self.entries.append(dict(label=e["label"], kind=kind, sizes=sizes, fmt=e["fmt"], work=e["work"],
                                     times=rated["times_ms"], machine=machine,
                                     shape=shape_of(kind, sizes, e["fmt"]), host_ms=rated["host_ms"],
                                     gpu_ms=rated["gpu_ms"], work_unwindowed=e.get("work_unwindowed", e["work"])))

    def shift(self, provider, params, machine, other):
        """log(time on machine / time on other) of the provider: the median over the unpadded calls of this pass and
        head dim both timed (the same shape), each at least machine_pair_ms on both; 0 with fewer than
        machine_pairs of them, or a median under machine_shift_min either way."""
        m = self.model
        key = ("shift", provider, params.is_training, params.head_dim_qk, machine, other)
        if key not in self.floors:
            logs = []
            if m.machine_shift and machine and other != machine:
                for a in self.entries:
                    if (a["machine"] != machine or a["kind"][2] or a["kind"][0] != params.is_training
                            or round(2.0 ** a["sizes"][0]) != params.head_dim_qk):
                        continue
                    for b in self.entries:
                        if b["machine"] == other and b["shape"] == a["shape"] and provider in a["times"] \
                                and provider in b["times"] \
                                and min(a["times"][provider], b["times"][provider]) >= m.machine_pair_ms:
                            logs.append(math.log(a["times"][provider] / b["times"][provider]))
            median = statistics.median(logs) if len(logs) >= m.machine_pairs else 0.0
            self.floors[key] = median if abs(median) >= m.machine_shift_min else 0.0
        return self.floors[key]

    def host(self, provider, kind, machine, skip):
        key = (provider, kind[0], kind[2], machine, skip)
        if key not in self.floors:
            self.floors[key] = self._host(provider, kind, machine, skip)
        return self.floors[key]

    def _host(self, provider, kind, machine, skip):
        """The (r + 1)-th least time of the floor_rank + 1 least (skip's shape then left out of those), r =
        min(floor_rank, calls // 10), of the calls of this training mode and packing, else of this training mode."""
        m = self.model
        for packed in (kind[2], None):
            key = ("timed", provider, kind[0], packed, machine)  # the same sorted list whatever is left out
            if key not in self.floors:
                self.floors[key] = sorted((e["times"][provider], e["shape"]) for e in self.entries
                                          if provider in e["times"] and e["kind"][0] == kind[0]
                                          and (packed is None or e["kind"][2] == packed)
                                          and (machine is None or e["machine"] == machine))
            timed = self.floors[key]
            least = [ms for ms, shape in timed[:m.floor_rank + 1] if shape != skip]
            if least:
                return least[min(m.floor_rank, len(timed) // 10, len(least) - 1)]
        return 0.0

    def predict(self, params, machine, leave_out):
        """(times, neighbours shown, own machine, own entries): a packed call from its dense twin's GPU time and
        the packed calls' host time, any other from its own kind's nearest calls."""
        m = self.model
        if params.qkv_format == "thd" and m.packed_twin:
            hosts, gpus, split, shown, own, own_entries = self.packed_parts(params, machine, leave_out)
        else:
            hosts, gpus, split, shown, own, own_entries = self.parts(params, machine, leave_out)
        times = {}
        for provider, gpu in gpus.items():
            power = m.split_combine if provider in split else m.combine
            times[provider] = (hosts[provider] ** power + gpu ** power) ** (1.0 / power)
        return times, shown, own, own_entries

    def packed_parts(self, params, machine, leave_out):
        """The twin: every sequence the longest, as a dense call (bshd, the mask without padding, the window kept);
        its GPU time x the provider's work of the pack over the twin's x the varlen factor. Host: the packed calls'
        (the window left out), for the providers measured packed."""
        m = self.model
        dense_mask = {"padding": "no_mask", "padding_causal": "causal",
                      "padding_causal_bottom_right": "causal_bottom_right"}
        twin = replace(params, qkv_format="bshd", attn_mask_type=dense_mask.get(params.attn_mask_type,
                                                                                params.attn_mask_type),
                       packed_fill=None, packed_token_fill=None, packed_window_fill=None, pad_between_seqs=False,
                       seqlens_differ=False)
        t_hosts, t_gpus, t_split, t_shown, _, _ = self.parts(twin, machine, False)
        unwindowed = replace(params, window_size=(-1, 0) if params.is_causal else (-1, -1))
        h_hosts, _, h_split, h_shown, own, own_entries = self.parts(
            unwindowed if params.has_sliding_window else params, machine, leave_out)

        def amount(provider, p):
            two_sided = p.is_training and p.has_sliding_window and p.window_size[1] != 0
            full = plain_work(replace(p, window_size=(-1, 0) if p.is_causal else (-1, -1)), m) if two_sided \
                else plain_work(p, m)
            return plain_amount(provider, plain_work(p, m), full, m)

        varlen = dict(m.varlen_factor)
        on_machine = dict(m.machine_varlen_factor)
        packed = [p for p in t_gpus if p in h_hosts or not h_hosts]
        gpus = {p: t_gpus[p] * (amount(p, params) / amount(p, twin)
                                * (varlen.get(p, 1.0) * on_machine.get(f"{p}@{machine}", 1.0))) for p in packed}
        hosts = {p: h_hosts.get(p, t_hosts[p]) for p in packed}
        split = {p for p in packed if (p in h_split if p in h_hosts else p in t_split)}
        return hosts, gpus, split, t_shown + tuple(f"host: {label}" for label in h_shown), own, own_entries

    def parts(self, params, machine, leave_out):
        m = self.model
        kind, log2, fmt = features(params, m)
        here = tuple(log2[f] for f in FEATURES)
        skip = shape_of(kind, here, fmt) if leave_out else None
        if kind not in self.kinds:
            entries = [e for e in self.entries if e["kind"] == kind]
            self.kinds[kind] = (entries, sorted({p for e in entries for p in e["gpu_ms"]}),
                                {p for e in entries for p in e["times"]})
        of_kind, split_in_kind, timed_in_kind = self.kinds[kind]
        if (kind, here, fmt) not in self.distances:
            self.distances[kind, here, fmt] = [plain_distance(m, here, e["sizes"], e["fmt"], fmt) for e in of_kind]
        distances = self.distances[kind, here, fmt]
        mine = sum(1 for e in of_kind if e["machine"] == machine and e["shape"] != skip)
        own = machine if machine and mine >= m.min_own else None
        near = []
        for i, e in enumerate(of_kind):
            if e["shape"] == skip or (own is not None and e["machine"] != own):
                continue
            near.append((distances[i], e["machine"] != machine, i))
        near.sort()
        left, right = params.window_size
        two_sided = params.is_training and params.has_sliding_window and right != 0
        windowed = plain_work(params, m)
        unwindowed = plain_work(replace(params, window_size=(-1, 0) if params.is_causal else (-1, -1)), m) \
            if two_sided else windowed

        def amount_of(provider):
            return plain_amount(provider, windowed, unwindowed, m)

        def done(e, provider):
            return plain_amount(provider, e["work"], e["work_unwindowed"], m)
        hosts, rates, fallback = {}, {}, {}
        # Providers split in some entry of the kind, where a neighbour holds a split of them: host = median of the
        # host_k nearest such neighbours' host times x host_scale; rates from the k nearest such neighbours and
        # unsplit ones of at least unsplit_gpu_bound_ms, one under min_rate_gpu_ms of GPU time and of less work than
        # the call only a fallback.
        split = set()
        for provider in split_in_kind if m.use_split else ():
            with_split = ((dist, of_kind[i]) for dist, _, i in near if provider in of_kind[i]["gpu_ms"])
            nearest_split = list(itertools.islice(with_split, m.host_k))  # read on from there below, not again
            if not nearest_split:
                continue
            split.add(provider)
            nearest = [e["host_ms"][provider] for _, e in nearest_split]
            hosts[provider] = statistics.median(nearest) * m.host_scale
            found = rates[provider] = []
            for dist, e in ((dist, of_kind[i]) for dist, _, i in near):
                gpu = e["gpu_ms"].get(provider)
                if gpu is None:  # an unsplit step gives its time as GPU time where it is GPU-bound
                    step = e["times"].get(provider, 0.0)
                    if not m.unsplit_gpu_bound_ms or step < m.unsplit_gpu_bound_ms:
                        continue
                    gpu = step
                shift = self.shift(provider, params, machine, e["machine"])
                if gpu < m.min_rate_gpu_ms and amount_of(provider) > done(e, provider):
                    fallback.setdefault(provider, (dist, math.log(done(e, provider) / gpu) - shift))
                elif len(found) < m.k:
                    found.append((dist, math.log(done(e, provider) / gpu) - shift))
                if m.k and len(found) == m.k:
                    break  # a fallback is read only where no rate was found
        short = timed_in_kind - split  # the providers still short of k rates
        for dist, _, i in near:
            if m.k and not short:
                break  # every provider has its k rates: the entries further away change nothing
            e = of_kind[i]
            for provider, ms in e["times"].items():
                if provider in split:
                    continue
                found = rates.setdefault(provider, [])
                if len(found) >= m.k:
                    continue
                host = hosts.setdefault(provider, self.host(provider, kind, own, skip))
                gpu = max(ms ** m.combine - host ** m.combine, (0.05 * ms) ** m.combine) ** (1.0 / m.combine)
                shift = self.shift(provider, params, machine, e["machine"])
                if ms < m.host_bound * host and amount_of(provider) > done(e, provider):
                    fallback.setdefault(provider, (dist, math.log(done(e, provider) / gpu) - shift))
                else:
                    found.append((dist, math.log(done(e, provider) / gpu) - shift))
                    if len(found) >= m.k:
                        short.discard(provider)
        gpus = {}
        for provider, found in rates.items():
            found = found or [fallback[provider]]
            weights = [1.0 / (dist + 0.25) for dist, _ in found]
            rate = math.exp(sum(w * lr for w, (_, lr) in zip(weights, found)) / sum(weights))
            gpus[provider] = amount_of(provider) / rate
        shown = tuple(of_kind[i]["label"] + ("" if own or len(self.machines) < 2 else f" ({of_kind[i]['machine']})")
                      for _, _, i in near[:max(1, m.k)])
        return hosts, gpus, split, shown, own, sum(1 for e in of_kind if e["machine"] == machine) if machine else 0


@pytest.fixture(scope="module")
def shipped() -> dict:
    return json.loads((PROFILE_DIR / "sm90.json").read_text())


@pytest.fixture(scope="module")
def calls() -> list[AttentionParams]:
    return every_grid_call()


@pytest.mark.parametrize("model", [COST_MODEL, CostModel(k=3), CostModel(tile=0, split_windows=False, min_own=5),
                                   CostModel(use_split=False),
                                   CostModel(host_k=4, host_scale=1.3, split_combine=3.0, unsplit_gpu_bound_ms=0.0)],
                         ids=["shipped-model", "k3", "untiled-unsplit", "step-times-only", "other-split"])
def test_predictions_equal_the_plain_walk_bit_for_bit(shipped, calls, model):
    fast, plain = Profile(shipped, model=model), PlainProfile(shipped, model)
    assert len(calls) > 500 and {features(p)[0] for p in calls} >= {e["kind"] for e in plain.entries}
    compared = 0
    for n, params in enumerate(calls):
        # under the shipped model an eighth of the calls on every machine, the others on one each in turn; an
        # eighth of them otherwise (time: the calls grow with every grid)
        for machine in MACHINES if n % 8 == 0 else (MACHINES[n % 4 - 1],) if model == COST_MODEL else ():
            for leave_out in (False, True):
                got = fast.predict(params, machine=machine, leave_out=leave_out)
                times, shown, own, own_entries = plain.predict(params, machine, leave_out)
                assert got.times_ms == times and list(got.times_ms) == list(times), (params.describe(), machine)
                assert (got.neighbours, got.machine, got.own_entries) == (shown, own, own_entries)
                compared += bool(times)
    assert compared > len(calls) // 2  # most calls have measured neighbours


def random_profile(rng: random.Random) -> dict:
    """Entries at arbitrary (not 4-decimal) log2 sizes, so that the order of a distance's additions shows in its
    last bits, on two machines, with some providers missing and some duplicated shapes (ties of distance)."""
    kinds = [[True, "causal", False], [False, "causal", False], [True, "none", True],
             [True, "window two-sided", False]]
    entries = []
    for i in range(300):
        kind = rng.choice(kinds)
        log2 = {"d_qk": rng.choice([6, 7, 8]) + rng.random() / 3, "d_v": rng.uniform(6, 8), "sq": rng.uniform(7, 15),
                "skv": rng.uniform(7, 15), "span": rng.uniform(7, 15), "bh": rng.uniform(4, 10),
                "gqa": rng.uniform(0, 3)}
        times = {p: rng.uniform(0.02, 20) for p in ("x:a", "x:b", "y:c") if rng.random() < 0.8} or {"x:a": 1.0}
        entry = {"label": f"e{i}", "machine": rng.randrange(2), "kind": kind, "log2": log2,
                 "fmt": rng.choice(["bshd", "sbhd"]), "work": rng.uniform(1e8, 1e13), "times_ms": times}
        if kind[1] == "window two-sided":  # the call without its window: more work
            entry["work_unwindowed"] = entry["work"] * rng.uniform(1.0, 20.0)
        split = [p for p in times if p != "y:c" and rng.random() < 0.7]  # y:c never split: step times alone
        if split:
            entry["host_ms"] = {p: rng.uniform(0.02, 1.0) for p in split}
            entry["gpu_ms"] = {p: rng.uniform(0.01, 1.0) * times[p] for p in split}
        entries.append(entry)
        if rng.random() < 0.2:  # the same call measured on the other machine
            entries.append({**entry, "label": f"e{i}'", "machine": 1 - entry["machine"],
                            "times_ms": {p: t * rng.uniform(0.8, 1.2) for p, t in times.items()}})
    return {"arch": "sm90", "machines": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"], "entries": entries}


def test_predictions_equal_the_plain_walk_on_a_random_profile(calls):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data = random_profile(rng)
    uneven = (4.1, 1.7, 0.53, 0.29, 1.3, 0.9, 2.2)  # weights that round: the additions' order shows in the sums
    for model in (CostModel(k=3, min_own=40, weights=uneven, unwindowed_backward=("x:a",)),
                  CostModel(k=1, min_own=1000, unwindowed_backward=("x:a", "y:c"))):
        fast, plain = Profile(data, model=model), PlainProfile(data, model)
        for params in rng.sample(calls, 150):
            for machine in MACHINES:
                got = fast.predict(params, machine=machine)
                times, shown, own, own_entries = plain.predict(params, machine, False)
                assert (got.times_ms, got.neighbours, got.machine) == (times, shown, own), (seed, params.describe())
            # the distances themselves (a last-bit difference in one seldom shows in the times)
            kind, log2, fmt = features(params, model)
            here = tuple(log2[f] for f in FEATURES)
            for (of_kind, _, _), near in fast._neighbours.items():
                if of_kind == kind:
                    assert near.distances(here, fmt, model) == [
                        plain_distance(model, here, e.sizes, e.fmt, fmt) for e in near.entries], seed
