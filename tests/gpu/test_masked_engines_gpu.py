"""flex_attention:torch (compiled FlexAttention), flex_attention:flash_attn_4 (its FLASH lowering, bool masks) and
mem_efficient:torch on the GPU, bf16, against a float32 dense
reference on fresh random inputs: outputs, LSE, and gradients to q, k, v and a bias that requires grad; masks as bool
tensors (documents, prefix-LM, block-sparse, rows without keys), padding and packed sequences, windows, ALiBi,
softcap, GQA; the module routed to each engine for an 'arbitrary' mask; a user's mask_mod/score_mod."""
from __future__ import annotations

import math

import pytest
import torch

from attn_dispatch import DotProductAttention
from attn_dispatch.backends import get_engine
from attn_dispatch.backends.base import AttnAux, AttnConfig
from attn_dispatch.params import normalize_window

from gpu_common import rel_err

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOL = 2e-2  # bf16 inputs against a float32 reference
DEV = "cuda"


def _gen(name: str) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(sum(map(ord, name)) * 7919)


def _keep_documents(s: int, starts: list[int]) -> torch.Tensor:
    doc = torch.zeros(s, dtype=torch.long, device=DEV)
    for st in starts[1:]:
        doc[st:] += 1
    i, j = torch.arange(s, device=DEV).view(s, 1), torch.arange(s, device=DEV).view(1, s)
    return (doc.view(s, 1) == doc.view(1, s)) & (j <= i)


def _keep_prefix_lm(s: int, prefix: int) -> torch.Tensor:
    i, j = torch.arange(s, device=DEV).view(s, 1), torch.arange(s, device=DEV).view(1, s)
    return (j < prefix) | (j <= i)


def _keep_block_sparse(s: int, gen: torch.Generator, block: int = 128) -> torch.Tensor:
    n = -(-s // block)
    blocks = torch.rand(n, n, generator=gen, device=DEV) < 0.5
    blocks |= torch.eye(n, dtype=torch.bool, device=DEV)
    return blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)[:s, :s]


def _reference(q4, k4, v4, keep, score_fn, scale):
    """float32 [b, h, s, d] attention; rows without keys give 0 and lse -inf."""
    rep = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(rep, 1), v4.repeat_interleave(rep, 1)
    s = score_fn(q4 @ k4.transpose(-1, -2) * scale)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1).nan_to_num(neginf=0.0)).masked_fill(~keep, 0.0)
    return p @ v4, lse


def _leaves(b, s, h, hk, d, name, skv=None):
    gen = _gen(name)
    skv = skv or s
    return [torch.randn(b, n, heads, d, generator=gen, device=DEV, dtype=torch.bfloat16).requires_grad_()
            for n, heads in ((s, h), (skv, hk), (skv, hk))]


def _compare(engine_id, q, k, v, aux, cfg, keep, score_fn, extra_leaves=()):
    engine = get_engine(engine_id)
    out, lse, _ = engine(q, k, v, aux, cfg)
    if lse is None:  # flex's FLASH lowering gives a training call no LSE (its backward cannot take one)
        assert engine_id == "flex_attention:flash_attn_4", (engine_id, "no lse")
        with torch.no_grad():
            lse = engine(q, k, v, aux, cfg)[1]
    dout = torch.randn(out.shape, generator=_gen("dout"), device=DEV, dtype=out.dtype)
    leaves = (q, k, v, *extra_leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    rq, rk, rv = (x.transpose(1, 2) for x in ref_leaves[:3])
    ref_out, ref_lse = _reference(rq, rk, rv, keep, lambda x: score_fn(x, *ref_leaves[3:]), cfg.softmax_scale)
    ref_out = ref_out.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.float())
    assert rel_err(out, ref_out) < TOL, (engine_id, "out", rel_err(out, ref_out))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), (engine_id, "rows without keys")
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 5e-2, (engine_id, "lse")
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert rel_err(g, w) < TOL, (engine_id, name, rel_err(g, w))


def _cfg(mask_type="arbitrary", d=128, **kw):
    return AttnConfig(attn_mask_type=mask_type, window_size=normalize_window(None, mask_type),
                      softmax_scale=1 / math.sqrt(d), **kw)


ENGINES = ["flex_attention:torch", "mem_efficient:torch"]
try:  # flex's FLASH lowering needs flash-attn-4 (the full stack)
    import flash_attn.cute  # noqa: F401
    WITH_FLASH = ENGINES + ["flex_attention:flash_attn_4"]
except ImportError:
    WITH_FLASH = ENGINES


