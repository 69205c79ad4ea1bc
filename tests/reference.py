"""Float64 reference attention, written independently of every engine: one sequence at a time, a dense
score matrix, a masked softmax. Every engine test in the project compares against this function.

Semantics follow Transformer Engine's DotProductAttention (utils.get_full_mask / get_alibi):
- Sequence lengths: bshd/sbhd use the whole tensor unless cu_seqlens_q/kv give per-sequence lengths
  (real tokens first, padding after). thd takes sequence i from offset cu_seqlens_*_padded[i] (or
  cu_seqlens_*[i]) with length cu_seqlens_*[i+1] - cu_seqlens_*[i].
- Diagonal: query i of a sequence (length Lq, keys Lkv) is aligned with key i + off, where off = 0 for
  'causal'/'padding_causal' (top-left) and off = Lkv - Lq for every other mask type (bottom-right).
  Lq/Lkv are the per-sequence lengths when padding information is given, else the tensor lengths.
- Window (left, right), -1 unbounded: key j is kept iff i + off - left <= j <= i + off + right.
  Causal mask types force right = 0.
- 'arbitrary': attention_mask, bool, True = masked out, broadcastable to [b, h, sq, skv].
- Bias: pre_scale_bias s = (q.k + bias) * scale; post_scale_bias s = q.k * scale + bias; alibi adds
  -slope * |i + off - j| after scaling (slopes [h] or [b, h]).
- softmax_type: 'off-by-one' adds exp(0) to the denominator, 'learnable' adds exp(softmax_offset[h]).
- Dropout: given as a keep mask [b, h, sq_max, skv_max] (indexed by position within the sequence);
  kept probabilities are divided by (1 - dropout_p). lse never includes dropout.
- A query row that attends to no key gives output 0 and lse -inf. Output rows of padding tokens are 0.

Works on any device (the tensors' own). Returns (out, lse) in float64: out in the input format with head dim d_v;
lse [b, h, sq] for bshd/sbhd and [h, t_q] for thd (-inf at padding tokens). Autograd flows to q, k, v, bias and
softmax_offset.
"""
from __future__ import annotations

import math

import torch

TOP_LEFT_MASKS = ("causal", "padding_causal")


def _to_list(cu):
    return None if cu is None else [int(x) for x in cu.tolist()]


def _sequences(x, fmt, cu, cu_padded):
    """Split a q/k/v tensor into per-sequence [s_i, h, d] tensors and their token offsets (thd) or batch index."""
    if fmt == "thd":
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        starts = cu_padded[:-1] if cu_padded is not None else cu[:-1]
        return [x[s:s + n] for s, n in zip(starts, lens)], list(starts)
    xb = x if fmt == "bshd" else x.transpose(0, 1)  # [b, s, h, d]
    seqs = []
    for i in range(xb.shape[0]):
        n = xb.shape[1] if cu is None else cu[i + 1] - cu[i]
        seqs.append(xb[i, :n])
    return seqs, None


