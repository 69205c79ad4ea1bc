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
window): G is the twin's GPU time x the pack's share of the work (packed_fill) x the engine's varlen factor, and H
is the packed calls' host time (Profile.parts; CostModel.packed_twin says why).
A provider no profile-source run timed on a plain call (FlexAttention's) has no rate; on a packed call it is
predicted relative to the providers the decision compares, from the profile's `packed` entries (the packed fit grids,
every provider forced): its time over theirs on the nearest measured packed calls of the same kind and head dims, x
their predicted times (Profile.relative). A dense call gets no prediction for it.
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

from ..params import (PACKED_TILE, TOP_LEFT_MASKS, AttentionParams, is_bottom_right, is_causal, packed_fills,
                      score_tiles)
from ..platform import Platform
from .timing import BACKWARD_FLOP_FACTOR, attended_pairs, attention_flops, band_sum, mode_of

PROFILE_DIR = Path(__file__).with_name("profiles")
_FEATURES = ("d_qk", "d_v", "sq", "skv", "span", "bh", "gqa")


@dataclass(frozen=True)
class CostModel:
    """The model's settings, chosen by leave-one-out and leave-one-grid-out over every measured run
    (benchmarks/evaluate_profile.py --protocols; benchmarks/results/README.md has the numbers)."""

    # Distance per log2 unit (a doubling) of each size (_FEATURES order); and for a different memory format.
    weights: tuple[float, ...] = (4.0, 2.0, 0.5, 0.25, 1.0, 1.0, 2.0)
    format_mismatch: float = 1.5
    k: int = 1              # neighbours per provider (K > 1 averages log rates, weighted by 1 / (distance + 0.25))
    combine: float = 8.0    # t = (H^p + G^p)^(1/p): close to max(H, G), smooth where they meet
    min_own: int = 20       # a machine's own entries of a kind needed to predict from them alone
    # A neighbour that cost less than host_bound x its host floor hides its GPU time (the smooth max attributes
    # most of a near-floor time to the GPU): it gives no rate to a call of more work than its own.
    host_bound: float = 3.0
    tile: int = 128         # work counted in tile x tile blocks of the score matrix (0: attended pairs)
    split_windows: bool = True  # causal windows (right bound 0) and two-sided ones as different kinds of call
    # The host floor: the (r + 1)-th least time of a provider on calls of that kind, r = min(floor_rank, calls // 10):
    # one timer outlier (a measured training step faster than the same call's forward) otherwise sets the floor of
    # every call.
    floor_rank: int = 3
    # Where entries hold a provider's step measured apart as host and GPU time (bench_user_step.py --split), those
    # predict it instead: G from the nearest split entry's GPU rate, H the median host time of the host_k nearest,
    # times host_scale (the hosts that time a user's step differ from the one the split was measured on), and
    # t = (H^p + G^p)^(1/p) with p = split_combine.
    use_split: bool = True
    host_k: int = 25
    # The split lease's host was slower than the hosts that ran the block-timer blind grids: their host-bound steps
    # cost 0.6-1.5x the split's host time by lease (median 0.88). 0.8 was the best of 0.5-1.0 over three held-out
    # grids' 720 rows (benchmarks/results/README.md).
    host_scale: float = 0.8
    split_combine: float = 4.0
    # A split neighbour whose GPU time is under this (ms; fixed launch latency dominates it) gives no rate to a call
    # of more work than its own.
    min_rate_gpu_ms: float = 0.1
    # Providers whose backward computes every key tile under a two-sided window (right bound > 0): their training
    # work is the forward's windowed tiles plus the backward's unwindowed ones. cuDNN 9.19's GPU rate over the windowed
    # work fell with the window's cover, over this work it held (25 two-sided training calls of the split fit).
    unwindowed_backward: tuple[str, ...] = ("cudnn_fused:frontend",)
    # A packed (thd) call's work counts its own sequences (AttentionParams.packed_fill; under a window at most
    # packed_token_fill of the longest's band), in proportion: a power of the fill over-predicted the first packed
    # grid's steps by 5-21%. Without known lengths, the measured packs' expected fill.
    packed_lengths: bool = True
    # A packed call's GPU time is its dense twin's (dense_twin: the dense rates cover every head dim and window) x its
    # share of the provider's work x the provider's varlen_factor; its host time is the packed calls' (Profile.parts).
    # Leave-one-out over 102 split packed calls, this cut the GPU time's rms log error from 0.15-0.20 to 0.11-0.13.
    packed_twin: bool = True
    # Each engine's varlen kernel over its dense one: measured packed GPU time over the twin's prediction x the work's
    # share (medians over the H100's packed splits; benchmarks/fit_packed.py). Others: 1.
    varlen_factor: tuple[tuple[str, float], ...] = (("cudnn_fused:frontend", 1.13), ("flash_attn_2:torch", 1.05),
                                                    ("flash_attn_4:cute", 1.08))
    # Per machine ("provider@device name"), a factor on varlen_factor: the H200's first packed grids sat off the
    # H100-fitted factors (medians over rows well above the host time), and picks within ~10% moved with them.
    # Refitted on later grids they moved no measured pick, so these stay.
    machine_varlen_factor: tuple[tuple[str, float], ...] = (("cudnn_fused:frontend@NVIDIA H200", 1.04),
                                                            ("flash_attn_2:torch@NVIDIA H200", 1.06),
                                                            ("flash_attn_4:cute@NVIDIA H200", 0.97))
    # A rate read off another machine's entry is put on the asked machine's scale by the provider's speed ratio
    # between the two (machine_shifts: the median log ratio over dense calls both timed, of one pass and head dim, each
    # at least machine_pair_ms; at least machine_pairs of them; under machine_shift_min taken as none, run-to-run
    # clock noise). Engines do not gain alike from the H100 to the H200 (flash-attn-4's d256 training 0.86x, cuDNN's
    # 0.98x), and the H200 has too few entries of most kinds to predict from its own.
    machine_shift: bool = True
    machine_pairs: int = 2
    machine_pair_ms: float = 1.0
    machine_shift_min: float = 0.05
    # A provider without a rate (relative_only) is predicted relative to the providers the decision compares, off the
    # relative_k nearest measured calls of the call's kind and head dims that timed it and some of them (a packed call:
    # the packed fit grids' entries; a dense call: the dense entries), else not at all. Flex's time over FA2's ranged
    # 0.84-6.6x over the packed grids, with head dims, pass, mask and sequence lengths; near calls agreed. One or two
    # calls sent packs to flex at 1.25-2.8x; three kept or improved every pick, each packed grid left out in turn.
    relative_k: int = 3
    # On a packed call, each neighbour's ratio is moved to the call's mean sequence length (packed_mean_length) along
    # the slope the packed entries show (Profile.relative_slope): flex runs a pack as one sequence under a document
    # mask, so short documents cut many blocks in part (its time over FA2's fell 0.06-0.09 in log per doubling). Never
    # past the longest mean length measured of that kind and head dims: no pack says flex keeps gaining beyond it.
    relative_length_slope: bool = True
    # Providers never given a rate: FlexAttention's block-mask kernels cost, over a tiled engine, what the window and
    # block structure make them, more than any work count follows. Rated off one dense window grid, flex was picked on
    # a held-out grid's full-stack windowed calls at up to 1.66x the fastest.
    relative_only: tuple[str, ...] = ("flex_attention:torch", "flex_attention:flash_attn_4")


