"""What FlexAttention is given for a call: its mask as a mask_mod and a BlockMask, its bias/ALiBi/softcap as a
score_mod.

Indices are those of the [B, H, SQ, SKV] call flex sees: bshd/sbhd as they are; thd as one sequence of t packed
tokens (B = 1), where a frame maps each token to its sequence and its position in it. Transformer Engine's alignment:
query position i of a sequence with lq queries and lkv keys sits on key i + off, off = 0 for the top-left masks and
lkv - lq otherwise; a window (left, right) keeps key j iff -right <= i + off - j <= left (-1: unbounded).

Everything derived from a tensor's contents (a frame from cu_seqlens, a BlockMask from a mask) is computed once per
tensor and version (tensor_cache.cached_on); structures that depend on sizes only are kept in a small LRU.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..params import TOP_LEFT_MASKS
from ..tensor_cache import cached_on
from .base import AttnAux, AttnConfig

BLOCK = 128
MASK_MOD, SCORE_MOD = "mask_mod", "score_mod"  # the AttnAux.extra keys of a user's own modifiers
_LRU_LIMIT = 64


# --------------------------------------------------------------------------------------------
# Frames: where each query/key of the flex call sits in its sequence
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    kind: str                                # 'dense' | 'padded' | 'packed'
    off: int = 0                             # dense: the diagonal offset
    lens_q: torch.Tensor | None = None       # padded: [B] real query rows / keys per batch element; packed: [n]
    lens_kv: torch.Tensor | None = None
    start_q: torch.Tensor | None = None      # packed: [n] first token of each sequence (queries, keys)
    start_kv: torch.Tensor | None = None
    off_b: torch.Tensor | None = None        # padded: [B] offsets; packed: [n + 2] per sequence (2 outsiders)
    seq_q: torch.Tensor | None = None        # packed: [t_q] sequence of each token (n: none), [t_kv] (n + 1: none)
    seq_kv: torch.Tensor | None = None
    pos_q: torch.Tensor | None = None        # packed: position of each token in its sequence
    pos_kv: torch.Tensor | None = None
    seq_in: torch.Tensor | None = None       # packed: seq_q clamped to a real sequence (for per-sequence tensors)
    sources: tuple = ()                      # the cu_seqlens tensors the frame derives from

    def rel(self, b, q, kv):
        """i + off - j: how far key kv is behind the query's diagonal."""
        if self.kind == "dense":
            return q + self.off - kv
        if self.kind == "padded":
            return q + self.off_b[b] - kv
        return self.pos_q[q] + self.off_b[self.seq_q[q]] - self.pos_kv[kv]

    def locate(self, b, q, kv):
        """(sequence, query position, key position): where a per-sequence [b, h, sq, skv] tensor is read."""
        if self.kind == "packed":
            return self.seq_in[q], self.pos_q[q], self.pos_kv[kv]
        return b, q, kv

    def same_sequence(self, b, q, kv):
        if self.kind == "padded":
            return (q < self.lens_q[b]) & (kv < self.lens_kv[b])
        return self.seq_q[q] == self.seq_kv[kv]


def frame_for(aux: AttnAux, cfg: AttnConfig, sq: int, skv: int) -> Frame:
    top_left = cfg.attn_mask_type in TOP_LEFT_MASKS
    if cfg.qkv_format == "thd":
        if aux.cu_seqlens_q is None or aux.cu_seqlens_kv is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (int32 [batch + 1])")
        sources = tuple(t for t in (aux.cu_seqlens_q, aux.cu_seqlens_kv, aux.cu_seqlens_q_padded,
                                    aux.cu_seqlens_kv_padded) if t is not None)
        return cached_on(sources, ("flex_packed_frame", sq, skv, top_left, aux.cu_seqlens_q_padded is not None,
                                   aux.cu_seqlens_kv_padded is not None),
                         lambda: _packed_frame(aux, sq, skv, top_left, sources))
    if cfg.attn_mask_type.startswith("padding") and aux.cu_seqlens_q is not None:
        sources = (aux.cu_seqlens_q, aux.cu_seqlens_kv)
        return cached_on(sources, ("flex_padded_frame", top_left), lambda: _padded_frame(sources, top_left))
    return Frame("dense", off=0 if top_left else skv - sq)


