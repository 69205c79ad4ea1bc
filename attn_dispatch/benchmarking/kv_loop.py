"""A generation loop over a KV cache, checked step by step against full attention recomputed over each prefix.

Sequences of different lengths join (prompts), decode, take chunked-prefill steps, change batch order and leave;
every layer keeps its own cache. The reference is float64 attention of each new query over the sequence's whole
history (bottom-right causal, window applied). Inputs' padding positions hold random values, never zeros, so a
kernel that read them would show. Used by tests/test_kv_cache.py (CPU), tests/gpu/test_kv_cache_gpu.py and
benchmarks/bench_kv_decode.py.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterator

import torch

from ..kv_cache import InferenceParams
from ..module import DotProductAttention

# step index -> event: joins carry prompt lengths; chunk gives running sequences several tokens at once.
SCHEDULE = {0: {"join": {"a": 7, "b": 3}}, 4: {"join": {"c": 6}}, 9: {"leave": ["a"]},
            12: {"chunk": {"b": 4}}, 15: {"join": {"d": 9}, "reorder": True}, 22: {"leave": ["c"]},
            30: {"join": {"e": 2}, "chunk": {"d": 3}}, 41: {"leave": ["b"], "reorder": True}}
DECODE_STEPS = 50


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window_left: int) -> torch.Tensor:
    """q [n, h, d] are the last n positions of a sequence whose keys/values are [L, hkv, d]; float64."""
    n, length = q.shape[0], keys.shape[0]
    rep = q.shape[1] // keys.shape[1]
    k, v = (x.double().repeat_interleave(rep, dim=1) for x in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    qpos = torch.arange(length - n, length, device=q.device)[:, None]
    kpos = torch.arange(length, device=q.device)[None, :]
    keep = kpos <= qpos
    if window_left >= 0:
        keep &= kpos >= qpos - window_left
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def steps(scale: int = 1) -> Iterator[OrderedDict]:
    """The schedule's step dicts; scale multiplies prompt and chunk lengths."""
    running: list[str] = []
    for i in range(DECODE_STEPS + 1):
        event = SCHEDULE.get(i, {})
        running = [s for s in running if s not in event.get("leave", ())]
        step = OrderedDict((s, event.get("chunk", {}).get(s, 1) * (scale if s in event.get("chunk", {}) else 1))
                           for s in running)
        for s, n in event.get("join", {}).items():
            step[s] = n * scale
            running.append(s)
        if event.get("reorder"):
            step = OrderedDict(reversed(list(step.items())))
            running = list(step)
        yield step


def pack(tokens: list[torch.Tensor], fmt: str, extra: int = 2) -> torch.Tensor:
    """Per-sequence [n_i, heads, d] -> the format's tensor, padded with random values."""
    heads, d = tokens[0].shape[1:]
    like = dict(dtype=tokens[0].dtype, device=tokens[0].device)
    if fmt == "thd":
        return torch.cat(tokens + [torch.randn(extra, heads, d, **like)])
    s = max(t.shape[0] for t in tokens)
    out = torch.randn(len(tokens), s, heads, d, **like)
    for i, t in enumerate(tokens):
        out[i, :t.shape[0]] = t
    return out if fmt == "bshd" else out.transpose(0, 1).contiguous()


def unpack(out: torch.Tensor, fmt: str, lens: list[int]) -> list[torch.Tensor]:
    if fmt == "thd":
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return [out[starts[i]:starts[i + 1]] for i in range(len(lens))]
    b_first = out if fmt == "bshd" else out.transpose(0, 1)
    return [b_first[i, :n] for i, n in enumerate(lens)]


def run_generation(fmt: str, paged: bool, window_left: int, *, dtype=torch.float64, device="cpu", layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, head_dim: int = 16, max_len: int = 64, page_size: int = 4,
                   total_pages: int | None = None, scale: int = 1, backend: str | None = None,
                   max_batch: int = 6) -> dict:
    """Runs the schedule; returns the worst absolute error against the reference, the zero-padding check and
    the last decision."""
    torch.manual_seed(1234)
    window = (window_left, 0) if window_left >= 0 else None
    modules = [DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, qkv_format=fmt,
                                      attn_mask_type="padding_causal", window_size=window, layer_number=i + 1,
                                      backend=backend).eval() for i in range(layers)]
    if paged and total_pages is None:
        total_pages = 160 * scale // page_size
    ip = InferenceParams(max_batch, max_len, kv_heads, head_dim, dtype, is_paged=paged,
                            page_size=page_size if paged else None, total_num_pages=total_pages if paged else None,
                            qkv_format=fmt, device=device)
    history: dict = {}
    worst, padding_zero, chosen = 0.0, True, set()
    like = dict(dtype=dtype, device=device)
    for step in steps(scale):
        ip.pre_step(step)
        lens = list(step.values())
        for layer, module in enumerate(modules):
            qs = [torch.randn(n, heads, head_dim, **like) for n in lens]
            ks = [torch.randn(n, kv_heads, head_dim, **like) for n in lens]
            vs = [torch.randn(n, kv_heads, head_dim, **like) for n in lens]
            with torch.no_grad():
                out = module(pack(qs, fmt), pack(ks, fmt), pack(vs, fmt), inference_params=ip)
            chosen.add(module.last_decision.chosen)
            got = unpack(out.unflatten(-1, (heads, head_dim)), fmt, lens)
            for i, seq in enumerate(step):
                fresh = ip.sequences_pre_step.get(seq, 0) == 0
                hk, hv = (ks[i][:0], vs[i][:0]) if fresh else history[(layer, seq)]
                hk, hv = torch.cat([hk, ks[i]]), torch.cat([hv, vs[i]])
                history[(layer, seq)] = (hk, hv)
                expected = reference(qs[i], hk, hv, window_left)
                worst = max(worst, (got[i].double() - expected).abs().max().item())
            if fmt != "thd":
                full = out.unflatten(-1, (heads, head_dim))
                full = full if fmt == "bshd" else full.transpose(0, 1)
                padding_zero &= all(bool(torch.all(full[i, n:] == 0)) for i, n in enumerate(lens))
    return {"worst_abs_err": worst, "padding_zero": padding_zero, "chosen": sorted(chosen),
            "decision": modules[0].last_decision}