@pytest.mark.parametrize("engine_id", WITH_FLASH)
@pytest.mark.parametrize("kind", ["documents", "prefix_lm", "block_sparse", "rows_without_keys"])
def test_bool_masks(engine_id, kind):
    b, s, h, hk, d = 1, 1000, 8, 2, 128
    q, k, v = _leaves(b, s, h, hk, d, kind)
    keep = {"documents": lambda: _keep_documents(s, [0, 130, 400, 777]),
            "prefix_lm": lambda: _keep_prefix_lm(s, 300),
            "block_sparse": lambda: _keep_block_sparse(s, _gen("blocks")),
            "rows_without_keys": lambda: _keep_prefix_lm(s, 100) & (torch.arange(s, device=DEV) % 7 != 0).view(s, 1),
            }[kind]().view(1, 1, s, s)
    _compare(engine_id, q, k, v, AttnAux(attention_mask=~keep), _cfg(), keep, lambda x: x)


@pytest.mark.parametrize("engine_id", ENGINES)
def test_padding_with_per_head_alibi(engine_id):
    b, s, h, d = 3, 512, 8, 64
    q, k, v = _leaves(b, s, h, h, d, "alibi")
    lens = torch.tensor([512, 300, 77], device=DEV)
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).int()
    slopes = torch.rand(h, device=DEV, generator=_gen("slopes"))
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s, alibi_slopes=slopes)
    i, j = torch.arange(s, device=DEV).view(s, 1), torch.arange(s, device=DEV).view(1, s)
    keep = (j <= i) & (i < lens.view(b, 1, 1, 1)) & (j < lens.view(b, 1, 1, 1))
    _compare(engine_id, q, k, v, aux, _cfg("padding_causal", d, bias_type="alibi"), keep,
             lambda x: x - slopes.view(1, h, 1, 1) * (i - j).abs())


# mem_efficient:torch gave dbias nonzero above the diagonal here (H100, torch 2.11): its table refuses the call.
@pytest.mark.parametrize("engine_id", ["flex_attention:torch"])
def test_bias_that_takes_gradients_with_causal(engine_id):
    b, s, h, d = 2, 640, 4, 128
    q, k, v = _leaves(b, s, h, h, d, "bias")
    bias = torch.randn(1, h, s, s, device=DEV, generator=_gen("bias tensor"), dtype=torch.bfloat16).requires_grad_()
    keep = torch.ones(s, s, dtype=torch.bool, device=DEV).tril().view(1, 1, s, s)
    _compare(engine_id, q, k, v, AttnAux(bias=bias), _cfg("causal", d, bias_type="post_scale_bias"), keep,
             lambda x, bias_: x + bias_, extra_leaves=(bias,))


def test_flex_softcap_with_padding_and_window():
    b, s, h, d, cap = 2, 700, 8, 128, 30.0
    q, k, v = _leaves(b, s, h, 4, d, "softcap")
    lens = torch.tensor([700, 450], device=DEV)
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).int()
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    cfg = AttnConfig(attn_mask_type="padding_causal", window_size=(255, 0), softmax_scale=1 / math.sqrt(d),
                     softcap=cap)
    i, j = torch.arange(s, device=DEV).view(s, 1), torch.arange(s, device=DEV).view(1, s)
    keep = (j <= i) & (i - j <= 255) & (i < lens.view(b, 1, 1, 1)) & (j < lens.view(b, 1, 1, 1))
    _compare("flex_attention:torch", q, k, v, aux, cfg, keep, lambda x: cap * torch.tanh(x / cap))


@pytest.mark.parametrize("left", [-1, 127])
def test_flex_packed_documents_with_gaps(left):
    """Causal and windowed packs, with padding between sequences (flex_attention:flash_attn_4's table refuses
    packed bands)."""
    lens, slots = [300, 1, 517, 200], [304, 9, 520, 200]     # thd with padding between sequences
    t, h, d = sum(slots), 8, 128
    gen = _gen("thd")
    q, k, v = (torch.randn(1, t, h, d, generator=gen, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    starts = torch.tensor([0] + slots, device=DEV).cumsum(0)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).int()
    aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=starts.int(),
                  cu_seqlens_kv_padded=starts.int(), max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    cfg = AttnConfig(qkv_format="thd", attn_mask_type="padding_causal", window_size=(left, 0),
                     softmax_scale=1 / math.sqrt(d))
    doc = torch.full((t,), -1, device=DEV)
    for n, (st, ln) in enumerate(zip(starts.tolist(), lens)):
        doc[st:st + ln] = n
    i, j = torch.arange(t, device=DEV).view(t, 1), torch.arange(t, device=DEV).view(1, t)
    # positions inside a sequence differ from token indices by the sequence's start: the band is the same
    keep = ((doc.view(t, 1) == doc.view(1, t)) & (doc.view(t, 1) >= 0) & (j <= i)
            & ((i - j <= left) if left >= 0 else True)).view(1, 1, t, t)
    engine = get_engine("flex_attention:torch")
    out, lse, _ = engine(q[0], k[0], v[0], aux, cfg)  # thd [t, h, d]; the reference reads the [1, t, h, d] view
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = _reference(*(x.transpose(1, 2) for x in ref_leaves), keep, lambda x: x, cfg.softmax_scale)
    ref_out = ref_out.transpose(1, 2)[0]
    assert rel_err(out, ref_out) < TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse[0]))
    dout = torch.randn(out.shape, generator=_gen("thd dout"), device=DEV, dtype=out.dtype)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref_out, ref_leaves, dout.float())):
        assert rel_err(g, w) < TOL