def _padded_frame(sources: tuple, top_left: bool) -> Frame:
    cq, ckv = (c.long() for c in sources)
    lens_q, lens_kv = cq[1:] - cq[:-1], ckv[1:] - ckv[:-1]
    off = torch.zeros_like(lens_q) if top_left else lens_kv - lens_q
    return Frame("padded", lens_q=lens_q, lens_kv=lens_kv, off_b=off, sources=sources)


def _starts_and_lens(cu: torch.Tensor, cu_padded: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu.long()
    return (cu_padded.long() if cu_padded is not None else cu)[:-1], cu[1:] - cu[:-1]


def _token_positions(starts: torch.Tensor, lens: torch.Tensor, total: int, outside: int):
    """(sequence, position) of each of `total` tokens; tokens in no sequence get sequence `outside`."""
    token = torch.arange(total, device=starts.device)
    seq = (torch.searchsorted(starts, token, right=True) - 1).clamp(min=0)
    pos = token - starts[seq]
    inside = (token >= starts[0]) & (pos < lens[seq])
    return torch.where(inside, seq, torch.full_like(seq, outside)), torch.where(inside, pos, torch.zeros_like(pos))


def _packed_frame(aux: AttnAux, tq: int, tkv: int, top_left: bool, sources: tuple) -> Frame:
    n = aux.cu_seqlens_q.shape[0] - 1
    start_q, lens_q = _starts_and_lens(aux.cu_seqlens_q, aux.cu_seqlens_q_padded)
    start_kv, lens_kv = _starts_and_lens(aux.cu_seqlens_kv, aux.cu_seqlens_kv_padded)
    seq_q, pos_q = _token_positions(start_q, lens_q, tq, n)
    seq_kv, pos_kv = _token_positions(start_kv, lens_kv, tkv, n + 1)
    off = torch.zeros(n + 2, dtype=torch.long, device=start_q.device)
    if not top_left:
        off[:n] = lens_kv - lens_q
    return Frame("packed", off_b=off, seq_q=seq_q, seq_kv=seq_kv, pos_q=pos_q, pos_kv=pos_kv,
                 seq_in=seq_q.clamp(max=n - 1), lens_q=lens_q, lens_kv=lens_kv, start_q=start_q, start_kv=start_kv,
                 sources=sources)


# --------------------------------------------------------------------------------------------
# Tensors read inside the modifiers: a [1|B, 1|H, 1|SQ, 1|SKV] view and who indexes which dim
# --------------------------------------------------------------------------------------------
def as_4d(name: str, x: torch.Tensor, b: int, h: int, sq: int, skv: int) -> torch.Tensor:
    """x as a 4-D view that broadcasts to [b, h, sq, skv] (stride-0 dims of an expanded tensor made size 1), or a
    ValueError naming the argument, its shape and what is allowed."""
    expected = f"[1 or {b}, 1 or {h}, 1 or {sq}, 1 or {skv}] (or fewer leading dims)"
    if not isinstance(x, torch.Tensor) or x.dim() > 4:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} has shape {shape}; it must broadcast to {expected}")
    x4 = x if x.dim() == 4 else x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    if any(n not in (1, full) for n, full in zip(x4.shape, (b, h, sq, skv))):
        raise ValueError(f"{name} has shape {list(x.shape)}; it must broadcast to {expected}")
    if not any(n > 1 and s == 0 for n, s in zip(x4.shape, x4.stride())):
        return x4  # the tensor itself where it is 4-D: a bias that requires grad is read as it is
    return x4[tuple(slice(0, 1) if n > 1 and s == 0 else slice(None) for n, s in zip(x4.shape, x4.stride()))]


def reader(x4: torch.Tensor) -> Callable:
    """(b, h, q, kv) -> x4's element, indexing 0 on its broadcast dims (so a bias gradient keeps x4's shape). The
    0 is the index minus itself: flash-attn-4's lowering of a mask_mod takes tensor indices only ('Expected
    TensorSSA, but got int' for a literal, seen on the H200 with torch 2.11)."""
    pick = tuple(n > 1 for n in x4.shape)

    def read(b, h, q, kv):
        return x4[b if pick[0] else b - b, h if pick[1] else h - h, q if pick[2] else q - q,
                  kv if pick[3] else kv - kv]
    return read


