"""The cuDNN frontend engine's plumbing on the CPU, through a stand-in `cudnn` module.

The stand-in records the graph the engine declares (dims, strides, ragged offsets, mask band, bias, sink,
dropout) and executes it in float64 with cuDNN's documented semantics (those of cudnn-frontend's own test
reference, test/python/test_mhas.py compute_ref: diagonal bands, bottom-right alignment per sequence length,
ragged offsets in elements). Running the engine end to end against tests/reference.py then checks what no GPU
is needed for: layouts through strides, thd offsets and ragged stats, the window -> band mapping, padded rows,
ALiBi, sinks, bias gradients, the autograd glue and the graph cache. The kernels themselves are checked on the
GPU (tests/gpu/test_cudnn_gpu.py).
"""
from __future__ import annotations

import dataclasses

import ctypes
import enum
import itertools
import math
import types

import pytest
import torch

from attn_dispatch import runtime_facts

from attn_dispatch.backends import cudnn_fused as eng
from attn_dispatch.backends.base import AttnAux, AttnConfig, PackedFacts
from reference import reference_attention


# --------------------------------------------------------------------------------------------
# The stand-in cudnn module
# --------------------------------------------------------------------------------------------
class DT(enum.Enum):
    HALF = "half"
    BFLOAT16 = "bf16"
    FLOAT = "float"
    INT32 = "int32"
    INT64 = "int64"
    NOT_SET = "unset"


