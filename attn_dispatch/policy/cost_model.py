"""What a call costs to the performance profile (policy/profile.py): the model's settings (CostModel) and the
call's description in its terms.

- features(): the kind of call (training or inference; causal, a causal window, a two-sided window or neither;
  packed/padded or dense; a KV-cache step; modifiers()) and its log2 sizes (head dims, query and key lengths, the key
  span a window leaves, batch x heads, GQA ratio) and memory format: what the nearest measured call is chosen by.
- work(): its matmul flops counted in the 128 x 128 tiles of the score matrix a tiled kernel computes (a 257-key band
  costs 3 key tiles per query tile, not 2); a packed (thd) call counts its own sequences' share (packed_share).
- dense_twin() and packed_gpu_factor(): a packed call as its dense twin (every sequence the longest) and the factor
  on the twin's GPU time (the pack's share of the work x the engine's varlen factor).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..params import PACKED_TILE, TOP_LEFT_MASKS, AttentionParams, is_bottom_right, is_causal, score_tiles
from .timing import BACKWARD_FLOP_FACTOR, attended_pairs, attention_flops, band_sum, mode_of

FEATURES = ("d_qk", "d_v", "sq", "skv", "span", "bh", "gqa")


@dataclass(frozen=True)
class CostModel:
    """The model's settings, chosen by leave-one-out and leave-one-grid-out over every measured run
    (benchmarks/evaluate_profile.py --protocols; benchmarks/results/README.md has the numbers)."""

    # Distance per log2 unit (a doubling) of each size (FEATURES order); and for a different memory format.
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
    # An entry that did not split a provider's step still gives a GPU rate where its step took at least this (ms):
    # the host enqueues ahead of a GPU-bound step, so the step is its GPU time. Without it, calls measured without a
    # split inform nothing the split entries cover (a packed d96 unmasked training step read flash-attn-4 off a d80
    # encoder at 1.9x its measured time). Chosen by leaving each packed grid out in turn: 4-7 ms scored alike, 2 ms
    # worse (short steps are partly host); benchmarks/results/README.md gives the scores.
    unsplit_gpu_bound_ms: float = 5.0
    # Providers whose backward computes every key tile under a two-sided window (right bound > 0): their training
    # work is the forward's windowed tiles plus the backward's unwindowed ones. cuDNN 9.19's GPU rate over the windowed
    # work fell with the window's cover, over this work it held (25 two-sided training calls of the split fit).
    unwindowed_backward: tuple[str, ...] = ("cudnn_fused:frontend",)
    # A packed (thd) call's work counts its own sequences (AttentionParams.packed_fill; under a window
    # packed_window_fill), in proportion: a power of the fill over-predicted the first packed
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
    # ("provider@machine", head dim, factor): a further factor on a provider's varlen forward under a window at that
    # head dim on that machine. On the H200 flash-attn-4's d128 varlen forward loses more to a window than cuDNN's
    # (over its dense twin 0.84-0.95 against 0.78-0.83; results/profile/windowed_varlen_forward_d128_h200_full). Chosen
    # by leaving each packed grid out in turn; other head dims and the H100 have no such measurement
    # (benchmarks/results/README.md gives the scores).
    windowed_varlen_forward: tuple[tuple[str, int, float], ...] = (("flash_attn_4:cute@NVIDIA H200", 128, 1.2),)
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
    # On a packed call, a provider predicted relative to others is taken as this much slower than its reading: it is
    # picked only where it reads clearly faster. Flex's packed times scatter with its compile history and its reading
    # rests on three neighbours; a wrong flex pick cost up to 1.8x, a missed one 1.05-1.2x. Chosen by leaving each
    # packed grid out in turn (benchmarks/results/README.md gives the scores of 1.03-1.08).
    relative_packed_margin: float = 1.05
    # Providers never given a rate: FlexAttention's block-mask kernels cost, over a tiled engine, what the window and
    # block structure make them, more than any work count follows. Rated off one dense window grid, flex was picked on
    # a held-out grid's full-stack windowed calls at up to 1.66x the fastest.
    relative_only: tuple[str, ...] = ("flex_attention:torch", "flex_attention:flash_attn_4")
    # The dense kinds of call whose measured relative_only times a dense call reads: windowed ones, where flex is an
    # engine a call may need. On unmasked and causal calls the tiled engines run the same kernels without a mask
    # function; there flex's times, measured at 2k-16k tokens, read it 0.8x cuDNN's time on 256-token encoders
    # and moved 93 shipped picks to it.
    relative_dense_kinds: tuple[str, ...] = ("window", "window two-sided")


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
    """The share of a packed call's full-length work its own sequences make: packed_fill, and under a window
    packed_window_fill (its tiles under the window); where that is not known, at most packed_token_fill of the
    windowed work (a band costs per token what the longest's does, or less). Without known lengths, the expected
    fills of the packs the profile measured (measured_pack_fills)."""
    if p.has_sliding_window and p.packed_window_fill is not None:
        return p.packed_window_fill
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
                     packed_fill=None, packed_token_fill=None, packed_window_fill=None, pad_between_seqs=False,
                     seqlens_differ=False)


def without_window(p: AttentionParams) -> AttentionParams:
    return p.replace(window_size=(-1, 0) if p.is_causal else (-1, -1))


def packed_gpu_factor(provider: str, p: AttentionParams, model: CostModel = COST_MODEL,
                      machine: str | None = None) -> float:
    """A packed call's GPU time over its dense twin's, for the provider: the pack's share of the provider's work
    (provider_work: a backward that skips no window tile counts the unwindowed share) x its varlen factor (x the
    machine's, where it has one; a windowed forward x the machine's model.windowed_varlen_forward, where it has one)."""
    def provider_work_of(call: AttentionParams) -> float:
        windowed = work(call, model)
        unwindowed = unwindowed_work(call, model) if two_sided_training(call) else windowed
        return provider_work(provider, windowed, unwindowed, model)

    return (provider_work_of(p) / provider_work_of(dense_twin(p)) * varlen_factor(provider, machine, model)
            * windowed_varlen_factor(provider, p, machine, model))


def windowed_varlen_factor(provider: str, p: AttentionParams, machine: str | None,
                           model: CostModel = COST_MODEL) -> float:
    """The further factor on the provider's varlen forward under a window at the call's head dim, on the machine
    (model.windowed_varlen_forward); 1 elsewhere."""
    if not p.has_sliding_window or p.is_training or not machine:
        return 1.0
    key = (f"{provider}@{machine}", p.head_dim_qk)
    return next((f for named, d, f in model.windowed_varlen_forward if (named, d) == key), 1.0)


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
