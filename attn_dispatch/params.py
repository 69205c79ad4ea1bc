"""AttentionParams: everything a constraint may look at, for one attention call.

Frozen and hashable with a precomputed hash, so that it can key the decision cache cheaply.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

QKV_FORMATS = ("bshd", "sbhd", "thd")
MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "causal_bottom_right",
    "padding_causal",
    "padding_causal_bottom_right",
    "arbitrary",
)
# Transformer Engine aligns these masks' diagonal top-left (query i sees key i); every other causal mask bottom-right
TOP_LEFT_MASKS = ("causal", "padding_causal")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
BIAS_SHAPES = ("1hss", "b1ss", "bhss", "11ss")
ALIBI_SLOPE_SHAPES = ("h", "bh")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
DEVICE_TYPES = ("cuda", "cpu")
FP8_RECIPES = ("delayed", "current")
DTYPES = ("float16", "bfloat16", "float32", "float64", "fp8")
DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float": "float32", "float32": "float32",
    "fp64": "float64", "double": "float64", "float64": "float64",
    "fp8": "fp8", "float8": "fp8",
}
UNBOUNDED = -1
# A packed call's own tokens per sequence, (queries, keys), where the host knows them (read from cu_seqlens)
SeqLengths = tuple[tuple[int, ...], tuple[int, ...]]


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {', '.join(map(repr, allowed))}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def canonical_dtype(dtype: Any) -> str:
    """'bf16', 'bfloat16' or torch.bfloat16 -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8"):
        return "fp8"
    if name not in DTYPE_ALIASES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {', '.join(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[name]


def is_causal(mask_type: str) -> bool:
    return "causal" in mask_type


def is_bottom_right(mask_type: str) -> bool:
    return mask_type.endswith("bottom_right")


def has_padding(mask_type: str) -> bool:
    return mask_type.startswith("padding")


def plain_window(mask_type: str) -> tuple[int, int]:
    """The window the mask type alone gives: (-1, 0) causal, (-1, -1) otherwise."""
    return (UNBOUNDED, 0) if is_causal(mask_type) else (UNBOUNDED, UNBOUNDED)


def normalize_window(window_size: tuple[int, int] | None, mask_type: str) -> tuple[int, int]:
    """Transformer Engine's convention: (left, right), -1 unbounded; causal forces right = 0."""
    if window_size is None:
        window = (UNBOUNDED, UNBOUNDED)
    else:
        if len(window_size) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
            raise ValueError(f"window_size={window_size!r} must be a pair of ints (left, right), -1 meaning unbounded")
        window = (int(window_size[0]), int(window_size[1]))
        for side, w in zip(("left", "right"), window):
            if w < UNBOUNDED:
                raise ValueError(f"window_size={window_size!r}: {side}={w} must be >= 0, or -1 for unbounded")
    if is_causal(mask_type):
        if window[1] not in (0, UNBOUNDED):
            raise ValueError(
                f"window_size={window_size!r} with attn_mask_type={mask_type!r}: a causal mask needs right=0 or -1"
            )
        window = (window[0], 0)
    return window


@dataclass(frozen=True, eq=True)
class AttentionParams:
    """One attention call, described. Build it with keywords; unknown values raise ValueError."""

    dtype: str = "bfloat16"
    qkv_format: str = "bshd"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int | None = None  # kv heads; None means num_heads (MHA)
    head_dim_qk: int = 128
    head_dim_v: int | None = None  # None means head_dim_qk
    max_seqlen_q: int = 1024
    max_seqlen_kv: int | None = None  # None means max_seqlen_q
    attn_mask_type: str = "no_mask"
    window_size: tuple[int, int] | None = None
    bias_type: str = "no_bias"
    bias_shape: str | None = None  # for pre/post_scale_bias
    bias_requires_grad: bool = False
    alibi_slopes_shape: str | None = None  # 'h' or 'bh' when bias_type == 'alibi'
    dropout: float = 0.0
    softmax_type: str = "vanilla"
    return_max_logit: bool = False
    is_training: bool = True
    deterministic: bool = False
    fp8: bool = False
    fp8_recipe: str | None = None     # with fp8: 'delayed' (DelayedScaling) or 'current' (Float8CurrentScaling)
    fp8_output: bool = False          # with fp8: the output stays in FP8 (fp8_output / recipe fp8_mha)
    cp_size: int = 1
    cp_comm_type: str = "p2p"
    cp_a2a_size: int | None = None  # a2a+p2p: ranks in the a2a group (None: 2)
    pad_between_seqs: bool = False
    # padding/thd: some sequence has a different number of query and key tokens (read from cu_seqlens), so a
    # top-left diagonal differs from a bottom-right one even where max_seqlen_q == max_seqlen_kv
    seqlens_differ: bool = False
    # thd, where the host read the lengths (cu_seqlens): the score tiles (PACKED_TILE square, the mask's causal half)
    # of the call's own sequences over batch_size x those of the longest, and its tokens over batch_size x the
    # longest, each rounded to a quarter octave (packed_fill_bucket) so that a training run whose lengths change
    # every step reuses its decisions. None: not known (the profile then assumes its measured packs' spread).
    packed_fill: float | None = None
    packed_token_fill: float | None = None
    # likewise under the call's window (None without one): a band's tiles, a short sequence's own causal half
    packed_window_fill: float | None = None
    inference_kv_cache: bool = False  # attends a KV cache (InferenceParams): q is the step's new tokens
    kv_cache_paged: bool = False      # the cache is a page pool with a page table
    kv_page_size: int | None = None   # tokens per page (paged) or per row (contiguous: max_sequence_length)
    device_type: str = "cuda"
    softcap: float = 0.0  # logit soft-capping (Gemma 2): scores -> softcap * tanh(scores / softcap); 0 is off
    # a user's own FlexAttention modifiers: mask_mod (b, h, q_idx, kv_idx) -> bool, ANDed with the call's mask, and
    # score_mod (score, b, h, q_idx, kv_idx) -> score, after the call's bias/ALiBi/softcap
    mask_mod: bool = False
    score_mod: bool = False
    # one of context parallelism's per-block calls (cp_size=1 itself): its backward is given the merged out/lse
    cp_block: bool = False
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "dtype", canonical_dtype(self.dtype))
        if self.num_gqa_groups is None:
            set_(self, "num_gqa_groups", self.num_heads)
        if self.head_dim_v is None:
            set_(self, "head_dim_v", self.head_dim_qk)
        if self.max_seqlen_kv is None:
            set_(self, "max_seqlen_kv", self.max_seqlen_q)
        if self.window_size is not None and not isinstance(self.window_size, tuple):
            set_(self, "window_size", tuple(self.window_size))
        self._validate()
        set_(self, "window_size", normalize_window(self.window_size, self.attn_mask_type))
        if self.bias_type == "alibi" and self.alibi_slopes_shape is None:
            set_(self, "alibi_slopes_shape", "h")
        set_(self, "_hash", hash(tuple(getattr(self, name) for name in _INIT_FIELDS)))  # astuple deep-copies

    def _validate(self) -> None:
        _choice("qkv_format", self.qkv_format, QKV_FORMATS)
        _choice("attn_mask_type", self.attn_mask_type, MASK_TYPES)
        _choice("core_attention_bias_type", self.bias_type, BIAS_TYPES)
        _choice("softmax_type", self.softmax_type, SOFTMAX_TYPES)
        _choice("cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        _choice("device_type", self.device_type, DEVICE_TYPES)
        for name in ("batch_size", "num_heads", "num_gqa_groups", "head_dim_qk", "head_dim_v",
                     "max_seqlen_q", "max_seqlen_kv", "cp_size"):
            _positive(name, getattr(self, name))
        if self.cp_a2a_size is not None:
            _positive("cp_a2a_size", self.cp_a2a_size)
            if self.cp_comm_type == "a2a+p2p" and self.cp_size % self.cp_a2a_size:
                raise ValueError(f"cp_a2a_size={self.cp_a2a_size} must divide cp_size={self.cp_size} "
                                 "(cp_size = a2a group size * p2p group size)")
        if self.fp8_recipe is not None:
            _choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        if (self.fp8_recipe is not None or self.fp8_output) and not self.fp8:
            raise ValueError("fp8_recipe / fp8_output describe an FP8 call: set fp8=True")
        if (self.kv_cache_paged or self.kv_page_size is not None) and not self.inference_kv_cache:
            raise ValueError("kv_cache_paged / kv_page_size describe a KV cache: set inference_kv_cache=True")
        if self.kv_page_size is not None:
            _positive("kv_page_size", self.kv_page_size)
        for name in ("packed_fill", "packed_token_fill", "packed_window_fill"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not 0.0 < value <= 1.0):
                raise ValueError(f"{name}={value!r} must be None (not known) or a fraction in (0, 1]")
        if self.num_heads % self.num_gqa_groups:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_gqa_groups={self.num_gqa_groups}; "
                "each kv head must serve a whole number of query heads"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if not isinstance(self.softcap, (int, float)) or isinstance(self.softcap, bool) or \
                not 0.0 <= self.softcap < float("inf"):
            raise ValueError(f"softcap={self.softcap!r} must be a finite float >= 0 (0 turns soft-capping off)")
        if self.bias_type in ("pre_scale_bias", "post_scale_bias"):
            _choice("bias_shape", self.bias_shape, BIAS_SHAPES)
        elif self.bias_shape is not None:
            raise ValueError(f"bias_shape={self.bias_shape!r} given with core_attention_bias_type={self.bias_type!r}")
        if self.bias_type == "alibi" and self.alibi_slopes_shape is not None:
            _choice("alibi_slopes_shape", self.alibi_slopes_shape, ALIBI_SLOPE_SHAPES)

    def __hash__(self) -> int:
        return self._hash

    # Derived facts the constraint tables ask for, named once here.
    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_gqa_groups

    @property
    def is_causal(self) -> bool:
        return is_causal(self.attn_mask_type)

    @property
    def is_bottom_right(self) -> bool:
        return is_bottom_right(self.attn_mask_type)

    @property
    def has_padding(self) -> bool:
        return has_padding(self.attn_mask_type) or self.qkv_format == "thd"

    @property
    def has_sliding_window(self) -> bool:
        """A window narrower than the mask type alone gives ((-1, 0) is plain causal)."""
        return self.window_size != plain_window(self.attn_mask_type)

    def without_idle_window(self) -> "AttentionParams":
        """This call with each window side that masks nothing at its lengths made unbounded, or self. A side of
        max(sq, skv) - 1 or more excludes no key under either diagonal alignment (padded and packed sequences are
        no longer than the maxima), so the result is exact; engines run a window slower than the plain mask
        (flash-attn-4: 1.38x cuDNN's time on a causal d64 s2048 forward with window (2048, 0), H100, a held-out grid).
        Plain calls only: under context parallelism the lengths are a rank's, and a KV cache's are buckets."""
        if self.cp_size > 1 or self.inference_kv_cache or not self.has_sliding_window:
            return self
        reach = max(self.max_seqlen_q, self.max_seqlen_kv) - 1
        left, right = (UNBOUNDED if side >= reach else side for side in self.window_size)
        if (left, right) == self.window_size:
            return self
        dropped = self.replace(window_size=(left, right))
        return dropped if dropped.has_sliding_window else dropped.replace(packed_window_fill=None)

    @property
    def a2a_size(self) -> int:
        """Ranks a context-parallel call splits heads over: cp_size for a2a, the a2a group for a2a+p2p."""
        if self.cp_comm_type == "a2a":
            return self.cp_size
        if self.cp_comm_type == "a2a+p2p":
            return self.cp_a2a_size or 2
        return 1

    @property
    def has_bias_tensor(self) -> bool:
        return self.bias_type in ("pre_scale_bias", "post_scale_bias")

    def replace(self, **changes: Any) -> "AttentionParams":
        values = {name: getattr(self, name) for name in _INIT_FIELDS}
        values.update(changes)
        return AttentionParams(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _INIT_FIELDS}  # a fresh decision asks twice

    def describe(self) -> str:
        """One line for logs and error messages."""
        shape = f"b={self.batch_size} sq={self.max_seqlen_q} skv={self.max_seqlen_kv} h={self.num_heads}"
        if self.num_gqa_groups != self.num_heads:
            shape += f" hkv={self.num_gqa_groups}"
        dims = f"d={self.head_dim_qk}" if self.head_dim_v == self.head_dim_qk else \
            f"d_qk={self.head_dim_qk} d_v={self.head_dim_v}"
        extras = [self.attn_mask_type]
        if self.window_size != (UNBOUNDED, UNBOUNDED) and self.window_size != (UNBOUNDED, 0):
            extras.append(f"window={self.window_size}")
        if self.bias_type != "no_bias":
            extras.append(self.bias_type + (f"[{self.bias_shape}]" if self.bias_shape else ""))
        if self.dropout:
            extras.append(f"dropout={self.dropout}")
        if self.softmax_type != "vanilla":
            extras.append(f"softmax={self.softmax_type}")
        if self.softcap:
            extras.append(f"softcap={self.softcap:g}")
        extras += [name for name in ("mask_mod", "score_mod") if getattr(self, name)]
        if self.cp_size > 1:
            extras.append(f"cp={self.cp_size}x{self.cp_comm_type}"
                          + (f"(a2a={self.a2a_size})" if self.cp_comm_type == "a2a+p2p" else ""))
        if self.fp8:
            extras.append("fp8" + (f"({self.fp8_recipe})" if self.fp8_recipe else "")
                          + (" fp8-output" if self.fp8_output else ""))
        if self.inference_kv_cache:
            extras.append(("paged" if self.kv_cache_paged else "contiguous") + " kv-cache"
                          + (f"(page={self.kv_page_size})" if self.kv_page_size else ""))
        if self.packed_fill is not None:
            extras.append(f"packed-fill={self.packed_fill:.3g}/tokens={self.packed_token_fill or 1.0:.3g}"
                          + (f"/windowed={self.packed_window_fill:.3g}" if self.packed_window_fill else ""))
        extras.append("training" if self.is_training else "inference")
        return f"{self.dtype} {self.qkv_format} {shape} {dims} {self.device_type} " + " ".join(extras)


# AttentionParams' constructor fields, listed once (dataclasses.fields() costs more than the copy that reads them)
_INIT_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionParams) if f.init)