# --------------------------------------------------------------------------------------------
# User modifiers
# --------------------------------------------------------------------------------------------
def user_mod(aux: AttnAux, key: str, device: torch.device) -> Callable | None:
    """aux.extra[key], checked once per function object: a mask_mod (b, h, q_idx, kv_idx) -> bool, or a score_mod
    (score, b, h, q_idx, kv_idx) -> score."""
    fn = aux.extra.get(key)
    if fn is None:
        return None
    cached = _CHECKED.get(id(fn))
    if cached is None or cached[0] is not fn:
        _check_user_mod(key, fn, device)
        if len(_CHECKED) >= _LRU_LIMIT:
            _CHECKED.clear()
        _CHECKED[id(fn)] = (fn,)
    return fn


_CHECKED: dict[int, tuple] = {}


def _check_user_mod(key: str, fn: Any, device: torch.device) -> None:
    arity, names = (4, "(b, h, q_idx, kv_idx)") if key == MASK_MOD else (5, "(score, b, h, q_idx, kv_idx)")
    what = f"aux.extra[{key!r}]"
    if not callable(fn):
        raise ValueError(f"{what} is a {type(fn).__name__}; it must be a function of {names}")
    try:
        inspect.signature(fn).bind(*range(arity))
    except TypeError:
        raise ValueError(f"{what} ({getattr(fn, '__name__', fn)!r}, signature {inspect.signature(fn)}) is not a "
                         f"function of {names}: FlexAttention calls it with {arity} positional arguments") from None
    except ValueError:
        pass  # no signature to read (a builtin): the probe call below decides
    idx = torch.zeros((), dtype=torch.int32, device=device)
    args = (idx,) * 4 if key == MASK_MOD else (torch.zeros((), device=device),) + (idx,) * 4
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the user's function: say which argument failed and how
        raise ValueError(f"{what} failed on index tensors {names} = 0: {type(exc).__name__}: {exc}") from exc
    if key == MASK_MOD and not (isinstance(result, torch.Tensor) and result.dtype == torch.bool):
        raise ValueError(f"{what} must return a bool tensor (True: the pair takes part); it returned "
                         f"{type(result).__name__}" + (f" of dtype {result.dtype}" if isinstance(result, torch.Tensor)
                                                       else ""))
    if key == SCORE_MOD and not (isinstance(result, torch.Tensor) and result.is_floating_point()):
        raise ValueError(f"{what} must return the modified score (a float tensor); it returned "
                         f"{type(result).__name__}")


def closure_tensors(fn: Callable) -> tuple[torch.Tensor, ...]:
    """The tensors a modifier reads through its closure (their versions key the BlockMask built from it)."""
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
    return tuple(found)


# --------------------------------------------------------------------------------------------
# The score_mod
# --------------------------------------------------------------------------------------------
def score_mod_for(frame: Frame, aux: AttnAux, cfg: AttnConfig, b: int, h: int, sq: int, skv: int,
                  user: Callable | None) -> Callable | None:
    """Transformer Engine's order (the unfused engine's): scaled scores (+ pre-scale bias, scaled), softcap,
    post-scale bias, ALiBi; then the user's score_mod. flex has applied the scale."""
    bias = slopes = None
    if frame.kind == "packed":  # per-sequence tensors: [1|n, 1|h, max_seqlen_q, max_seqlen_kv]
        b, sq, skv = frame.off_b.shape[0] - 2, aux.max_seqlen_q, aux.max_seqlen_kv
    if cfg.bias_type in ("pre_scale_bias", "post_scale_bias"):
        if aux.bias is None:
            raise ValueError(f"bias_type={cfg.bias_type!r} but aux.bias is None")
        bias = reader(as_4d("core_attention_bias", aux.bias, b, h, sq, skv))
    if cfg.bias_type == "alibi":
        s = aux.alibi_slopes
        if s is None or tuple(s.shape) not in ((h,), (b, h)):
            raise ValueError(f"bias_type='alibi' needs aux.alibi_slopes, float32 [{h}] or [{b}, {h}]; got "
                             f"{None if s is None else list(s.shape)}")
        slopes = (lambda b_, h_: s[h_]) if s.dim() == 1 else (lambda b_, h_: s[b_, h_])
    pre, scale, cap = cfg.bias_type == "pre_scale_bias", cfg.softmax_scale, cfg.softcap
    if bias is None and slopes is None and not cap and user is None:
        return None

    def score_mod(score, b_, h_, q, kv):
        seq, i, j = frame.locate(b_, q, kv)
        if bias is not None and pre:
            score = score + bias(seq, h_, i, j) * scale
        if cap:
            score = torch.tanh(score / cap) * cap
        if bias is not None and not pre:
            score = score + bias(seq, h_, i, j)
        if slopes is not None:
            score = score - slopes(seq, h_) * frame.rel(b_, q, kv).abs()
        if user is not None:
            score = user(score, b_, h_, q, kv)
        return score
    return score_mod