COST_MODEL = CostModel()


def modifiers(p: AttentionParams) -> tuple[str, ...]:
    """What the call does to the scores (or to the kernels that compute them) beyond its mask type and window: none
    of the rate model's rows (bench_user_step.py grids: plain masks and windows, bf16) did any of it, and each
    changes an engine's kernel and cost (a tanh per score for softcap, a bias read per score, a block mask built
    from an arbitrary mask or a mask_mod, a function per score, an RNG per score for dropout, an ordered
    accumulation in a deterministic backward, other kernels for fp8 or float32). float16 is taken as bfloat16 (the
    same kernels at the same tensor-core rate); return_max_logit adds only the row max every kernel keeps, and a
    sink softmax (off-by-one, learnable) one logit per row, not per score: the plain rows predict both."""
    found = []
    if p.attn_mask_type == "arbitrary":
        found.append("an arbitrary mask")
    if p.mask_mod:
        found.append("a mask_mod")
    if p.bias_type != "no_bias":
        found.append({"alibi": "ALiBi", "pre_scale_bias": "a pre-scale bias"}.get(p.bias_type, "a post-scale bias"))
    if p.softcap:
        found.append("softcap")
    if p.score_mod:
        found.append("a score_mod")
    if p.dropout:
        found.append("dropout")
    if p.deterministic and p.is_training:
        found.append("a deterministic backward")
    if p.fp8 or p.dtype not in ("bfloat16", "float16"):
        found.append("fp8" if p.fp8 else p.dtype)
    return tuple(found)


