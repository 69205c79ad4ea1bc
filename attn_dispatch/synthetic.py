"""Random engine inputs built from an AttentionParams: for the probe, the tuner and the benchmarks."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends.base import AttnAux, AttnConfig, PackedFacts
from .params import AttentionParams, SeqLengths, keyless_rows

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


@dataclass
class SyntheticCall:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    aux: AttnAux
    cfg: AttnConfig
    seqlens_q: list[int]   # real tokens per sequence
    seqlens_kv: list[int]


def config_for(params: AttentionParams, softmax_scale: float | None = None) -> AttnConfig:
    return AttnConfig(
        qkv_format=params.qkv_format, attn_mask_type=params.attn_mask_type, window_size=params.window_size,
        softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(params.head_dim_qk),
        dropout_p=params.dropout if params.is_training else 0.0, bias_type=params.bias_type,
        softmax_type=params.softmax_type, deterministic=params.deterministic,
        return_max_logit=params.return_max_logit,
    )


def _given_lengths(params: AttentionParams, lengths: SeqLengths) -> tuple[list[int], list[int]]:
    """A packed call's own per-sequence lengths, checked against its parameters."""
    if not params.has_padding:
        raise ValueError(f"lengths are given for a call without padding ({params.describe()}); they describe the "
                         "sequences of a packed or padded call")
    lens_q, lens_kv = (list(side) for side in lengths)
    for name, lens, longest in (("query", lens_q, params.max_seqlen_q), ("key", lens_kv, params.max_seqlen_kv)):
        if len(lens) != params.batch_size or not all(0 <= n <= longest for n in lens):
            raise ValueError(f"{name} lengths {lens} do not fit batch_size={params.batch_size} sequences of at most "
                             f"{longest} tokens")
    return lens_q, lens_kv


def _lengths(generator: torch.Generator, batch: int, longest: int, ragged: bool) -> list[int]:
    if not ragged:
        return [longest] * batch
    lengths = torch.randint(1, longest + 1, (batch,), generator=generator, device=generator.device).tolist()
    lengths[0] = longest  # the max is reached, as max_seqlen promises
    return lengths


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def make_call(params: AttentionParams, *, device: str | torch.device = "cpu", seed: int = 0,
              requires_grad: bool = True, dtype: torch.dtype | None = None, full_lengths: bool = False,
              lengths: SeqLengths | None = None) -> SyntheticCall:
    """Fresh random q, k, v (and bias, slopes, sink, masks, cu_seqlens) that match `params`, drawn on `device`.
    Padded calls get random per-sequence lengths unless `full_lengths` (timing wants an exact flop count), or
    `lengths`: a packed call's own (query, key) tokens per sequence, to time what that call costs."""
    device = torch.device(device)
    if dtype is None and params.dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype={params.dtype!r} has no synthetic inputs; expected one of {', '.join(TORCH_DTYPES)}")
    dtype = dtype or TORCH_DTYPES[params.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)
    b, h, hk = params.batch_size, params.num_heads, params.num_gqa_groups
    sq, skv, dqk, dv = params.max_seqlen_q, params.max_seqlen_kv, params.head_dim_qk, params.head_dim_v
    ragged = params.has_padding
    if lengths is not None:
        lens_q, lens_kv = _given_lengths(params, lengths)
    else:
        lens_q = _lengths(generator, b, sq, ragged and not full_lengths)
        # Self-attention (equal max lengths) keeps each sequence's q and kv lengths equal, as real batches do; the
        # tables see only the maxima, so per-sequence mismatches are the module's to validate, not the probe's.
        lens_kv = list(lens_q) if sq == skv else _lengths(generator, b, skv, ragged and not full_lengths)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    if params.qkv_format == "thd":
        tq, tk = sum(lens_q), sum(lens_kv)
        q, k, v = rand(tq, h, dqk), rand(tk, hk, dqk), rand(tk, hk, dv)
    elif params.qkv_format == "bshd":
        q, k, v = rand(b, sq, h, dqk), rand(b, skv, hk, dqk), rand(b, skv, hk, dv)
    else:
        q, k, v = rand(sq, b, h, dqk), rand(skv, b, hk, dqk), rand(skv, b, hk, dv)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    aux = AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv)
    if ragged:
        aux.cu_seqlens_q, aux.cu_seqlens_kv = _cumulative(lens_q, device), _cumulative(lens_kv, device)
    if params.qkv_format == "thd":  # the host facts the module's validation would give (timed calls run its path)
        aux.packed = _packed_facts(lens_q, lens_kv, params)
    if params.attn_mask_type == "arbitrary":
        masked = torch.rand(b, 1, sq, skv, generator=generator, device=device) < 0.3
        masked[..., 0] = False  # every row keeps one key
        aux.attention_mask = masked
    if params.has_bias_tensor:
        dims = {"1hss": (1, h), "b1ss": (b, 1), "bhss": (b, h), "11ss": (1, 1)}[params.bias_shape]
        aux.bias = rand(*dims, sq, skv).requires_grad_(params.bias_requires_grad and requires_grad)
    if params.bias_type == "alibi":
        shape = (h,) if params.alibi_slopes_shape == "h" else (b, h)
        aux.alibi_slopes = torch.rand(*shape, generator=generator, device=device) * 0.5 + 0.01
    if params.softmax_type == "learnable":
        aux.softmax_offset = rand(h, dt=torch.float32).requires_grad_(requires_grad)
    return SyntheticCall(q, k, v, aux, config_for(params), lens_q, lens_kv)


def _packed_facts(lens_q: list[int], lens_kv: list[int], params: AttentionParams) -> PackedFacts:
    with_queries = [(n_q, n_kv) for n_q, n_kv in zip(lens_q, lens_kv) if n_q > 0]
    keyless = keyless_rows(params.attn_mask_type, tuple(params.window_size),
                           min((n_kv - n_q for n_q, n_kv in with_queries), default=0),
                           any(n_kv == 0 for _, n_kv in with_queries))
    return PackedFacts(sum(lens_q), sum(lens_kv), keyless)


def cast_call(call: SyntheticCall, dtype: torch.dtype) -> SyntheticCall:
    """The same call in another dtype (float64 for a reference), as new leaf tensors."""
    def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.detach().to(dtype if t.is_floating_point() else t.dtype).requires_grad_(t.requires_grad)

    aux = AttnAux(**{**call.aux.__dict__})
    aux.bias = leaf(call.aux.bias)
    aux.softmax_offset = leaf(call.aux.softmax_offset)
    aux.alibi_slopes = call.aux.alibi_slopes.detach().double() if call.aux.alibi_slopes is not None else None
    return SyntheticCall(leaf(call.q), leaf(call.k), leaf(call.v), aux, call.cfg, call.seqlens_q, call.seqlens_kv)
