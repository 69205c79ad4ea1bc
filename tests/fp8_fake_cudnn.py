"""A stand-in `cudnn` module for the FP8 engine's CPU tests: it records the FP8 graphs the engine declares and
executes them with the semantics of cuDNN's per-tensor FP8 SDPA as cudnn-frontend's own reference states them
(test/python/sdpa/fp8_ref.py): S = (Q descale_q)(K descale_k)^T attn_scale; the unnormalised probabilities
exp(S - rowmax) are quantized with scale_s (E4M3) and dequantized with descale_s before P V; O = P V / rowsum is
written as FP8 with scale_o; amax_s and amax_o are those of the probabilities and of O before quantization.
Backward recomputes P from the stats, quantizes the softmax gradient dS with scale_dP, and writes dQ, dK, dV in
the output type with their scales; the amaxes are those before quantization. Everything in float64 on the CPU.

It also runs the bf16 graph the FP8 engine hands its backward to under NVTE_FP8_DPA_BWD=0 (cudnn-frontend
`sdpa_backward`, as the bf16 engine declares it: a top-left diagonal band for causal masks, sequence lengths for
padding, ragged offsets for thd): P recomputed from the given stats, no quantization anywhere.
"""
from __future__ import annotations

import enum
import types

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class DT(enum.Enum):
    HALF = "half"
    BFLOAT16 = "bf16"
    FLOAT = "float"
    INT32 = "int32"
    INT64 = "int64"
    FP8_E4M3 = "e4m3"
    FP8_E5M2 = "e5m2"


TORCH_OF = {DT.HALF: torch.float16, DT.BFLOAT16: torch.bfloat16, DT.FLOAT: torch.float32, DT.INT32: torch.int32,
            DT.FP8_E4M3: torch.float8_e4m3fn, DT.FP8_E5M2: torch.float8_e5m2}