def features(p: AttentionParams, model: CostModel = COST_MODEL) -> tuple[tuple, dict[str, float], str]:
    """(kind, log2 sizes, memory format) of a call, as the profile compares calls. A call with modifiers() has them
    last in its kind (joined by ' and '): only calls with the same ones are of its kind."""
    left, right = p.window_size
    span = p.max_seqlen_kv
    if p.has_sliding_window and left >= 0:
        span = min(span, left + (right if right >= 0 else 0) + 1)
    mask = "window" if p.has_sliding_window else ("causal" if p.is_causal else "none")
    if mask == "window" and model.split_windows and right != 0:
        mask = "window two-sided"
    kind = (p.is_training, mask, p.has_padding)
    if p.inference_kv_cache:  # a decode/prefill step over a cache: compared only with measured cache steps
        kind += ("kv-cache paged" if p.kv_cache_paged else "kv-cache",)
    modified = modifiers(p)
    if modified:
        kind += (" and ".join(modified),)
    log2 = {"d_qk": math.log2(p.head_dim_qk), "d_v": math.log2(p.head_dim_v), "sq": math.log2(p.max_seqlen_q),
            "skv": math.log2(p.max_seqlen_kv), "span": math.log2(max(1, span)),
            "bh": math.log2(p.batch_size * p.num_heads), "gqa": math.log2(p.gqa_ratio)}
    fmt = "sbhd" if p.qkv_format == "sbhd" else "bshd"
    return kind, log2, fmt


def work(p: AttentionParams, model: CostModel = COST_MODEL) -> float:
    """The call's matmul flops: the unit rates are kept in. With model.tile, the score matrix is counted in
    tile x tile blocks that hold an attended pair (what a tiled kernel computes: a 257-key band costs 3 key tiles
    of 128 per query tile). A packed call counts its own sequences' share of the full-length work (packed_share)."""
    nominal = _nominal_work(p, model)
    if p.qkv_format != "thd" or not model.packed_lengths:
        return nominal
    return nominal * packed_share(p, model)


def _nominal_work(p: AttentionParams, model: CostModel) -> float:
    """work() at full length: every sequence max_seqlen long."""
    pairs = attended_pairs(p)
    flops = attention_flops(p, mode_of(p), pairs)
    if not model.tile:
        return flops
    return flops * tiled_pairs(p, model.tile) / max(1, pairs)


def packed_share(p: AttentionParams, model: CostModel = COST_MODEL) -> float:
    """The share of a packed call's full-length work its own sequences make: packed_fill, and under a window at
    most packed_token_fill of the windowed work (a band costs per token what the longest's does, or less). Without
    known lengths, the expected fills of the packs the profile measured (measured_pack_fills)."""
    fill, tokens = p.packed_fill, p.packed_token_fill
    if fill is None or tokens is None:
        fill, tokens = measured_pack_fills(p.batch_size, p.max_seqlen_q, p.max_seqlen_kv, p.attn_mask_type,
                                           model.tile or PACKED_TILE)
    if not p.has_sliding_window:
        return min(fill, tokens)
    windowed = _nominal_work(p, model)
    full = _nominal_work(p.replace(window_size=(-1, 0) if p.is_causal else (-1, -1)), model)
    return min(full * fill, windowed * tokens) / windowed