class Align(enum.Enum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class FakeTensor:
    _uids = itertools.count(1)

    def __init__(self, name="", dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type = name, list(dim or []), list(stride or []), data_type
        self.ragged, self.output, self.uid = None, False, next(self._uids)

    def set_output(self, v):
        self.output = v
        return self

    def set_dim(self, d):
        self.dim = list(d)
        return self

    def set_stride(self, s):
        self.stride = list(s)
        return self

    def set_data_type(self, t):
        self.data_type = t
        return self

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def get_uid(self):
        return self.uid


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """The buffer's storage from its first element on, as a 1-D tensor (offsets are relative to data_ptr)."""
    n = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
    return torch.as_strided(buf.detach(), (n,), (1,), buf.storage_offset())


def _read(buf, t: FakeTensor, uid_buf) -> torch.Tensor:
    """The [b, h, s, d] float64 tensor a graph tensor describes, gathered from its buffer as cuDNN reads it."""
    b, h, s, d = t.dim
    if t.ragged is not None:
        offs = uid_buf[t.ragged.uid].reshape(-1).tolist()
        storage = _flat(buf)
        return torch.stack([_gather(storage, int(offs[i]), (h, s, d), tuple(t.stride[1:])) for i in range(b)]).double()
    return torch.as_strided(buf.detach(), t.dim, t.stride, buf.storage_offset()).double()


def _gather(storage, offset, shape, stride):
    """storage[offset + i*stride...] with positions past the end read as 0 (cuDNN reads only real tokens)."""
    idx = torch.full(shape, offset, dtype=torch.long)
    for k, (n, st) in enumerate(zip(shape, stride)):
        idx = idx + (torch.arange(n) * st).view(*([1] * k), n, *([1] * (len(shape) - k - 1)))
    valid = idx < storage.numel()
    return torch.where(valid, storage[idx.clamp(max=storage.numel() - 1)], torch.zeros((), dtype=storage.dtype))


def _write(buf, t: FakeTensor, value: torch.Tensor, uid_buf, lens=None) -> None:
    """Write a [b, h, s, d] result into the caller's buffer through the declared layout (real rows only)."""
    b, h, s, d = t.dim
    value = value.detach().to(buf.dtype)
    if t.ragged is not None:
        offs = uid_buf[t.ragged.uid].reshape(-1).tolist()
        flat = _flat(buf)
        for i in range(b):
            n = int(lens[i]) if lens is not None else s
            torch.as_strided(flat, (h, n, d), tuple(t.stride[1:]), flat.storage_offset() + int(offs[i])).copy_(
                value[i, :, :n])
        return
    torch.as_strided(buf, t.dim, t.stride, buf.storage_offset()).copy_(value)


class GraphNotSupported(Exception):
    """cudnn.cudnnGraphNotSupportedError's stand-in."""


FAKE_BACKEND_HANDLE = 4242
_TORCH_OF = {DT.HALF: torch.float16, DT.BFLOAT16: torch.bfloat16, DT.FLOAT: torch.float32, DT.INT32: torch.int32,
             DT.INT64: torch.int64}


def _from_pointer(ptr: int, t: FakeTensor) -> torch.Tensor:
    """The buffer a graph tensor declares, at a bare address (host memory here), as a torch view."""
    dtype = _TORCH_OF[t.data_type]
    n = 1 + sum((d - 1) * st for d, st in zip(t.dim, t.stride))
    raw = (ctypes.c_char * (n * torch.empty((), dtype=dtype).element_size())).from_address(ptr)
    return torch.as_strided(torch.frombuffer(raw, dtype=dtype, count=n), t.dim, t.stride)


class FakeGraph:
    executions = 0
    raw_executions = 0

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None):
        self.tensors, self.node = [], None

    def tensor(self, name="", dim=None, stride=None, data_type=None):
        t = FakeTensor(name, dim, stride, data_type)
        self.tensors.append(t)
        return t

    def sdpa(self, q, k, v, name="", **kw):
        assert kw.get("generate_stats") is True
        self.node = ("fwd", dict(q=q, k=k, v=v, **kw))
        o, st = FakeTensor("o"), FakeTensor("stats")
        return [o, st]

    def sdpa_backward(self, q, k, v, o, dO, stats, name="", **kw):
        self.node = ("bwd", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, **kw))
        outs = [FakeTensor("dq"), FakeTensor("dk"), FakeTensor("dv")]
        self.node[1]["outs"] = outs
        return outs

    def validate(self):
        """cuDNN's graph checks our engine can reach, transcribed from cudnn-frontend 1.32 (_sdpa_validate.py
        _validate_common/_validate_forward/_validate_backward, and the C++ surface's backend-only rules),
        for cuDNN 9.19 on sm90."""
        phase, kw = self.node
        q, k, v = kw["q"], kw["k"], kw["v"]
        hq, sq, dqk = q.dim[1], q.dim[2], q.dim[3]
        hk, skv, dv = k.dim[1], k.dim[2], v.dim[3]
        align = kw.get("diagonal_alignment")
        left, right = kw.get("diagonal_band_left_bound"), kw.get("diagonal_band_right_bound")
        br_causal = align == Align.BOTTOM_RIGHT and right is not None
        padding, alibi = bool(kw.get("use_padding_mask")), bool(kw.get("use_alibi_mask"))
        bias, dropout = "bias" in kw, "dropout" in kw
        ragged = any(t.ragged is not None for t in (q, k, v))
        rules = [
            (hq % hk != 0, "For group-query attention, number of heads for key and query must be a factor"),
            (alibi and right != 0, "When alibi mask is used, diagonal_band_right_bound needs to be set to 0."),
            (ragged and not padding, "Ragged offsets are only supported with padding mask."),
            (br_causal and not padding and sq > skv, "Bottom right causal mask does not support max_s_q > max_s_kv."),
            (br_causal and (bias or alibi or dropout), "Bottom right causal mask is only supported with "
                                                       "is_bias=False, is_alibi=False, is_dropout=False."),
            (left is not None and not padding and sq > skv, "Sliding window attention is only supported with "
                                                            "max_s_q <= max_s_kv."),
            (left is not None and left <= 0, "Left bound (Sliding window length) should be greater than zero"),
            (dqk % 8 != 0 or dv % 8 != 0, "hidden_dim should be multiple of 8"),
            (phase == "bwd" and sq == 1 and skv == 1, "s_q = s_kv = 1 is not supported."),
            (phase == "bwd" and (dqk > 256 or dv > 256), "Num hidden_dim should be less than or equal to 256"),
            (phase == "fwd" and "sink_token" in kw and sq == 1, "decode only mode, i.e. s_q == 1, not supported "
                                                               "with sink_token"),
        ]
        if "paged_attention_k_table" in kw:  # sdpa_support_surface.h and paged_cache_load.h
            skv, page = kw["paged_attention_max_seq_len_kv"], k.dim[2]
            rules += [
                (not padding, "Paged caches can only be used in combination with padding mask and variable "
                              "sequence lengths"),
                (any(kw[f"paged_attention_{s}_table"].dim[2] != -(-skv // page) for s in "kv"),
                 "Paged cache load: block table size must equal ceil(s_kv/block_size)"),
            ]
        for broken, message in rules:
            if broken:
                raise GraphNotSupported(message)

    def build_operation_graph(self):
        pass

    check_support = build_plans = build_operation_graph

    # --- the internals the engine's raw launch reads (cudnn/_pygraph.py, frontend 1.32) ---
    selected_engine = None
    _plan_index = 0

    @property
    def _plans(self):
        return [types.SimpleNamespace(cpp_index=0)]

    def _materialize_backend_plan(self, index):
        return self._plans[index]

    def get_plan_name_at_index(self, index):
        return "fake_eng0"

    def _caller_tensors(self):
        phase, kw = self.node
        ts = {id(t): t for t in self.tensors}
        ts.update({id(t): t for t in getattr(self, "_outs", [])})
        ts.update({id(t): t for t in kw.get("outs", [])})
        return sorted(ts.values(), key=lambda t: t.uid)

    @property
    def _lowered_graph(self):
        """Offered for dense graphs only: the stand-in re-reads buffers from bare pointers through their declared
        extents, which a ragged tensor does not describe."""
        if any(t.ragged is not None for t in self._caller_tensors()):
            return None
        return types.SimpleNamespace(_execute_with_raw_ptrs=self._execute_with_raw_ptrs)

    def _variant_pack_uids(self):
        return [t.uid for t in self._caller_tensors()]

    def _execute_with_raw_ptrs(self, address, n, workspace, handle, index):
        FakeGraph.raw_executions += 1
        assert handle == FAKE_BACKEND_HANDLE and index == 0 and workspace != 0
        order = self._caller_tensors()
        ptrs = list((ctypes.c_uint64 * n).from_address(address))
        assert n == len(order) and all(ptrs), (n, len(order), ptrs)
        self.execute([_from_pointer(p, t) for p, t in zip(ptrs, order)], None, tensor_uids=[t.uid for t in order])

    def create_execution_plans(self, modes):
        pass

    def deselect_engines(self, names):
        pass

    def get_workspace_size(self):
        return 16

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        FakeGraph.executions += 1
        uid_buf = dict(zip(tensor_uids, buffers)) if tensor_uids is not None else \
            {t.uid: b for t, b in buffers.items()}
        phase, kw = self.node
        with torch.enable_grad():  # the engine's backward runs with grad mode off
            (self._fwd if phase == "fwd" else self._bwd)(kw, uid_buf)

    # --- cuDNN semantics (cudnn-frontend test_mhas.py compute_ref) ---
    def _scores_probs(self, kw, uid_buf, q, k, v, bias):
        b, h, sq, _ = q.shape
        hk, skv = k.shape[1], k.shape[2]
        k = k.repeat_interleave(h // hk, 1)
        v = v.repeat_interleave(h // hk, 1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * kw["attn_scale"]
        if bias is not None:
            s = s + bias
        if kw.get("use_alibi_mask"):
            n = 2 ** math.floor(math.log2(h))
            m = [2 ** (-8 * (i + 1) / n) for i in range(n)] + [2 ** (-4 * (2 * i + 1) / n) for i in range(h - n)]
            dist = torch.arange(skv).view(1, skv) - torch.arange(sq).view(sq, 1)
            s = s + dist.double() * torch.tensor(m, dtype=torch.float64).view(1, h, 1, 1)
        lq = lk = None
        keep = torch.ones(b, 1, sq, skv, dtype=torch.bool)
        i = torch.arange(sq).view(1, 1, sq, 1)
        j = torch.arange(skv).view(1, 1, 1, skv)
        if kw.get("use_padding_mask"):
            lq = uid_buf[kw["seq_len_q"].uid].reshape(-1).long()
            lk = uid_buf[kw["seq_len_kv"].uid].reshape(-1).long()
            keep &= j < lk.view(b, 1, 1, 1)
            keep &= i < lq.view(b, 1, 1, 1)
        if "diagonal_alignment" in kw:
            off = 0
            if kw["diagonal_alignment"] == Align.BOTTOM_RIGHT:
                off = (lk - lq).view(b, 1, 1, 1) if lq is not None else skv - sq
            if kw.get("diagonal_band_right_bound") is not None:
                keep &= j <= i + off + kw["diagonal_band_right_bound"]
            if kw.get("diagonal_band_left_bound") is not None:
                keep &= j > i + off - kw["diagonal_band_left_bound"]
        s = s.masked_fill(~keep, float("-inf"))
        sink = uid_buf[kw["sink_token"].uid].double().view(1, h, 1, 1) if "sink_token" in kw else None
        mx = s.amax(-1, keepdim=True)
        if sink is not None:
            mx = torch.maximum(mx, sink)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        e = torch.exp(s - mx)
        den = e.sum(-1, keepdim=True) + (torch.exp(sink - mx) if sink is not None else 0)
        p = e / den.clamp_min(1e-300)
        stats = torch.where(keep.any(-1, keepdim=True), mx + torch.log(den), torch.full_like(mx, float("-inf")))
        if "dropout" in kw:
            prob = kw["dropout"][0]
            seed = int(uid_buf[kw["dropout"][1].uid].item()) % (2 ** 31)
            g = torch.Generator().manual_seed(seed)
            mask = (torch.rand(b, h, sq, skv, generator=g) >= prob).double()
            p = p * mask / (1 - prob)
            if "rng_dump" in kw:
                uid_buf[kw["rng_dump"].uid].copy_(mask)
        return p, stats, v, lq

    def _fwd(self, kw, uid_buf):
        q, k, v = (_read(uid_buf[kw[n].uid], kw[n], uid_buf) for n in ("q", "k", "v"))
        if "paged_attention_k_table" in kw:  # containers [pages, h, page, d] through [b, 1, P, 1] page tables
            skv = kw["paged_attention_max_seq_len_kv"]
            k, v = (self._paged(c, uid_buf[kw[f"paged_attention_{s}_table"].uid], skv) for c, s in ((k, "k"), (v, "v")))
        bias = uid_buf[kw["bias"].uid].double() if "bias" in kw else None
        p, stats, vv, lq = self._scores_probs(kw, uid_buf, q, k, v, bias)
        o = torch.einsum("bhqk,bhkd->bhqd", p, vv)
        o_t = next(t for t in self.tensors_out() if t.name == "o")
        st_t = next(t for t in self.tensors_out() if t.name == "stats")
        if lq is not None and o_t.ragged is None:  # cuDNN leaves padded rows unspecified: poison them
            pad = torch.arange(o.shape[2]).view(1, 1, -1, 1) >= lq.view(-1, 1, 1, 1)
            o = o.masked_fill(pad, float("nan"))
            stats = stats.masked_fill(pad, float("nan"))
        _write(uid_buf[o_t.uid], o_t, o, uid_buf, lq)
        _write(uid_buf[st_t.uid], st_t, stats, uid_buf, lq)

    @staticmethod
    def _paged(container, table, skv):
        pages = container[table.reshape(table.shape[0], -1).long()]           # [b, P, h, page, d]
        return pages.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :skv]

    def _bwd(self, kw, uid_buf):
        q, k, v = (_read(uid_buf[kw[n].uid], kw[n], uid_buf).requires_grad_() for n in ("q", "k", "v"))
        do = _read(uid_buf[kw["dO"].uid], kw["dO"], uid_buf)
        bias = uid_buf[kw["bias"].uid].double().requires_grad_() if "bias" in kw else None
        sink_t = kw.get("sink_token")
        if sink_t is not None:
            sink = uid_buf[sink_t.uid].double().requires_grad_()
            uid_buf[sink_t.uid] = sink
        p, _, vv, lq = self._scores_probs(kw, uid_buf, q, k, v, bias)
        o = torch.einsum("bhqk,bhkd->bhqd", p, vv)
        if lq is not None:
            o = o.masked_fill(torch.arange(o.shape[2]).view(1, 1, -1, 1) >= lq.view(-1, 1, 1, 1), 0.0)
        inputs = [q, k, v] + ([bias] if bias is not None else []) + ([sink] if sink_t is not None else [])
        grads = torch.autograd.grad(o, inputs, do, allow_unused=True)
        lk = uid_buf[kw["seq_len_kv"].uid].reshape(-1).long() if kw.get("use_padding_mask") else None
        for t, g, lens in zip(kw["outs"], grads[:3], (lq, lk, lk)):
            _write(uid_buf[t.uid], t, g, uid_buf, lens)
        rest = list(grads[3:])
        if bias is not None:
            gb = rest.pop(0)
            if "dBias" in kw:
                uid_buf[kw["dBias"].uid].copy_(gb)
        if sink_t is not None and "dSink_token" in kw:
            uid_buf[kw["dSink_token"].uid].copy_(rest.pop(0))

    def tensors_out(self):
        phase, kw = self.node
        return self._outs


def _fake_cudnn():
    m = types.SimpleNamespace()
    m.__version__ = "1.32.0"
    m.data_type = DT
    m.diagonal_alignment = Align
    m.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    m.backend_version = lambda: 91900
    m.create_handle = lambda: types.SimpleNamespace(backend_handle=FAKE_BACKEND_HANDLE)
    m.set_stream = lambda handle=None, stream=None: None

    class Graph(FakeGraph):
        def sdpa(self, q, k, v, name="", **kw):
            o, st = super().sdpa(q, k, v, name=name, **kw)
            self._outs = [o, st]
            return [o, st]

    m.pygraph = Graph
    return m


@pytest.fixture
def engine(monkeypatch):
    import sys

    fake = _fake_cudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(eng, "_on_device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(eng, "_current_device", lambda: 0)
    monkeypatch.setattr(eng, "_stream", lambda device: 0)
    monkeypatch.setattr(eng, "_require_cuda", lambda q: None)
    monkeypatch.setattr(eng, "_empty_workspace", lambda size, device: torch.empty(size, dtype=torch.uint8))
    monkeypatch.setattr(eng, "IO_DTYPES", (torch.float16, torch.bfloat16, torch.float32))  # float32: exact checks
    return eng.CudnnFrontendEngine()


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------
def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def run(engine, fmt="bshd", mask="no_mask", window=(-1, -1), h=4, hk=4, sq=12, skv=12, d=8, dv=8, bias=None,
        bias_grad=False, alibi=None, softmax="vanilla", lens_q=None, lens_kv=None, gaps=False, seed=0,
        tail=(0, 0), facts=False, padded=False):
    """tail: (q, kv) rows past the last sequence of a thd call; facts: give the host facts (AttnAux.packed) the
    module's validation derives; padded: pass cu_seqlens_*_padded (copies of cu_seqlens unless gaps)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    b = 2
    aux = AttnAux(max_seqlen_q=sq, max_seqlen_kv=skv)
    if fmt == "thd":
        lens_q, lens_kv = lens_q or [sq, sq - 3], lens_kv or [skv - 2, skv]
        slots_q = [n + (2 if gaps else 0) for n in lens_q]
        slots_kv = [n + (3 if gaps else 0) for n in lens_kv]
        t_q, t_kv = sum(slots_q) + tail[0], sum(slots_kv) + tail[1]
        q, k, v = rnd(t_q, h, d), rnd(t_kv, hk, d), rnd(t_kv, hk, dv)
        aux.cu_seqlens_q, aux.cu_seqlens_kv = cu(lens_q), cu(lens_kv)
        aux.max_seqlen_q, aux.max_seqlen_kv = max(lens_q), max(lens_kv)
        if gaps or padded:
            aux.cu_seqlens_q_padded, aux.cu_seqlens_kv_padded = cu(slots_q), cu(slots_kv)
        if facts:
            from attn_dispatch import sequences
            from attn_dispatch.call_args import CallArgs

            args = CallArgs(qkv_format="thd", cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv,
                            cu_seqlens_q_padded=aux.cu_seqlens_q_padded,
                            cu_seqlens_kv_padded=aux.cu_seqlens_kv_padded)
            aux.packed = sequences.packed_facts(sequences.sequence_info("thd", mask, q, k, args), mask, window)
    elif fmt == "bshd":
        q, k, v = rnd(b, sq, h, d), rnd(b, skv, hk, d), rnd(b, skv, hk, dv)
    else:
        q, k, v = rnd(sq, b, h, d), rnd(skv, b, hk, d), rnd(skv, b, hk, dv)
    if mask.startswith("padding") and fmt != "thd":
        aux.cu_seqlens_q, aux.cu_seqlens_kv = cu(lens_q or [sq, sq - 4]), cu(lens_kv or [skv - 1, skv])
    bias_type = "no_bias"
    if bias is not None:
        bias_type = "post_scale_bias"
        aux.bias = rnd(*bias, sq, skv).requires_grad_(bias_grad)
    if alibi is not None:
        bias_type = "alibi"
        if alibi != "default":
            aux.alibi_slopes = torch.rand(h, generator=g) * 0.4 + 0.05
    if softmax == "learnable":
        aux.softmax_offset = rnd(h).requires_grad_()
    for t in (q, k, v):
        t.requires_grad_()
    cfg = AttnConfig(qkv_format=fmt, attn_mask_type=mask, window_size=window, softmax_scale=0.3, bias_type=bias_type,
                     softmax_type=softmax)
    out, lse, _ = engine(q, k, v, aux, cfg)
    dout = rnd(*out.shape)
    out.backward(dout)
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    rbias, rsink = leaf(aux.bias), leaf(aux.softmax_offset)
    slopes = aux.alibi_slopes.double() if aux.alibi_slopes is not None else (
        eng.alibi_default_slopes(h).double() if alibi == "default" else None)
    ref_out, ref_lse = reference_attention(
        rq, rk, rv, qkv_format=fmt, attn_mask_type=mask, window_size=window, cu_seqlens_q=aux.cu_seqlens_q,
        cu_seqlens_kv=aux.cu_seqlens_kv, cu_seqlens_q_padded=aux.cu_seqlens_q_padded,
        cu_seqlens_kv_padded=aux.cu_seqlens_kv_padded, bias_type=bias_type, bias=rbias, alibi_slopes=slopes,
        softmax_type=softmax, softmax_offset=rsink, softmax_scale=0.3)
    ref_out.backward(dout.double())
    err = {"out": _err(out, ref_out), "lse": _err_lse(lse, ref_lse)}
    for name, mine, ref in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
        err[name] = _err(mine.grad, ref.grad)
    if bias_grad:
        err["dbias"] = _err(aux.bias.grad, rbias.grad)
    if softmax == "learnable":
        err["dsink"] = _err(aux.softmax_offset.grad, rsink.grad)
    return err


def _err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(0.1)).item()


def _err_lse(a, b):
    a = a.detach().double()
    if a.shape != b.shape or not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    f = torch.isfinite(b)
    return _err(a[f], b[f])


CASES = {
    "bshd": {}, "sbhd": dict(fmt="sbhd"), "causal": dict(mask="causal"),
    "causal_cross": dict(mask="causal", sq=8, skv=14), "causal_br": dict(mask="causal_bottom_right", sq=8, skv=14),
    "padding": dict(mask="padding"), "padding_causal": dict(mask="padding_causal"),
    "sbhd_padding_causal_br": dict(fmt="sbhd", mask="padding_causal_bottom_right", sq=8, skv=14,
                                   lens_q=[8, 5], lens_kv=[14, 9]),
    "thd": dict(fmt="thd", mask="padding"), "thd_causal": dict(fmt="thd", mask="padding_causal"),
    "thd_br_gqa": dict(fmt="thd", mask="padding_causal_bottom_right", h=4, hk=2, sq=6, skv=10),
    "thd_gaps_dv": dict(fmt="thd", mask="padding_causal", gaps=True, dv=16),
    "window_causal": dict(mask="causal", window=(3, 0)),
    "window_two_sided_padding": dict(mask="padding", window=(2, 3), sq=10, skv=13),
    "window_br": dict(mask="causal_bottom_right", window=(4, 0), sq=8, skv=14),
    "gqa": dict(h=4, hk=1, mask="causal"), "dqk_ne_dv": dict(d=8, dv=16),
    "bias_grad": dict(bias=(1, 4), bias_grad=True), "bias_bhss": dict(bias=(2, 4)), "bias_11ss": dict(bias=(1, 1)),
    "alibi_builtin": dict(mask="causal", alibi="default"), "alibi_slopes": dict(mask="causal", alibi="h"),
    "alibi_cross": dict(mask="causal", alibi="h", sq=8, skv=14),
    "off_by_one": dict(softmax="off-by-one"), "learnable": dict(mask="causal", softmax="learnable"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_plumbing_matches_reference(engine, name):
    err = run(engine, **CASES[name])
    assert all(e <= 1e-5 for e in err.values()), err


class _UnwrittenIsNaN:
    """The engine module's torch, except that fresh float buffers hold NaN: rows cuDNN leaves unwritten show."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.mark.parametrize("facts", [False, True], ids=["facts unknown", "host facts"])
@pytest.mark.parametrize("case", [dict(mask="padding", tail=(3, 2)), dict(mask="padding_causal", tail=(0, 4)),
                                  dict(mask="padding_causal_bottom_right", tail=(2, 0), sq=6, skv=10),
                                  dict(mask="padding_causal", gaps=True, tail=(1, 1)), dict(mask="padding"),
                                  dict(mask="padding", padded=True, tail=(2, 3))],
                         ids=["tails", "kv tail", "q tail br", "gaps and tails", "no tail", "padded offsets, tails"])
def test_thd_rows_past_the_last_sequence_are_zero_with_lse_minus_inf(engine, monkeypatch, case, facts):
    """cuDNN writes only the sequences' rows: out, dq, dk, dv past cu_seqlens[-1] must still be 0 and lse -inf
    (run() compares every row with the reference, where they are; an unwritten row is NaN here)."""
    monkeypatch.setattr(eng, "torch", _UnwrittenIsNaN())
    err = run(engine, fmt="thd", facts=facts, **case)
    assert all(e <= 1e-5 for e in err.values()), err


def test_graphs_are_cached_per_configuration(engine):
    run(engine, mask="causal")
    builds = engine.stats["builds"]
    run(engine, mask="causal", seed=1)
    assert engine.stats["builds"] == builds and engine.stats["hits"] >= 2
    run(engine, mask="causal", sq=16, skv=16)
    assert engine.stats["builds"] == builds + 2  # a new shape: forward and backward graphs


def test_graph_errors_carry_cudnn_message_and_are_recorded(engine, monkeypatch):

    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])

    def refuse(self):
        raise RuntimeError("cudnnGraphNotSupportedError: [cudnn_frontend] No valid engine configs")

    monkeypatch.setattr(FakeGraph, "check_support", refuse)
    q = torch.randn(2, 12, 4, 8, requires_grad=True)
    with pytest.raises(eng.CudnnGraphError, match="No valid engine configs") as info:
        engine(q, q, q, AttnAux(), AttnConfig(softmax_scale=0.3))
    assert info.value.stage == "check_support" and info.value.phase == "fwd"
    assert any("No valid engine configs" in m for m in runtime_facts.current().rejections.values())
    with pytest.raises(eng.CudnnGraphError):  # the failure is cached: no second build attempt
        engine(q, q, q, AttnAux(), AttnConfig(softmax_scale=0.3))


def test_a_cached_refusal_keeps_no_frames_or_tensors_alive(engine, monkeypatch):
    """A refused graph's cached failure must not hold the frames of the call that raised it: they hold the call's
    tensors (GPU memory) and, under context parallelism, its process groups (a gloo group freed at interpreter
    exit aborts the process)."""
    import gc
    import weakref


    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])

    def refuse(self):
        raise RuntimeError("cudnnGraphNotSupportedError: [cudnn_frontend] No valid engine configs")

    monkeypatch.setattr(FakeGraph, "check_support", refuse)

    def refused_call(q):
        try:
            engine(q, q, q, AttnAux(), AttnConfig(softmax_scale=0.3))
        except eng.CudnnGraphError as exc:
            return exc.phase
        return None

    gc.disable()  # only reference counting may free the tensors
    try:
        q = torch.randn(2, 12, 4, 8, requires_grad=True)
        alive = weakref.ref(q)
        assert refused_call(q) == "fwd" and refused_call(q) == "fwd"  # built once, then raised from the cache
        del q
        assert alive() is None
        assert engine._failures and all(f.__traceback__ is None for f in engine._failures.values())
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------------
# The lean call path: raw launch, cached signatures, backward graph built by the forward
# --------------------------------------------------------------------------------------------
def _dense_call(seed=0, requires_grad=True, d=8, **cfg_kw):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 12, 4, d, generator=g).requires_grad_(requires_grad) for _ in range(3))
    return q, k, v, AttnConfig(softmax_scale=0.3, **cfg_kw)