# --------------------------------------------------------------------------------------------
# The mask_mod and its BlockMask
# --------------------------------------------------------------------------------------------
def mask_mod_for(frame: Frame, cfg: AttnConfig, mask4: torch.Tensor | None, user: Callable | None) -> Callable | None:
    """None when every pair takes part (no_mask, no window, no mask tensor, no user mask_mod)."""
    left, right = cfg.window_size
    in_sequence = frame.kind != "dense"
    masked = reader(mask4) if mask4 is not None else None
    if not (in_sequence or left >= 0 or right >= 0 or masked is not None or user is not None):
        return None

    def mask_mod(b, h, q, kv):
        keep = frame.same_sequence(b, q, kv) if in_sequence else None
        if left >= 0 or right >= 0:
            rel = frame.rel(b, q, kv)
            near = (rel <= left) if left >= 0 else None
            if right >= 0:
                near = (rel >= -right) if near is None else near & (rel >= -right)
            keep = near if keep is None else keep & near
        if masked is not None:
            allowed = ~masked(b, h, q, kv)
            keep = allowed if keep is None else keep & allowed
        if user is not None:
            chosen = user(b, h, q, kv)
            keep = chosen if keep is None else keep & chosen
        return keep
    return mask_mod


class BlockInfo:
    """A BlockMask and what it skips: blocks ([B', H', nq, nk]) that hold no pair, hold only pairs, or some. The
    counts stay on the device until described (a build must not wait for the GPU: a mask may change every step)."""

    def __init__(self, block_mask: Any, total: int, counts: torch.Tensor):
        self.block_mask, self.total, self._counts = block_mask, total, counts  # counts: (partial, full)

    def describe(self) -> str:
        partial, full = (int(x) for x in self._counts.tolist())
        empty = self.total - full - partial
        if empty == 0:
            return (f"the mask leaves every {BLOCK}x{BLOCK} block of the scores at least partly attended "
                    f"({full} full, {partial} partial of {self.total}): there is no sparsity for FlexAttention "
                    "to skip")
        share = 100 * empty / self.total
        return (f"FlexAttention skips {empty} of {self.total} {BLOCK}x{BLOCK} blocks ({share:.1f}%); "
                f"{full} are fully attended, {partial} partly")


def block_info(flex, frame: Frame, cfg: AttnConfig, mask: torch.Tensor | None, mask4: torch.Tensor | None,
               user: Callable | None, mask_mod: Callable, b: int, h: int, sq: int, skv: int,
               device: torch.device) -> BlockInfo:
    """The call's block structure, built once: per mask tensor and version, per cu_seqlens tensors, per user
    mask_mod (and the tensors its closure holds), or per sizes. Its BlockMask carries flex's no-op mask_mod: a
    cached value must not hold a call's tensors (a mask that changes every step would stay alive), so each call
    sets its own (plan in flex_attention.py). mask: the call's mask tensor itself (the cache key), mask4 its 4-D
    view."""
    window = tuple(cfg.window_size)
    if mask4 is not None and user is None and frame.kind == "dense" and window == (-1, -1):
        return cached_on((mask,), ("flex_dense_blocks", tuple(mask4.shape), mask4.stride(), sq, skv),
                         lambda: _from_dense(flex, mask4, sq, skv))
    per_b = frame.kind == "padded" or (mask4 is not None and mask4.shape[0] > 1)
    per_h = mask4 is not None and mask4.shape[1] > 1
    shape = (b if per_b or user is not None else 1, h if per_h or user is not None else 1, sq, skv)
    key = ("flex_blocks", cfg.attn_mask_type in TOP_LEFT_MASKS, frame.kind, frame.off, window, shape, device)

    def build() -> BlockInfo:
        if mask4 is None and user is None:  # sequences and a band only: straight from their bounds
            return _from_bounds(flex, frame, window, sq, skv, device)
        return _from_mask_mod(flex, mask_mod, shape, device, user)
    if user is not None:
        return _user_cached(user, key, frame.sources + ((mask,) if mask is not None else ()), build)
    if frame.sources or mask is not None:
        return cached_on(frame.sources + ((mask,) if mask is not None else ()), key, build)
    hit = _SIZED.get(key)
    if hit is None:
        hit = _SIZED[key] = build()
        while len(_SIZED) > _LRU_LIMIT:
            _SIZED.popitem(last=False)
    else:
        _SIZED.move_to_end(key)
    return hit