def test_flex_never_runs_eagerly_across_many_head_configurations_and_both_grad_modes():
    """More head configurations and grad modes than torch.compile's recompile limit (8) in one kind of call: each
    compiled copy keeps its own graphs, so no call falls back to eager flex (which warns, and materialises the
    scores)."""
    import warnings

    engine = get_engine("flex_attention:torch")
    configs = [(h, hk, d) for h, hk in ((4, 4), (8, 2), (8, 8), (12, 4), (16, 1), (6, 3)) for d in (64, 128)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flex_attention called without torch.compile")
        for n, (h, hk, d) in enumerate(configs):
            lens = [97 + 31 * n, 256, 40 + n]
            t = sum(lens)
            cu = torch.tensor([0] + lens, device=DEV).cumsum(0).int()
            aux = AttnAux(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
            cfg = AttnConfig(qkv_format="thd", attn_mask_type="padding_causal", window_size=(-1, 0),
                             softmax_scale=1 / math.sqrt(d))
            doc = torch.repeat_interleave(torch.arange(len(lens), device=DEV), torch.tensor(lens, device=DEV))
            i, j = torch.arange(t, device=DEV).view(t, 1), torch.arange(t, device=DEV).view(1, t)
            keep = ((doc.view(t, 1) == doc.view(1, t)) & (j <= i)).view(1, 1, t, t)
            q, k, v = (x[0] for x in _leaves(1, t, h, hk, d, f"configs {n}"))
            for training in (True, False):
                with torch.set_grad_enabled(training):
                    out, _, _ = engine(q, k, v, aux, cfg)
                ref_out, _ = _reference(*(x.detach().float().unsqueeze(0).transpose(1, 2) for x in (q, k, v)),
                                        keep, lambda x: x, cfg.softmax_scale)
                assert rel_err(out, ref_out.transpose(1, 2)[0]) < TOL, (h, hk, d, training)
                assert out.requires_grad == training


def test_flex_user_mask_mod_and_score_mod():
    b, s, h, d = 1, 1024, 8, 128
    q, k, v = _leaves(b, s, h, h, d, "user")
    rel = torch.randn(h, 2 * s, device=DEV, generator=_gen("rel"))

    def sliding_prefix(b_, h_, q_idx, kv_idx):
        return (kv_idx < 64) | ((kv_idx <= q_idx) & (q_idx - kv_idx < 256))

    def relative(score, b_, h_, q_idx, kv_idx):
        return score + rel[h_, q_idx - kv_idx + s]
    aux = AttnAux(extra={"mask_mod": sliding_prefix, "score_mod": relative})
    i, j = torch.arange(s, device=DEV).view(s, 1), torch.arange(s, device=DEV).view(1, s)
    keep = ((j < 64) | ((j <= i) & (i - j < 256))).view(1, 1, s, s)
    _compare("flex_attention:torch", q, k, v, aux, _cfg("no_mask", d), keep, lambda x: x + rel[:, i - j + s])


def test_mem_efficient_head_dim_512_training():
    b, s, h, d = 1, 512, 4, 512
    q, k, v = _leaves(b, s, h, h, d, "d512")
    keep = _keep_documents(s, [0, 200]).view(1, 1, s, s)
    _compare("mem_efficient:torch", q, k, v, AttnAux(attention_mask=~keep), _cfg("arbitrary", d), keep, lambda x: x)


@pytest.mark.parametrize("backend", ["flex_attention", "mem_efficient"])
def test_module_routes_an_arbitrary_mask(backend, monkeypatch):
    monkeypatch.setenv("ATTN_DISPATCH_BACKEND", backend)
    b, s, h, d = 2, 512, 8, 64
    q, k, v = _leaves(b, s, h, h, d, "module " + backend)
    keep = _keep_documents(s, [0, 100, 333]).view(1, 1, s, s)
    module = DotProductAttention(h, d, attn_mask_type="arbitrary", qkv_format="bshd").cuda()
    out = module(q, k, v, attention_mask=~keep)
    assert module.explain(q, k, v, attention_mask=~keep).chosen.startswith(backend)
    ref, _ = _reference(*(x.detach().float().transpose(1, 2) for x in (q, k, v)), keep, lambda x: x, d ** -0.5)
    assert rel_err(out, ref.transpose(1, 2).reshape(b, s, -1)) < TOL