def keyless_rows(mask_type: str, window: tuple[int, int], min_kv_minus_q: int, queries_without_keys: bool) -> bool:
    """Does some query row of some sequence see no key? Row i of a sequence with lq > 0 queries and lkv keys sees
    key j in [0, lkv) iff i + off - left <= j <= i + off + right (-1 unbounded; off = 0 for the top-left masks,
    lkv - lq otherwise: tests/reference.py). With lkv > 0 only the first row can fall off the right bound
    (off + right < 0: bottom-right) and only the last off the left one (lq - 1 - left > lkv - 1: top-left); both
    are decided by the smallest lkv - lq. window is normalised (causal masks have right = 0)."""
    if queries_without_keys:
        return True
    left, right = window
    if mask_type in TOP_LEFT_MASKS:
        return left >= 0 and min_kv_minus_q + left < 0
    return right >= 0 and min_kv_minus_q + right < 0


# Packed (thd) work is counted in square tiles of the score matrix, as tiled kernels compute it (a sequence of 33
# tokens costs one whole tile); the profile's model counts dense calls the same way (CostModel.tile).
PACKED_TILE = 128
# Fills are rounded to a quarter octave (2^(-k/4)), never below this.
MIN_PACKED_FILL = 2.0 ** -12


def packed_fill_bucket(fraction: float) -> float:
    """fraction in (0, 1] rounded to the nearest 2^(-k/4) (at most 9% off): many packs share one decision."""
    if fraction >= 1.0:
        return 1.0
    steps = round(-4.0 * math.log2(max(fraction, MIN_PACKED_FILL)))
    return 2.0 ** (-steps / 4.0)