_SIZED: OrderedDict = OrderedDict()
_USER: dict[int, tuple] = {}


def _user_cached(fn: Callable, key: tuple, tensors: tuple, build: Callable[[], BlockInfo]) -> BlockInfo:
    """Keyed by the function object (held weakly through its id and a check), the tensors it and the call read,
    and their versions: a closure whose tensor was written in place builds again."""
    read = tensors + closure_tensors(fn)
    state = (key, tuple(id(t) for t in read), tuple(getattr(t, "_version", 0) for t in read))
    hit = _USER.get(id(fn))
    if hit is not None and hit[0]() is fn and hit[1] == state:
        return hit[2]
    info = build()
    try:
        ref = weakref.ref(fn)
    except TypeError:  # an object that takes no weak reference: not cached
        return info
    if len(_USER) >= _LRU_LIMIT:
        _USER.clear()
    _USER[id(fn)] = (ref, state, info)
    return info


def _create_block_mask(create, mask_mod: Callable, b: int, h: int, sq: int, skv: int, device: torch.device):
    """What a compiled block-mask builder runs (a copy of this code per builder)."""
    return create(mask_mod, b, h, sq, skv, device=device, BLOCK_SIZE=BLOCK)


def compiled_copy(fn: Callable, name: str, key: tuple) -> Callable:
    """fn compiled as a code object of its own for one key: torch.compile keeps its graphs, and its recompile limit
    (8), per code object, and past the limit runs the frame eagerly (flex then materialises every score). Its name
    carries a digest of the key because dynamo also keys its automatic-dynamic state by file, line and name: copies
    of one name share it, so one copy's varying sizes and closure ints turned the other's symbolic (seen on the H200:
    flex's Triton lowering failing with 'ShapeAsConstantBuffer', and flex_attention:torch's steps slower, on the full
    stack, where flex_attention:torch's and flex_attention:flash_attn_4's copies were named by a count alike). The
    same key gets the same name in every process, as dynamo's saved state expects."""
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    return torch.compile(types.FunctionType(fn.__code__.replace(co_name=f"{name}_{digest}"), fn.__globals__))


_BUILDERS: dict[tuple, Callable] = {}


def compiled_builder(user: Callable, b: int, h: int) -> Callable:
    """create_block_mask compiled for a user's mask_mod: eager, it materialises the [B, H, Q, KV] mask. One copy per
    mask_mod's code and batch/head sizes (compiled_copy: every user mask_mod through torch's own create_block_mask
    would share one code object). The closure's values and the lengths do not make a copy (lengths turn dynamic
    after one recompile)."""
    key = (getattr(user, "__code__", type(user)), b, h)
    builder = _BUILDERS.get(key)
    if builder is None:
        code = key[0]
        where = (code.co_filename, code.co_firstlineno, code.co_name) if isinstance(code, types.CodeType) else \
            (code.__module__, code.__qualname__)
        builder = _BUILDERS[key] = compiled_copy(_create_block_mask, "create_block_mask", (*where, b, h))
    return builder