def test_repeat_calls_take_the_raw_fast_path(engine):
    q, k, v, cfg = _dense_call(attn_mask_type="causal")
    out1, lse1, _ = engine(q, k, v, AttnAux(), cfg)
    out1.sum().backward()
    grads1 = [t.grad.clone() for t in (q, k, v)]
    assert {key.phase: c.path for key, c in engine._graphs.items()} == {"fwd": "raw", "bwd": "raw"}
    builds, raw = engine.stats["builds"], FakeGraph.raw_executions
    for t in (q, k, v):
        t.grad = None
    out2, lse2, _ = engine(q, k, v, AttnAux(), cfg)
    out2.sum().backward()
    assert engine.stats["builds"] == builds and FakeGraph.raw_executions == raw + 2
    (fast,) = engine._fast.values()
    assert len(fast.bwd) == 1
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads1, (q, k, v)))
    ref, _ = reference_attention(*(t.detach().double() for t in (q, k, v)), attn_mask_type="causal", softmax_scale=0.3)
    assert _err(out2, ref) <= 1e-5


def test_ragged_graphs_and_the_ordered_path_give_the_same_results(engine):
    run(engine, fmt="thd", mask="padding")
    assert {c.path for key, c in engine._graphs.items() if key.ragged} == {"ordered"}
    ordered = eng.CudnnFrontendEngine(execute_path="ordered")
    q, k, v, cfg = _dense_call(requires_grad=False, attn_mask_type="causal_bottom_right")
    a = engine.forward(q, k, v, AttnAux(), cfg).out
    b = ordered.forward(q, k, v, AttnAux(), cfg).out
    assert torch.equal(a, b) and {c.path for c in ordered._graphs.values()} == {"ordered"}
    with pytest.raises(ValueError, match="execute_path='fast'"):
        eng.CudnnFrontendEngine(execute_path="fast")