class Align(enum.Enum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class Rejected(Exception):
    pass


class T:
    def __init__(self, name="", dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type, self.output = name, list(dim or []), list(stride or []), \
            data_type, False
        self.ragged = None

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

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


def quant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Saturating FP8 quantization, back in float64 (the value cuDNN multiplies with)."""
    return (x * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).double()


class Graph:
    builds = 0
    executions = 0
    refuse: set = set()  # phases the stand-in refuses at check_support: FP8 'fwd' / 'bwd', bf16 'bwd16'
    ran: list = []       # the phases executed, in order

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None):
        self.node = None

    def tensor(self, name="", dim=None, stride=None, data_type=None):
        return T(name, dim, stride, data_type)

    def sdpa_fp8(self, q, k, v, **kw):
        self.node = ("fwd", dict(kw, q=q, k=k, v=v))
        self.outs = [T("o"), T("stats"), T("amax_s"), T("amax_o")]
        return self.outs

    def sdpa_fp8_backward(self, q, k, v, o, dO, stats, **kw):
        self.node = ("bwd", dict(kw, q=q, k=k, v=v, o=o, dO=dO, stats=stats))
        self.outs = [T(n) for n in ("dq", "dk", "dv", "amax_dq", "amax_dk", "amax_dv", "amax_dp")]
        return self.outs

    def sdpa_backward(self, q, k, v, o, dO, stats, **kw):
        self.node = ("bwd16", dict(kw, q=q, k=k, v=v, o=o, dO=dO, stats=stats))
        self.outs = [T(n) for n in ("dq", "dk", "dv")]
        return self.outs

    def validate(self):
        for t in self.outs:
            assert t.output and t.dim and t.stride and t.data_type is not None, f"output {t.name} left undeclared"

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        if self.node[0] in Graph.refuse:
            raise Rejected(f"stand-in refuses the FP8 {self.node[0]} graph")

    def build_plans(self):
        Graph.builds += 1

    def get_workspace_size(self):
        return 0

    # --- execution ---
    def execute(self, buffers, workspace, handle=None):
        Graph.executions += 1
        by = {id(t): b for t, b in buffers.items()}
        phase, kw = self.node
        Graph.ran.append(phase)

        def element_index(t, b, rows):
            """Flat element indices of batch b's first `rows` rows of a [b, h, S, d] tensor (ragged: from its
            offset; else from the batch stride)."""
            _, h, _, d = t.dim
            _, sh, ss, sd = t.stride
            start = int(by[id(t.ragged)].reshape(-1)[b]) if t.ragged is not None else b * t.stride[0]
            grid = torch.arange(h).view(h, 1, 1) * sh + torch.arange(rows).view(1, rows, 1) * ss \
                + torch.arange(d).view(1, 1, d) * sd
            return start + grid

        def read(t):
            buf = by[id(t)]
            assert buf.dtype == TORCH_OF[t.data_type], f"{t.name}: buffer {buf.dtype}, graph {t.data_type}"
            if t.ragged is None:
                return torch.as_strided(buf, t.dim, t.stride, buf.storage_offset()).double()
            flat = buf.reshape(-1).double()
            out = torch.zeros(t.dim, dtype=torch.float64)
            for b in range(t.dim[0]):  # rows past the buffer's end (the last sequences' padding) read as 0
                idx = element_index(t, b, t.dim[2])
                inside = idx < flat.numel()
                out[b][inside] = flat[idx[inside]]
            return out

        def scalar(name):
            if phase == "bwd16":  # the bf16 graph has no scales
                return 1.0
            return float(by[id(kw[name])].reshape(-1)[0])

        def write(t, value, lens_name="seq_len_q"):
            buf = by[id(t)]
            assert buf.dtype == TORCH_OF[t.data_type], f"{t.name}: buffer {buf.dtype}, graph {t.data_type}"
            if buf.dtype in FP8_MAX:
                value = value.clamp(-FP8_MAX[buf.dtype], FP8_MAX[buf.dtype])
            if t.ragged is None:
                torch.as_strided(buf, t.dim, t.stride, buf.storage_offset()).copy_(value.to(buf.dtype))
                return
            lens = by[id(kw[lens_name])].reshape(-1)  # a sequence's own rows only
            raw = buf.view(torch.uint8) if buf.dtype in FP8_MAX else buf
            flat = raw.reshape(-1)
            for b in range(t.dim[0]):
                rows = int(lens[b])
                data = value[b, :, :rows].to(buf.dtype)
                flat[element_index(t, b, rows).reshape(-1)] = (data.view(torch.uint8) if buf.dtype in FP8_MAX
                                                               else data).reshape(-1)

        q = read(kw["q"]) * scalar("descale_q")
        k = read(kw["k"]) * scalar("descale_k")
        v = read(kw["v"]) * scalar("descale_v")
        h, hkv = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        b, _, sq, _ = q.shape
        skv = k.shape[2]
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * kw["attn_scale"]
        mask = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
        if kw.get("use_causal_mask"):
            mask |= torch.ones(sq, skv, dtype=torch.bool).triu(1)
        if "diagonal_alignment" in kw:  # the bf16 graph's band: keys j with i - left_bound < j <= i + right_bound
            assert kw["diagonal_alignment"] == Align.TOP_LEFT, "the FP8 masks are top-left"
            i, j = torch.arange(sq).view(sq, 1), torch.arange(skv).view(1, skv)
            if kw.get("diagonal_band_right_bound") is not None:
                mask |= j > i + kw["diagonal_band_right_bound"]
            if kw.get("diagonal_band_left_bound") is not None:
                mask |= j <= i - kw["diagonal_band_left_bound"]
        rows_pad = torch.zeros(b, 1, sq, 1, dtype=torch.bool)
        if kw.get("use_padding_mask"):
            lq = by[id(kw["seq_len_q"])].reshape(-1).long()
            lk = by[id(kw["seq_len_kv"])].reshape(-1).long()
            mask |= torch.arange(skv).view(1, 1, 1, skv) >= lk.view(b, 1, 1, 1)
            rows_pad = torch.arange(sq).view(1, 1, sq, 1) >= lq.view(b, 1, 1, 1)
            mask |= rows_pad
        s = s.masked_fill(mask, float("-inf"))
        if phase == "fwd":
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m).nan_to_num(0.0)
            l_sum = p.sum(-1, keepdim=True)
            pq = quant(p, scalar("scale_s"), torch.float8_e4m3fn) * scalar("descale_s")
            o = torch.einsum("bhqk,bhkd->bhqd", pq, v) / l_sum.clamp(min=1e-300)
            o = o.masked_fill(rows_pad, 0.0)
            o_t, stats_t, amax_s_t, amax_o_t = self.outs
            write(o_t, o * scalar("scale_o"))
            write(stats_t, (m + torch.log(l_sum)).masked_fill(rows_pad, float("-inf")))
            write(amax_s_t, (p / l_sum.clamp(min=1e-300)).amax().reshape(1, 1, 1, 1))  # normalised, as cuDNN 9.19
            write(amax_o_t, o.abs().amax().reshape(1, 1, 1, 1))
            return
        o = read(kw["o"]) * scalar("descale_o")
        do = read(kw["dO"]) * scalar("descale_dO")
        stats = read(kw["stats"])
        p = torch.exp(s - stats).nan_to_num(0.0)
        dp = torch.einsum("bhqd,bhkd->bhqk", do, v)
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if phase == "bwd16":
            dq = torch.einsum("bhqk,bhkd->bhqd", ds, k) * kw["attn_scale"]
            dk = torch.einsum("bhqk,bhqd->bhkd", ds, q).unflatten(1, (hkv, h // hkv)).sum(2) * kw["attn_scale"]
            dv = torch.einsum("bhqk,bhqd->bhkd", p, do).unflatten(1, (hkv, h // hkv)).sum(2)
            for t, g in zip(self.outs, (dq, dk, dv)):
                write(t, g, "seq_len_q" if t is self.outs[0] else "seq_len_kv")
            return
        bwd_dtype = TORCH_OF[kw["dO"].data_type]
        dsq = quant(ds, scalar("scale_dP"), bwd_dtype) * scalar("descale_dP")
        pq = quant(p, scalar("scale_s"), torch.float8_e4m3fn) * scalar("descale_s")
        dq = torch.einsum("bhqk,bhkd->bhqd", dsq, k) * kw["attn_scale"]
        dk = torch.einsum("bhqk,bhqd->bhkd", dsq, q) * kw["attn_scale"]
        dv = torch.einsum("bhqk,bhqd->bhkd", pq, do)
        dk = dk.unflatten(1, (hkv, h // hkv)).sum(2)
        dv = dv.unflatten(1, (hkv, h // hkv)).sum(2)
        dq_t, dk_t, dv_t, a_dq, a_dk, a_dv, a_dp = self.outs
        for t, g, scale in ((dq_t, dq, "scale_dQ"), (dk_t, dk, "scale_dK"), (dv_t, dv, "scale_dV")):
            write(t, g * scalar(scale))
        for t, g in ((a_dq, dq), (a_dk, dk), (a_dv, dv), (a_dp, ds)):
            write(t, g.abs().amax().reshape(1, 1, 1, 1))


def fake_cudnn():
    m = types.SimpleNamespace()
    m.__version__ = "1.32.0"
    m.data_type = DT
    m.diagonal_alignment = Align
    m.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    m.backend_version = lambda: 91900
    m.create_handle = lambda: types.SimpleNamespace(backend_handle=None)
    m.set_stream = lambda handle=None, stream=None: None
    m.pygraph = Graph
    return m