def _from_mask_mod(flex, mask_mod: Callable, shape: tuple, device: torch.device, user: Callable | None) -> BlockInfo:
    """A BlockMask from a mask_mod; with a user's, compiled on CUDA (compiled_builder), else evaluated eagerly (the
    mask tensor's and a structured frame's mask_mods are cheap to evaluate)."""
    if user is not None and device.type == "cuda":
        bm = compiled_builder(user, shape[0], shape[1])(flex.create_block_mask, mask_mod, *shape, device)
    else:
        bm = flex.create_block_mask(mask_mod, *shape, device=device, BLOCK_SIZE=BLOCK)
    bm.mask_mod = flex.noop_mask  # cached: hold none of this call's tensors (each call sets its own mask_mod)
    full = bm.full_kv_num_blocks
    counts = torch.stack([bm.kv_num_blocks.sum(), full.sum() if full is not None else bm.kv_num_blocks.new_zeros(())])
    total = shape[0] * shape[1] * -(-shape[2] // BLOCK) * -(-shape[3] // BLOCK)
    return BlockInfo(bm, total, counts)


def _sequence_bounds(frame: Frame, sq: int, skv: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """[R, n] query start, query count, key start, key count and diagonal offset of the n sequences in each of the
    BlockMask's R batch rows (packed: one row of n; padded: B rows of one; dense: one sequence)."""
    if frame.kind == "packed":
        n = frame.lens_q.shape[0]
        return tuple(t.unsqueeze(0) for t in (frame.start_q, frame.lens_q, frame.start_kv, frame.lens_kv,
                                              frame.off_b[:n]))
    if frame.kind == "padded":
        zeros = torch.zeros_like(frame.lens_q)
        return tuple(t.unsqueeze(1) for t in (zeros, frame.lens_q, zeros, frame.lens_kv, frame.off_b))
    return tuple(torch.full((1, 1), v, dtype=torch.long, device=device) for v in (0, sq, 0, skv, frame.off))


def _from_bounds(flex, frame: Frame, window: tuple[int, int], sq: int, skv: int, device: torch.device) -> BlockInfo:
    """The BlockMask of a sequence mask with a band (causal, a window) from the sequences' bounds: O(blocks x blocks
    + sequences) tensor work instead of evaluating the mask_mod on every pair, and nothing read back to the host
    (cu_seqlens may be new every step). The query axis is cut at block and sequence boundaries; the queries of one
    piece reach one contiguous range of keys (the band moves one key per query), whose blocks the piece marks. A
    block is full when its 128 queries lie in one sequence, its 128 keys too, and the band covers all its pairs;
    like create_block_mask, rows and keys past sq / skv count as masked."""
    q_start, q_len, kv_start, kv_len, off = _sequence_bounds(frame, sq, skv, device)
    left, right = window
    rows = q_start.shape[0]
    nq, nk = -(-sq // BLOCK), -(-skv // BLOCK)
    shift = kv_start - q_start + off  # query token t keeps key tokens t + shift - left .. t + shift + right

    def of(seq: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return t.gather(1, seq)

    def sequence_at(token: torch.Tensor) -> torch.Tensor:  # the frame's rule: the last sequence starting at or before
        return (torch.searchsorted(q_start.contiguous(), token.contiguous(), right=True) - 1).clamp(min=0)

    block_q = torch.arange(nq, device=device) * BLOCK
    cuts = torch.cat([block_q.expand(rows, nq), q_start, q_start + q_len,
                      torch.full((rows, 1), sq, dtype=torch.long, device=device)], 1).clamp(0, sq).sort(1).values
    a, b = cuts[:, :-1], cuts[:, 1:]
    seq = sequence_at(a)
    inside = (b > a) & (a >= of(seq, q_start)) & (a < of(seq, q_start) + of(seq, q_len))
    lo = of(seq, kv_start)
    hi = torch.clamp(lo + of(seq, kv_len), max=skv) - 1
    if left >= 0:
        lo = torch.maximum(lo, a + of(seq, shift) - left)
    if right >= 0:
        hi = torch.minimum(hi, b - 1 + of(seq, shift) + right)
    weight = (inside & (lo <= hi)).long()
    # each piece adds 1 on its first key block and -1 past its last; a cumulative sum along the keys marks them
    base = (torch.arange(rows, device=device).unsqueeze(1) * nq + (a // BLOCK).clamp(max=nq - 1)) * (nk + 1)
    marks = torch.zeros(rows * nq * (nk + 1), dtype=torch.long, device=device)
    marks.index_add_(0, (base + (lo // BLOCK).clamp(0, nk)).flatten(), weight.flatten())
    marks.index_add_(0, (base + (hi // BLOCK + 1).clamp(0, nk)).flatten(), -weight.flatten())
    attended = marks.view(rows, nq, nk + 1).cumsum(-1)[..., :nk] > 0

    seq = sequence_at(block_q.expand(rows, nq))
    whole_rows = (block_q >= of(seq, q_start)) & (block_q + BLOCK <= of(seq, q_start) + of(seq, q_len)) & \
                 (block_q + BLOCK <= sq)
    block_kv = torch.arange(nk, device=device) * BLOCK
    first_kv, end_kv = of(seq, kv_start).unsqueeze(-1), (of(seq, kv_start) + of(seq, kv_len)).unsqueeze(-1)
    full = whole_rows.unsqueeze(-1) & (block_kv >= first_kv) & (block_kv + BLOCK <= end_kv) & (block_kv + BLOCK <= skv)
    gap_lo = block_kv - (block_q.unsqueeze(-1) + BLOCK - 1)  # the least and greatest key - query in a block
    gap_hi = block_kv + BLOCK - 1 - block_q.unsqueeze(-1)
    if left >= 0:
        full &= gap_lo >= of(seq, shift).unsqueeze(-1) - left
    if right >= 0:
        full &= gap_hi <= of(seq, shift).unsqueeze(-1) + right
    partial = (attended & ~full).unsqueeze(1)
    full = full.unsqueeze(1)
    return BlockInfo(_block_mask(flex, partial, full, sq, skv), partial.numel(),
                     torch.stack([partial.sum(), full.sum()]))


def _block_mask(flex, partial: torch.Tensor, full: torch.Tensor, sq: int, skv: int) -> Any:
    """A BlockMask from dense [B, H, nq, nk] partial / full block maps. The query-side lists come from the maps'
    transposes: from_kv_blocks would rebuild the maps from the key-side lists first (through vmap), most of a build's
    host time."""
    num, idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    from_kv_blocks = flex.BlockMask.from_kv_blocks
    if not _takes(from_kv_blocks, "compute_q_blocks"):  # torch < 2.6
        return from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=BLOCK, seq_lengths=(sq, skv))
    bm = from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=BLOCK, seq_lengths=(sq, skv), compute_q_blocks=False)
    bm.q_num_blocks, bm.q_indices = _ordered(partial.transpose(-2, -1))
    bm.full_q_num_blocks, bm.full_q_indices = _ordered(full.transpose(-2, -1))
    return bm


@functools.lru_cache(maxsize=None)
def _takes(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _from_dense(flex, mask4: torch.Tensor, sq: int, skv: int) -> BlockInfo:
    """Block maps straight from a bool mask (True: masked out), never materialising a full copy of a broadcast one:
    a block is full when no pair in it is masked, empty when all are."""
    nq, nk = -(-sq // BLOCK), -(-skv // BLOCK)
    any_masked = _block_reduce(mask4, torch.any, True, nq, nk)
    all_masked = _block_reduce(mask4, torch.all, True, nq, nk)
    full = ~any_masked
    partial = any_masked & ~all_masked
    return BlockInfo(_block_mask(flex, partial, full, sq, skv), partial.numel(),
                     torch.stack([partial.sum(), full.sum()]))


def _block_reduce(mask4: torch.Tensor, reduce, pad_value: bool, nq: int, nk: int) -> torch.Tensor:
    """reduce (any/all) of each BLOCK x BLOCK tile of [B', H', 1|sq, 1|skv] -> [B', H', nq, nk]."""
    m = mask4
    rows, cols = m.shape[2], m.shape[3]
    pad_r = (-rows) % BLOCK if rows > 1 else 0
    pad_c = (-cols) % BLOCK if cols > 1 else 0
    if pad_r or pad_c:  # the tail of a partial tile counts as masked (flex masks past the sequence itself)
        padded = m.new_full((m.shape[0], m.shape[1], rows + pad_r, cols + pad_c), pad_value)
        padded[:, :, :rows, :cols] = m
        m = padded
    br, bc = (BLOCK if rows > 1 else 1), (BLOCK if cols > 1 else 1)
    tiles = m.reshape(m.shape[0], m.shape[1], m.shape[2] // br, br, m.shape[3] // bc, bc)
    out = reduce(reduce(tiles, dim=5), dim=3)
    return out.expand(out.shape[0], out.shape[1], nq, nk)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (kv_num_blocks, kv_indices): per query block, how many kv blocks, and which (those first)."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()