def test_forward_reports_a_backward_cuDNN_refuses(engine, monkeypatch):

    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])
    q, k, v, cfg = _dense_call(d=264)
    ran = FakeGraph.executions
    with pytest.raises(eng.CudnnGraphError, match="less than or equal to 256") as info:
        engine(q, k, v, AttnAux(), cfg)
    assert info.value.phase == "bwd" and FakeGraph.executions == ran  # refused before any kernel ran
    assert any(sig[-1] == "bwd" for sig in runtime_facts.current().rejections)
    out, _, _ = engine(*(t.detach() for t in (q, k, v)), AttnAux(), cfg)  # inference needs no backward graph
    assert out.shape == (2, 12, 4, 264)


def test_dropout_uses_the_callers_seed(engine):
    q, k, v, cfg = _dense_call(requires_grad=False, dropout_p=0.3)

    def fwd(seed, dtype=torch.int64):
        aux = AttnAux(extra={"dropout_seed": torch.tensor(seed, dtype=dtype)})
        return engine.forward(q, k, v, aux, cfg).out

    assert torch.equal(fwd([5, 0]), fwd([5, 0])) and not torch.equal(fwd([5, 0]), fwd([6, 0]))
    with pytest.raises(ValueError, match=r"aux.extra\['dropout_seed'\]"):
        fwd([5, 0], torch.float32)