@lru_cache(maxsize=4096)
def measured_pack_fills(batch: int, max_q: int, max_kv: int, mask_type: str, tile: int) -> tuple[float, float]:
    """(packed_fill, packed_token_fill) expected of the packs the profile's runs measured (bench_user_step.py: the
    first sequence max_q long, each other uniform in [max_q // 2, max_q], keys as many as queries): not bucketed."""
    causal, bottom_right = is_causal(mask_type), is_bottom_right(mask_type)
    low = max(1, max_q // 2)

    def tiles(n_q: int) -> int:
        return score_tiles(n_q, max(1, round(n_q * max_kv / max_q)), causal, bottom_right, tile)

    # the mean tiles of a length uniform in [low, max_q]: lengths in one tile count share it
    total, count = 0, 0
    for n in range(-(-low // tile), -(-max_q // tile) + 1):
        first, last = max(low, (n - 1) * tile + 1), min(max_q, n * tile)
        total += (last - first + 1) * tiles(last)
        count += last - first + 1
    longest = tiles(max_q)
    fill = (longest + (batch - 1) * total / count) / (batch * longest)
    tokens = (max_q + (batch - 1) * (low + max_q) / 2) / (batch * max_q)
    return fill, tokens


def packed_mean_length(p: AttentionParams, model: CostModel = COST_MODEL) -> float:
    """A packed call's mean query tokens per sequence: its token fill (packed_token_fill) x the longest; without
    known lengths, the measured packs' expected token fill (measured_pack_fills)."""
    tokens = p.packed_token_fill
    if tokens is None:
        tokens = measured_pack_fills(p.batch_size, p.max_seqlen_q, p.max_seqlen_kv, p.attn_mask_type,
                                     model.tile or PACKED_TILE)[1]
    return tokens * p.max_seqlen_q


_DENSE_MASK = {"padding": "no_mask", "padding_causal": "causal", "padding_causal_bottom_right": "causal_bottom_right"}


def dense_twin(p: AttentionParams) -> AttentionParams:
    """A packed call as a dense one: batch_size sequences of the longest length, the same mask (without padding),
    window, heads and dims."""
    return p.replace(qkv_format="bshd", attn_mask_type=_DENSE_MASK.get(p.attn_mask_type, p.attn_mask_type),
                     packed_fill=None, packed_token_fill=None, pad_between_seqs=False, seqlens_differ=False)


def without_window(p: AttentionParams) -> AttentionParams:
    return p.replace(window_size=(-1, 0) if p.is_causal else (-1, -1))


def packed_gpu_factor(provider: str, p: AttentionParams, model: CostModel = COST_MODEL,
                      machine: str | None = None) -> float:
    """A packed call's GPU time over its dense twin's, for the provider: the pack's share of the provider's work
    (provider_work: a backward that skips no window tile counts the unwindowed share) x its varlen factor (x the
    machine's, where it has one)."""
    twin = dense_twin(p)
    packed = provider_work(provider, work(p, model), unwindowed_work(p, model) if two_sided_training(p) else
                           work(p, model), model)
    dense = provider_work(provider, work(twin, model), unwindowed_work(twin, model) if two_sided_training(twin) else
                          work(twin, model), model)
    return packed / dense * varlen_factor(provider, machine, model)


def varlen_factor(provider: str, machine: str | None, model: CostModel = COST_MODEL) -> float:
    """The provider's varlen kernel over its dense one (model.varlen_factor), on the machine (machine_varlen_factor)."""
    found = dict(model.varlen_factor).get(provider, 1.0)
    if machine:
        found *= dict(model.machine_varlen_factor).get(f"{provider}@{machine}", 1.0)
    return found


def two_sided_training(p: AttentionParams) -> bool:
    """A training call under a window with a right bound (the keys after the query are limited too)."""
    return p.is_training and p.has_sliding_window and p.window_size[1] != 0


def unwindowed_work(p: AttentionParams, model: CostModel = COST_MODEL) -> float:
    """work() of the call without its window (its mask kept)."""
    return work(p.replace(window_size=(-1, 0) if p.is_causal else (-1, -1)), model)


def provider_work(provider: str, windowed: float, unwindowed: float, model: CostModel = COST_MODEL) -> float:
    """The work a provider does on a call of work() `windowed` and unwindowed_work() `unwindowed` (equal unless the
    call trains under a two-sided window): model.unwindowed_backward's providers skip no tile in the backward."""
    if provider not in model.unwindowed_backward or unwindowed == windowed:
        return windowed
    return (windowed + BACKWARD_FLOP_FACTOR * unwindowed) / (1.0 + BACKWARD_FLOP_FACTOR)


def tiled_pairs(p: AttentionParams, tile: int) -> int:
    """(query, key) pairs of the tile x tile blocks that hold at least one attended pair, in closed form."""
    sq, skv = p.max_seqlen_q, p.max_seqlen_kv
    left, right = p.window_size
    nq, nk = -(-sq // tile), -(-skv // tile)
    if left < 0 and right < 0:
        return nq * nk * tile * tile
    offset = 0 if p.attn_mask_type in TOP_LEFT_MASKS else skv - sq
    far = 1 << 40
    c_hi = offset + right if right >= 0 else far  # query row i sees keys up to i + c_hi, from i + c_lo
    c_lo = offset - left if left >= 0 else -far

    def key_tiles(i: int) -> int:  # query tile i, rows [i * tile, min(sq, (i + 1) * tile) - 1]
        hi = min(skv - 1, min(sq - 1, (i + 1) * tile - 1) + c_hi)
        lo = max(0, i * tile + c_lo)
        return max(0, hi // tile - lo // tile + 1) if hi >= lo else 0

    # Full query tiles whose rows see any key (the last row's window reaches key 0, the first row's is not past
    # the last key) see key tiles max(0, i + b) .. min(nk - 1, i + a): sum that band in closed form.
    a = (tile - 1 + c_hi) // tile if c_hi < far else far
    b = c_lo // tile if c_lo > -far else -far
    first = max(0, -((tile - 1 + c_hi) // tile)) if c_hi < far else 0  # (i + 1) * tile - 1 + c_hi >= 0
    last = min(nq - 2, (skv - 1 - c_lo) // tile if c_lo > -far else nq - 2)  # i * tile + c_lo <= skv - 1
    total = band_sum(first, last + 1, nk, a, b) if last >= first else 0
    return (total + key_tiles(nq - 1)) * tile * tile


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
        return self.sizes[_FEATURES.index("sq")] <= 0.0

    def distance(self, p: AttentionParams, model: CostModel = COST_MODEL) -> float:
        """The rate model's distance from a call: weighted log2 sizes, and the format penalty."""
        _, log2, fmt = features(p, model)
        return (sum(w * abs(log2[f] - v) for w, f, v in zip(model.weights, _FEATURES, self.sizes))
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
        values = tuple(tuple(sorted({e.sizes[f] for e in entries})) for f in range(len(_FEATURES)))
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
                       tuple(e["log2"][f] for f in _FEATURES), e["fmt"], e["times_ms"], e.get("runs", 1))
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
        sizes = tuple(e["log2"][f] for f in _FEATURES)
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
        `among`, its time over each of those there (the geometric mean), moved to the call's mean sequence length
        (relative_slope, with model.relative_length_slope; at most to the longest mean length of those entries), x
        that provider's predicted time here; averaged in log, weighted 1 / (distance + 0.25) as the rate model weights
        its neighbours. Fewer than relative_k such entries: none. leave_out leaves the call's own shape out (of the
        slope's fit too)."""
        m = self.model
        references = [p for p in among if p in predicted]
        missing = [p for p in among if p not in predicted]
        if not references or not missing or m.relative_k < 1:
            return {}
        kind, log2, fmt = features(params, m)
        here = tuple(log2[f] for f in _FEATURES)
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
                logs.append(sum(math.log(predicted[r] * e.times_ms[provider] / e.times_ms[r]) + shift
                                for r, shift in zip(shared, moved)) / len(shared))
                weights.append(1.0 / (dist + 0.25))
            ms = math.exp(sum(w * lg for w, lg in zip(weights, logs)) / sum(weights))
            out[provider] = (ms, tuple(e.label + ("" if len(self.machines) < 2 else f" ({e.machine})")
                                       for _, e in used))
        return out

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
        here = tuple(log2[f] for f in _FEATURES)
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
                continue
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


# --- building a profile from measured runs ---------------------------------------------------------------

def _provider_times(row: dict) -> dict[str, float]:
    return {n: t for n, t in row.get("times_ms", {}).items() if ":" in n}  # SDPA, policy columns left out


def combine_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    """One call's provider times from several runs (other stacks' too: a stock-torch run times torch's providers
    only): each run is scaled onto the one with the most providers by the median ratio over the providers both
    timed (two runs' clocks differ by a few percent), then each provider's time is the median over the runs."""
    reference = max(runs, key=len)
    scaled = [reference]
    for run in runs:
        if run is reference:
            continue
        shared = [p for p in run if p in reference]
        if not shared:
            continue
        scale = statistics.median(reference[p] / run[p] for p in shared)
        scaled.append({p: t * scale for p, t in run.items()})
    providers = sorted({p for run in scaled for p in run})
    return {p: statistics.median(run[p] for run in scaled if p in run) for p in providers}


def group_runs(runs: list[dict]) -> dict[tuple[str, str], tuple[str, dict, list[dict[str, float]]]]:
    """Rows of bench_user_step.py runs ({"machine": device name, "rows": its rows}) by (machine, call parameters):
    (the first row's label, the parameters, each run's provider times). The calls a run with "replaces" set
    measured on its machine take their times from such runs alone (a re-measure after an engine's path changed).
    A call no run timed interleaved on its machine takes the steps a split run measured (--split-only: each
    provider's step in a steady block of its own calls, the block timer's measure)."""
    grouped: dict[tuple[str, str], tuple[str, dict, list[dict[str, float]]]] = {}
    replaced = {(run["machine"], _call_key(row["params"])) for run in runs if run.get("replaces")
                for row in run["rows"] if _provider_times(row)}
    split_only = []  # (key, row, its steps) of split rows: used where no run timed the call
    for run in runs:
        for row in run["rows"]:
            times = _provider_times(row)
            key = (run["machine"], _call_key(row["params"]))
            if times and (run.get("replaces") or key not in replaced):
                grouped.setdefault(key, (row["label"], row["params"], []))[2].append(times)
            elif not times and row.get("split"):
                split_only.append((key, row, {n: s["step_ms"] for n, s in row["split"].items() if ":" in n}))
    timed = set(grouped)
    for key, row, steps in split_only:
        if steps and key not in timed:
            grouped.setdefault(key, (row["label"], row["params"], []))[2].append(steps)
    return grouped


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
    return entries


def _with_fills(run: dict) -> dict:
    """The run with each packed row's fills in its parameters, read from its case's lengths where the row has none
    (the first packed grid's rows were recorded before calls carried them)."""
    rows = []
    for row in run["rows"]:
        params, lengths = row["params"], tuple((row.get("case") or {}).get("seqlens") or ())
        if params.get("qkv_format") == "thd" and params.get("packed_token_fill") is None and lengths:
            fill, tokens = packed_fills(lengths, lengths, params["max_seqlen_q"], params["max_seqlen_kv"],
                                        params["attn_mask_type"])
            row = {**row, "params": {**params, "packed_fill": fill, "packed_token_fill": tokens}}
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