def score_tiles(n_q: int, n_kv: int, causal: bool, bottom_right: bool, tile: int,
                window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)) -> int:
    """Score tiles a tiled kernel visits for one sequence of n_q queries and n_kv keys under the mask and window."""
    rows, cols = -(-n_q // tile), -(-n_kv // tile)
    if window != (UNBOUNDED, UNBOUNDED) and rows and cols:
        return _windowed_score_tiles(n_q, n_kv, causal, bottom_right, tile, window)
    if not causal or rows == 0 or cols == 0:
        return rows * cols
    if n_q == n_kv:  # either alignment: the tiles on and below the diagonal
        return rows * (rows + 1) // 2
    # query tile i sees key tiles up to (i * tile + tile - 1 + offset) // tile
    offset = n_kv - n_q if bottom_right else 0
    return sum(max(0, min(cols, (i * tile + tile - 1 + offset) // tile + 1)) for i in range(rows))


def _windowed_score_tiles(n_q: int, n_kv: int, causal: bool, bottom_right: bool, tile: int,
                          window: tuple[int, int]) -> int:
    """score_tiles under a window: query tile i's rows attend keys from its first row's left bound to its last
    row's right bound; the window's diagonal is the bottom-right one unless the mask is top-left causal."""
    left, right = window
    if n_q == n_kv:  # a packed sequence's own keys: in closed form (a pack's lengths change every step)
        return _band_tiles(-(-n_q // tile), tile, left, 0 if causal else right)
    offset = n_kv - n_q if bottom_right or not causal else 0
    total = 0
    for i in range(-(-n_q // tile)):
        first, last = i * tile, min(i * tile + tile, n_q) - 1
        low = 0 if left < 0 else max(0, first + offset - left)
        high = n_kv - 1 if right < 0 and not causal else min(n_kv - 1, last + offset + (0 if causal else right))
        if low <= high:
            total += high // tile - low // tile + 1
    return total


def _band_tiles(rows: int, tile: int, left: int, right: int) -> int:
    """Tiles of a square rows x rows grid that query tile i reaches under the band [-left, +right] (-1 unbounded)
    about the diagonal: key tiles max(0, i - behind) to min(rows - 1, i + ahead)."""
    ahead = rows - 1 if right < 0 else (tile - 1 + right) // tile
    behind = rows if left < 0 else -(-left // tile)
    clipped = max(0, rows - ahead)  # query tiles whose reach ahead stays inside the grid
    reach = clipped * (clipped - 1) // 2 + clipped * ahead + (rows - clipped) * (rows - 1)
    before = max(0, rows - 1 - behind)
    return reach - before * (before + 1) // 2 + rows


def packed_fills(lengths_q: tuple[int, ...], lengths_kv: tuple[int, ...], max_q: int, max_kv: int, mask_type: str,
                 tile: int = PACKED_TILE) -> tuple[float, float]:
    """(packed_fill, packed_token_fill) of a packed call, bucketed (see AttentionParams.packed_fill)."""
    causal, bottom_right = is_causal(mask_type), is_bottom_right(mask_type)
    batch = len(lengths_q)
    full = batch * score_tiles(max_q, max_kv, causal, bottom_right, tile)
    own = sum(score_tiles(n_q, n_kv, causal, bottom_right, tile) for n_q, n_kv in zip(lengths_q, lengths_kv))
    tokens = sum(lengths_q) / (batch * max_q)
    return packed_fill_bucket(own / full if full else 1.0), packed_fill_bucket(tokens if tokens > 0 else 1.0)


def packed_window_fill(lengths_q: tuple[int, ...], lengths_kv: tuple[int, ...], max_q: int, max_kv: int,
                       mask_type: str, window: tuple[int, int] | None, tile: int = PACKED_TILE) -> float | None:
    """AttentionParams.packed_window_fill of a packed call, bucketed; None without a window narrower than the mask
    type alone gives (as AttentionParams.has_sliding_window)."""
    window = normalize_window(window, mask_type)
    if window == plain_window(mask_type):
        return None
    causal, bottom_right = is_causal(mask_type), is_bottom_right(mask_type)
    full = len(lengths_q) * score_tiles(max_q, max_kv, causal, bottom_right, tile, window)
    own = sum(score_tiles(n_q, n_kv, causal, bottom_right, tile, window) for n_q, n_kv in zip(lengths_q, lengths_kv))
    return packed_fill_bucket(own / full if full else 1.0)


def packed_fields(lengths_q: tuple[int, ...], lengths_kv: tuple[int, ...], max_q: int, max_kv: int, mask_type: str,
                  window: tuple[int, int] | None) -> dict[str, float | None]:
    """AttentionParams' packed_fill, packed_token_fill and packed_window_fill of a packed call of these lengths: what
    the module reads from its cu_seqlens."""
    fill, tokens = packed_fills(lengths_q, lengths_kv, max_q, max_kv, mask_type)
    return {"packed_fill": fill, "packed_token_fill": tokens,
            "packed_window_fill": packed_window_fill(lengths_q, lengths_kv, max_q, max_kv, mask_type, window)}