def test_backward_packs_a_strided_lse(engine):
    q, k, v, cfg = _dense_call(attn_mask_type="causal")
    res = engine.forward(q, k, v, AttnAux(), cfg)
    dout = torch.randn_like(res.out)
    expected = engine.backward(dout, q, k, v, res.out, res.lse, res.state, AttnAux(), cfg)
    builds = engine.stats["builds"]
    strided = torch.empty(2, 12, 4).transpose(1, 2).copy_(res.lse)   # [b, h, s] with the s dim outermost
    got = engine.backward(dout, q, k, v, res.out, strided, res.state, AttnAux(), cfg)
    assert engine.stats["builds"] == builds  # the same packed-stats graph
    assert all(torch.equal(a, b) for a, b in zip(expected[:3], got[:3]))


# --------------------------------------------------------------------------------------------
# The table against cuDNN's own validation (transcribed in FakeGraph.validate), on the H100 of the device machine
# --------------------------------------------------------------------------------------------
def _h100():
    from attn_dispatch import Platform

    return Platform.parse("h100-cudnn9")


def _frontend_table():
    from attn_dispatch.constraints import TABLES

    return TABLES["cudnn_fused:frontend"]


def _no_env():
    from attn_dispatch import EnvFlags

    return EnvFlags()


def _attempt(engine, params) -> str | None:
    """Run params through the engine on the stand-in: None when cuDNN's checks pass, else the message."""
    from attn_dispatch.synthetic import make_call

    call = make_call(params, device="cpu", requires_grad=params.is_training)
    try:
        out, _, _ = engine(call.q, call.k, call.v, call.aux, call.cfg)
        if params.is_training:
            out.float().sum().backward()
    except eng.CudnnGraphError as exc:
        return exc.cudnn_message
    return None