def _keep(lq, lkv, mask_type, window, off, device):
    """[lq, lkv] bool: which keys each query keeps (window and causality; padding is done by slicing)."""
    left, right = (-1, -1) if window is None else window
    if "causal" in mask_type:
        right = 0
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lkv, device=device)[None, :]
    keep = torch.ones(lq, lkv, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i + off - left
    if right >= 0:
        keep &= j <= i + off + right
    return keep


def reference_attention(q, k, v, *, qkv_format="bshd", attn_mask_type="no_mask", window_size=None,
                        attention_mask=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                        cu_seqlens_kv_padded=None, bias_type="no_bias", bias=None, alibi_slopes=None,
                        softmax_type="vanilla", softmax_offset=None, softmax_scale=None, dropout_p=0.0,
                        dropout_keep=None):
    f64, dev = torch.float64, q.device
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    bias = bias.to(f64) if bias is not None else None
    h, hk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    cq, ckv = _to_list(cu_seqlens_q), _to_list(cu_seqlens_kv)
    cqp, ckvp = _to_list(cu_seqlens_q_padded), _to_list(cu_seqlens_kv_padded)
    qs, q_starts = _sequences(q, qkv_format, cq, cqp)
    ks, _ = _sequences(k, qkv_format, ckv, ckvp)
    vs, _ = _sequences(v, qkv_format, ckv, ckvp)
    padded = cq is not None
    if softmax_type == "off-by-one":
        sink = torch.zeros(h, dtype=f64, device=dev)
    elif softmax_type == "learnable":
        sink = softmax_offset.to(f64)
    else:
        sink = None

    outs, lses = [], []
    for b, (qi, ki, vi) in enumerate(zip(qs, ks, vs)):
        lq, lkv = qi.shape[0], ki.shape[0]
        if lkv == 0:  # nothing to attend to
            outs.append(torch.zeros(lq, h, dv, dtype=f64, device=dev))
            lses.append(torch.full((h, lq), float("-inf"), dtype=f64, device=dev))
            continue
        if qkv_format == "thd" or padded:
            off = 0 if attn_mask_type in TOP_LEFT_MASKS else lkv - lq
        else:
            off = 0 if attn_mask_type in TOP_LEFT_MASKS else k_len(k, qkv_format) - q_len(q, qkv_format)
        arb = None
        if attention_mask is not None:
            full = attention_mask.expand(attention_mask.shape[0], h, -1, -1)
            arb = full[b if full.shape[0] > 1 else 0, :, :lq, :lkv]  # [h, lq, lkv]
        kh = ki.repeat_interleave(h // hk, dim=1)   # [lkv, h, d]
        vh = vi.repeat_interleave(h // hk, dim=1)
        qk = torch.einsum("qhd,khd->hqk", qi, kh)
        if bias_type == "pre_scale_bias":
            s = (qk + bias[b if bias.shape[0] > 1 else 0, :, :lq, :lkv]) * scale
        elif bias_type == "post_scale_bias":
            s = qk * scale + bias[b if bias.shape[0] > 1 else 0, :, :lq, :lkv]
        else:
            s = qk * scale
        if bias_type == "alibi":
            slopes = alibi_slopes.to(f64)
            slopes = slopes[b] if slopes.dim() == 2 else slopes
            i = torch.arange(lq, dtype=f64, device=dev)[:, None]
            j = torch.arange(lkv, dtype=f64, device=dev)[None, :]
            s = s - slopes[:, None, None] * (i + off - j).abs()
        keep = _keep(lq, lkv, attn_mask_type, window_size, off, dev).expand(h, lq, lkv)
        if arb is not None:
            keep = keep & ~arb
        s = s.masked_fill(~keep, float("-inf"))
        any_key = keep.any(dim=2)  # [h, lq]
        row_max = s.max(dim=2).values
        if sink is not None:
            row_max = torch.maximum(row_max, sink[:, None])
        m = torch.where(any_key, row_max, torch.zeros_like(row_max)).detach()
        e = torch.exp(s - m[:, :, None])
        denom = e.sum(dim=2)
        if sink is not None:
            denom = denom + torch.exp(sink[:, None] - m)
        denom = torch.where(any_key, denom, torch.ones_like(denom))
        p = e / denom[:, :, None]
        if dropout_keep is not None:
            p = p * dropout_keep[b, :, :lq, :lkv].to(f64) / (1.0 - dropout_p)
        out_b = torch.einsum("hqk,khd->qhd", p, vh)
        lse = torch.where(any_key, m + torch.log(denom), torch.full_like(m, float("-inf")))
        outs.append(out_b)  # [lq, h, dv]
        lses.append(lse)    # [h, lq]
    return _assemble(q, qkv_format, outs, lses, q_starts, h, dv)


def q_len(q, fmt):
    return q.shape[1] if fmt == "bshd" else q.shape[0]


def k_len(k, fmt):
    return k.shape[1] if fmt == "bshd" else k.shape[0]


def _assemble(q, fmt, outs, lses, q_starts, h, dv):
    f64, dev = torch.float64, q.device
    if fmt == "thd":
        t = q.shape[0]
        out = torch.zeros(t, h, dv, dtype=f64, device=dev)
        lse = torch.full((h, t), float("-inf"), dtype=f64, device=dev)
        pieces_out, pieces_lse, index = [], [], []
        for start, o, seq_lse in zip(q_starts, outs, lses):
            index.extend(range(start, start + o.shape[0]))
            pieces_out.append(o)
            pieces_lse.append(seq_lse)
        idx = torch.tensor(index, dtype=torch.long, device=dev)
        if len(index):
            out = out.index_put((idx,), torch.cat(pieces_out))
            lse = lse.index_put((torch.arange(h, device=dev)[:, None], idx[None, :]), torch.cat(pieces_lse, dim=1))
        return out, lse
    b = len(outs)
    sq = q_len(q, fmt)
    out_b, lse_b = [], []
    for o, seq_lse in zip(outs, lses):
        pad = sq - o.shape[0]
        out_b.append(torch.cat([o, torch.zeros(pad, h, dv, dtype=f64, device=dev)]) if pad else o)
        lse_b.append(torch.cat([seq_lse, torch.full((h, pad), float("-inf"), dtype=f64, device=dev)], dim=1)
                     if pad else seq_lse)
    out = torch.stack(out_b)   # [b, sq, h, dv]
    lse = torch.stack(lse_b)   # [b, h, sq]
    assert out.shape[0] == b
    return (out if fmt == "bshd" else out.transpose(0, 1)), lse