CUDNN_RULE_CODES = {"cudnn_fused.diagonal_band", "cudnn_fused.backward_single_token", "cudnn_fused.decode_sink"}


@pytest.mark.parametrize("kw", [
    dict(attn_mask_type="causal_bottom_right", bias_type="alibi", alibi_slopes_shape="bh", max_seqlen_kv=256),
    dict(attn_mask_type="causal_bottom_right", bias_type="post_scale_bias", bias_shape="1hss", max_seqlen_kv=256),
    dict(attn_mask_type="causal_bottom_right", dropout=0.1, max_seqlen_kv=256),
    dict(attn_mask_type="padding_causal_bottom_right", bias_type="post_scale_bias", bias_shape="11ss"),
    dict(attn_mask_type="no_mask", window_size=(-1, 0), dropout=0.1, max_seqlen_kv=192),
    dict(max_seqlen_q=1, max_seqlen_kv=1),
    dict(softmax_type="off-by-one", max_seqlen_q=1, max_seqlen_kv=64, is_training=False),
])
def test_cudnn_refusals_are_declared(engine, kw):
    from attn_dispatch import AttentionParams

    p = AttentionParams(**{**dict(dtype="bf16", batch_size=2, num_heads=4, head_dim_qk=64, max_seqlen_q=128), **kw})
    reasons = {r.code for r in _frontend_table().evaluate(p, _h100(), _no_env()).reasons}
    assert reasons & CUDNN_RULE_CODES, reasons
    assert _attempt(engine, p) is not None


def test_table_is_exact_on_the_probe_configurations(engine, monkeypatch):
    """Every boundary configuration of the probe: declared eligible => cuDNN's checks pass; declared rejected by a
    rule transcribed from cuDNN's validation => they fail. (Graphs are built, not executed: results are checked
    by the plumbing tests above.)"""
    from attn_dispatch.probe import boundary_configs

    monkeypatch.setattr(FakeGraph, "execute", lambda self, *args, **kwargs: None)

    table, plat, wrong = _frontend_table(), _h100(), []
    for p in boundary_configs("cuda"):
        verdict = table.evaluate(p, plat, _no_env())
        codes = {r.code for r in verdict.reasons}
        if not verdict.eligible and not codes <= CUDNN_RULE_CODES:
            continue  # rejected by a rule the stand-in does not model (versions, dtypes, TE's own limits)
        message = _attempt(engine, p)
        if verdict.eligible != (message is None):
            wrong.append(f"{p.describe()}: declared {sorted(codes) or 'eligible'}, cuDNN: {message or 'accepts'}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("kw", [
    dict(attn_mask_type="causal"),
    dict(qkv_format="thd", attn_mask_type="padding_causal", num_gqa_groups=2),
    dict(attn_mask_type="causal", bias_type="alibi", alibi_slopes_shape="bh", max_seqlen_kv=256),
    dict(bias_type="post_scale_bias", bias_shape="1hss", bias_requires_grad=True),
    dict(dropout=0.1, deterministic=True),
    dict(softmax_type="learnable", qkv_format="sbhd"),
])
def test_a_refused_graph_excludes_the_call_in_the_live_table(engine, monkeypatch, kw):
    """What DotProductAttention relies on to fall back: the signature the engine records for a refused graph is the
    one the table computes from the call's AttentionParams, so `cudnn_rejected` rejects exactly that call."""
    from attn_dispatch import AttentionParams

    monkeypatch.setattr(runtime_facts, "_CURRENT", [runtime_facts.RuntimeFacts()])

    def refuse(self):
        raise GraphNotSupported("no engine for this graph")

    monkeypatch.setattr(FakeGraph, "validate", refuse)
    p = AttentionParams(**{**dict(dtype="bf16", batch_size=2, num_heads=4, head_dim_qk=64, max_seqlen_q=128), **kw})
    assert _attempt(engine, p) is not None
    live = dataclasses.replace(_h100(), facts=runtime_facts.current(), name="live")
    reasons = {r.code: r.message for r in _frontend_table().evaluate(p, live, _no_env()).reasons}
    assert "no engine for this graph" in reasons.get("cudnn_fused.cudnn_rejected", ""), reasons
    assert "cudnn_fused.cudnn_rejected" not in {r.code for r in _frontend_table().evaluate(
        p.replace(head_dim_qk=128, head_dim_v=128), live, _no_env()).reasons}


def test_a_repeat_thd_call_derives_nothing_from_cu_seqlens_on_the_device(engine, monkeypatch):
    """Lengths and ragged offsets are made once per cu_seqlens tensor (a model's layers share one); with the host
    facts showing no tail, nothing is filled either: what runs besides the graph is allocation and views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        ops, paused = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    log = OpLog()
    graph_run = eng.CudnnFrontendEngine._run

    def run_paused(self, *args):
        log.paused = True
        try:
            return graph_run(self, *args)
        finally:
            log.paused = False

    monkeypatch.setattr(eng.CudnnFrontendEngine, "_run", run_paused)
    q, k, v = (torch.randn(21, 4, 8) for _ in range(3))
    aux = AttnAux(cu_seqlens_q=cu([12, 9]), cu_seqlens_kv=cu([12, 9]), max_seqlen_q=12, max_seqlen_kv=12)
    cfg = AttnConfig(qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=0.3)
    for packed, expected_fills in ((PackedFacts(21, 21, False), 0), (None, 2)):
        aux.packed = packed
        engine.forward(q, k, v, aux, cfg)  # first call: graph built, derived tensors made
        log.ops = []
        with log:
            res = engine.forward(q, k, v, aux, cfg)
        assert not {"sub", "mul", "_to_copy", "masked_fill", "arange"} & set(log.ops), log.ops
        assert log.ops.count("fill_") + log.ops.count("full") == expected_fills, log.ops  # unknown end: out, lse
    ref, _ = reference_attention(q.double(), k.double(), v.double(), qkv_format="thd", attn_mask_type="padding_causal",
                                 cu_seqlens_q=aux.cu_seqlens_q, cu_seqlens_kv=aux.cu_seqlens_kv, softmax_scale=0.3)
    assert _err(res.out, ref) <= 1e-5


def test_a_training_forward_prebuilds_its_backward_graph_once_per_configuration(engine, monkeypatch):
    made = []
    meta_like = eng._meta_like
    monkeypatch.setattr(eng, "_meta_like", lambda t: made.append(1) or meta_like(t))
    for seed in range(2):
        assert all(e <= 1e-5 for e in run(engine, fmt="thd", mask="padding_causal", seed=seed).values())
    assert len(made) == 4  # dO, dq, dk, dv described once
    err = run(engine, fmt="thd", mask="padding_causal", lens_q=[5, 9], lens_kv=[5, 9])  # other totals: other graphs
    assert all(e <= 1e-5 for e in err.values()) and len(made) == 8
