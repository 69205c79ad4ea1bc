"""cuDNN's per-tensor FP8 attention through cudnn-frontend graphs (`sdpa_fp8`, `sdpa_fp8_backward`): the engine of
provider `cudnn_fused:fp8`, Transformer Engine's fused-attention sub-backend 2 with `fp8_dpa`.

A call (inside `fp8_autocast` with `fp8_dpa=True`; the module passes its FP8 scaling state in `aux.extra["fp8"]`):
- forward: q, k, v (bf16/fp16) are quantized to E4M3 with their per-tensor scales (delayed: from the amax
  history; current: from their own amax now), their amaxes recorded; cuDNN runs attention in FP8, quantizing the
  softmax probabilities with the S scale and writing O in E4M3 with the O scale, and reports the amaxes of S and O
  into the history; O comes back dequantized to the input dtype (or as a Float8Output with fp8_output). The
  forward scales are then updated for the next call.
- backward: dO is quantized (E5M2 under HYBRID, E4M3 under E4M3); cuDNN computes dQ, dK, dV in that dtype from the
  saved FP8 q, k, v, O and softmax stats, reporting the amaxes of dQ, dK, dV and of the softmax gradient dP; the
  gradients come back dequantized. Then the backward scales are updated.
- backward with NVTE_FP8_DPA_BWD=0 (Transformer Engine's meaning: FusedAttnFunc runs its F16 fused backward then):
  the bf16 cuDNN engine (cudnn_fused.CudnnFrontendEngine) runs the backward on the caller's own q, k, v, the
  dequantized O and the FP8 forward's softmax stats (the same log-sum-exp of the scaled scores, in the layout the
  bf16 forward writes: [b, h, s, 1], thd ragged [t, h]). dO is not quantized and the backward scaling columns (do,
  dp, dq, dk, dv) are left alone. What autograd keeps is then q, k, v (held by the graph that made them anyway), O
  and the stats; no FP8 copies.
On Hopper cuDNN 9.19 writes O and dQ, dK, dV only in FP8 (a bf16 output is Blackwell-only: "sdpa fp8 forward with
HALF/BFLOAT16 output is only supported on Blackwell", seen on the H100), hence the dequantization passes. What
the autograd graph keeps for backward is the FP8 q, k, v and O (half the bytes of bf16) and the stats.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..env import EnvFlags
from ..fp8 import quantize as fp8q
from ..fp8.output import Float8Output
from ..runtime_facts import record_rejection
from ..fp8.state import BACKWARD, FORWARD, INDEX, FP8ScalingState
from . import cudnn_fused as _cd
from ._cudnn_graph import CudnnGraphError, build_graph, contiguous_strides
from .base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult
from ..constraints.cudnn_common import rejection_signature
from ..params import AttentionParams

E4M3 = torch.float8_e4m3fn
GRAPH_CACHE_SIZE = 256
_FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
# the state slot and the scale vector (forward's saved one or backward's) each scalar is read from
_SCALAR_SOURCE = {"descale_q": ("q", "fwd"), "descale_k": ("k", "fwd"), "descale_v": ("v", "fwd"),
                  "descale_s": ("s", "fwd"), "scale_s": ("s", "fwd"), "scale_o": ("o", "fwd"),
                  "descale_o": ("o", "fwd"), "descale_dO": ("do", "bwd"), "descale_dP": ("dp", "bwd"),
                  "scale_dQ": ("dq", "bwd"), "scale_dK": ("dk", "bwd"), "scale_dV": ("dv", "bwd"),
                  "scale_dP": ("dp", "bwd")}


@dataclass
class FP8Call:
    """What the module hands the engine for one FP8 call (aux.extra['fp8'])."""
    state: FP8ScalingState
    group: Any = None          # torch.distributed group the amaxes are reduced over (fp8_autocast's fp8_group)
    output_fp8: bool = False   # return O as a Float8Output
    # context parallelism: the group FP8 data is exchanged over (current scaling agrees on q, k, v, dO scales there)
    exchange_group: Any = None
    # the backward in FP8 (True) or on the bf16 engine (False); None: NVTE_FP8_DPA_BWD as set at the forward, which
    # is when Transformer Engine reads it
    backward_fp8: bool | None = None

    def fp8_backward(self) -> bool:
        return EnvFlags.from_environ().fp8_dpa_bwd if self.backward_fp8 is None else self.backward_fp8


@dataclass(frozen=True)
class _Key:
    phase: str                 # 'fwd' | 'bwd'
    device: int
    b: int
    h: int
    hkv: int
    sq: int
    skv: int
    dqk: int
    dv: int
    layout: str                # 'bshd' | 'sbhd': the quantized tensors are contiguous in this layout
    padding: bool
    causal: bool
    scale: float
    deterministic: bool
    bwd_dtype: torch.dtype     # dO, dQ, dK, dV
    offsets_int64: bool = False  # thd: ragged offsets in int64 (cuDNN >= 9.5), else int32


@dataclass
class _Built:
    graph: Any
    tensors: dict              # name -> graph tensor
    workspace: int


@dataclass
class _Saved:
    """What backward needs from forward."""
    key: _Key
    call: Any                  # cudnn_fused._Call (lengths of a padded call)
    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    o8: torch.Tensor
    stats: torch.Tensor
    scales: torch.Tensor       # the forward's scale vector [10] and its reciprocal
    descales: torch.Tensor
    dtype: torch.dtype         # q's dtype: what the gradients are returned in
    fp8: FP8Call


@dataclass
class _F16Saved:
    """What a backward on the bf16 engine needs from an FP8 forward (NVTE_FP8_DPA_BWD=0); q, k, v and O travel
    through autograd's saved tensors."""
    call: Any                  # cudnn_fused._Call
    stats: torch.Tensor        # the FP8 forward's softmax stats ([b, h, s, 1]; thd: ragged [t, h])
    device: int


def _bhsd_strides(layout: str, b: int, s: int, h: int, d: int) -> list[int]:
    """[b, h, s, d] strides of a tensor contiguous in `layout`; thd: of a packed [t, h, d] tensor read through
    ragged offsets (the batch stride spans the graph's S tokens, as the bf16 engine declares it)."""
    if layout in ("bshd", "thd"):
        return [s * h * d, d, h * d, 1]
    return [h * d, d, b * h * d, 1]  # sbhd


def _empty(call: Any, h: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """O for a call; thd rows outside every sequence are zeroed (cuDNN writes only the sequences' own rows)."""
    if call.fmt == "thd":
        return _cd._thd_buffer(None, (call.t_q, h, d), dtype, device, call.end_q, call.gaps, 0.0)
    shape = (call.b, call.sq, h, d) if call.fmt == "bshd" else (call.sq, call.b, h, d)
    return torch.empty(shape, dtype=dtype, device=device)


def _ragged_offsets(call: Any, key: _Key) -> dict[str, torch.Tensor]:
    """thd: the ragged offset buffers the forward graph declares (_build's `ragged`): cu_seqlens_padded x the
    token stride of each operand, and x heads for the [t, h] stats."""
    itype = torch.int64 if key.offsets_int64 else torch.int32
    out = {"off_stats": _cd._ragged_offsets(call.cu_q_pad, itype, call.h, call.capturing)}
    for side, cu, heads in (("q", call.cu_q_pad, call.h), ("kv", call.cu_kv_pad, call.hkv)):
        for d in (call.dqk, call.dv):
            out[f"off_{side}_{heads * d}"] = _cd._ragged_offsets(cu, itype, heads * d, call.capturing)
    return out


def _fp8_of(aux: AttnAux) -> FP8Call:
    fp8 = aux.extra.get("fp8")
    if not isinstance(fp8, FP8Call):
        raise ValueError("cudnn_fused:fp8 runs FP8 calls only: call the module inside attn_dispatch.fp8_autocast "
                         "with a recipe whose fp8_dpa=True (aux.extra['fp8'] is missing)")
    return fp8


def quantize(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], fp8: FP8Call) -> list[torch.Tensor]:
    """The FP8 data of q, k, v (or dO) with the state's scales, their amaxes recorded in the history's row 0.
    Current scaling scales each by its own amax now: the max over fp8.exchange_group when the data crosses
    ranks (context parallelism), so that every rank quantizes with the same scale."""
    st = fp8.state.to(tensors[0].device)
    if st.recipe.kind != "current":
        return [fp8q.quantize(x, st.scale_of(n), st.dtypes[n], amax_into=st.amax_slot(n))
                for n, x in zip(names, tensors)]
    amaxes = torch.cat([fp8q.amax(x) for x in tensors])
    if fp8.exchange_group is not None:
        import torch.distributed as dist

        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=fp8.exchange_group)
    out = []
    for i, (n, x) in enumerate(zip(names, tensors)):
        st.amax_slot(n).copy_(amaxes[i:i + 1])
        out.append(fp8q.quantize(x, st.current_scale(n, amaxes[i:i + 1]), st.dtypes[n]))
    return out


class CudnnFP8Engine(Engine):
    family = "cudnn_fused"
    provider = "fp8"

    def __init__(self) -> None:
        import cudnn  # noqa: PLC0415 - lazy: the package is optional

        self.cudnn = cudnn
        self._graphs: OrderedDict[_Key, _Built] = OrderedDict()
        self._failures: dict[_Key, CudnnGraphError] = {}
        self._devices: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.stats = {"builds": 0, "hits": 0, "build_seconds": 0.0}
        self._f16: _cd.CudnnFrontendEngine | None = None

    def f16_engine(self) -> _cd.CudnnFrontendEngine:
        """The bf16 cuDNN engine that runs the backward under NVTE_FP8_DPA_BWD=0 (made on first use)."""
        if self._f16 is None:
            self._f16 = _cd.CudnnFrontendEngine()
        return self._f16

    # --- graphs -----------------------------------------------------------------------------------------
    def _device(self, index: int):
        state = self._devices.get(index)
        if state is None:
            with self._lock:
                state = self._devices.get(index) or _cd._DeviceState(self.cudnn, index)
                self._devices[index] = state
        return state

    def graph(self, key: _Key, signature: Callable[[], tuple]) -> _Built:
        """The built graph for key; signature() (the table's rejection signature, asked only on a refusal: building
        it costs an AttentionParams per call) records what cuDNN refused."""
        built = self._graphs.get(key)
        if built is not None:
            self.stats["hits"] += 1
            return built
        failure = self._failures.get(key)
        if failure is None:
            start = time.perf_counter()
            try:
                with _cd._on_device(key.device):
                    built = self._build(key, self._device(key.device).handle)
            except CudnnGraphError as exc:
                failure = self._failures[key] = exc.fresh()
            else:
                self.stats["builds"] += 1
                self.stats["build_seconds"] += time.perf_counter() - start
                with self._lock:
                    self._graphs[key] = built
                    while len(self._graphs) > GRAPH_CACHE_SIZE:
                        self._graphs.popitem(last=False)
                return built

        record_rejection(signature(), failure.cudnn_message)  # the table excludes this signature from now on
        raise failure.fresh()

    def _build(self, key: _Key, handle: Any) -> _Built:
        c = self.cudnn
        f32, i32 = c.data_type.FLOAT, c.data_type.INT32
        dt = {E4M3: c.data_type.FP8_E4M3, torch.float8_e5m2: c.data_type.FP8_E5M2}
        g = c.pygraph(io_data_type=c.data_type.FP8_E4M3, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
        tensors: dict[str, Any] = {}

        def offsets(name: str) -> Any:
            if name not in tensors:
                tensors[name] = g.tensor(name=name, dim=[key.b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                         data_type=c.data_type.INT64 if key.offsets_int64 else i32)
            return tensors[name]

        def ragged(name: str, t: Any, h: int, d: int) -> None:
            """thd: where each sequence of `name` starts, in elements (cu_seqlens_padded x the token stride)."""
            if key.layout == "thd":
                t.set_ragged_offset(offsets(f"off_{'kv' if name in ('k', 'v', 'dk', 'dv') else 'q'}_{h * d}"))

        def operand(name: str, s: int, h: int, d: int, dtype: Any) -> Any:
            t = g.tensor(name=name, dim=[key.b, h, s, d], stride=_bhsd_strides(key.layout, key.b, s, h, d),
                         data_type=dtype)
            ragged(name, t, h, d)
            tensors[name] = t
            return t

        def small(name: str, dims: list[int], dtype: Any) -> Any:
            t = g.tensor(name=name, dim=dims, stride=contiguous_strides(dims), data_type=dtype)
            tensors[name] = t
            return t

        def output(name: str, t: Any, s: int, h: int, d: int, dtype: Any) -> None:
            t.set_output(True).set_dim([key.b, h, s, d]).set_stride(_bhsd_strides(key.layout, key.b, s, h, d)) \
                .set_data_type(dtype)
            ragged(name, t, h, d)
            tensors[name] = t

        def scalar_out(name: str, t: Any) -> None:
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
            tensors[name] = t

        e4m3 = c.data_type.FP8_E4M3
        q = operand("q", key.sq, key.h, key.dqk, e4m3)
        k = operand("k", key.skv, key.hkv, key.dqk, e4m3)
        v = operand("v", key.skv, key.hkv, key.dv, e4m3)
        kw: dict[str, Any] = {"attn_scale": key.scale}
        if key.causal:
            kw["use_causal_mask"] = True
        if key.padding:
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = small("seq_len_q", [key.b, 1, 1, 1], i32)
            kw["seq_len_kv"] = small("seq_len_kv", [key.b, 1, 1, 1], i32)
        stats_dims, stats_strides = [key.b, key.h, key.sq, 1], [key.h * key.sq, key.sq, 1, 1]
        if key.layout == "thd":  # ragged [t, h] stats, as the bf16 engine's
            stats_strides = [key.h * key.sq, 1, key.h, 1]
        if key.phase == "fwd":
            for name in _FWD_SCALARS:
                kw[name] = small(name, [1, 1, 1, 1], f32)
            o, stats, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, generate_stats=True, name="sdpa_fp8", **kw)
            output("o", o, key.sq, key.h, key.dv, e4m3)
            stats.set_output(True).set_dim(stats_dims).set_stride(stats_strides).set_data_type(f32)
            if key.layout == "thd":
                stats.set_ragged_offset(offsets("off_stats"))
            tensors["stats"] = stats
            scalar_out("amax_s", amax_s)
            scalar_out("amax_o", amax_o)
        else:
            o = operand("o", key.sq, key.h, key.dv, e4m3)
            do = operand("do", key.sq, key.h, key.dv, dt[key.bwd_dtype])
            stats = g.tensor(name="stats", dim=stats_dims, stride=stats_strides, data_type=f32)
            if key.layout == "thd":  # built only by the GPU probe: plan() refuses thd in training
                stats.set_ragged_offset(offsets("off_stats"))
            tensors["stats"] = stats
            for name in _BWD_SCALARS:
                kw[name] = small(name, [1, 1, 1, 1], f32)
            dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = g.sdpa_fp8_backward(
                q=q, k=k, v=v, o=o, dO=do, stats=stats, use_deterministic_algorithm=key.deterministic,
                name="sdpa_fp8_backward", **kw)
            out_dt = dt[key.bwd_dtype]
            output("dq", dq, key.sq, key.h, key.dqk, out_dt)
            output("dk", dk, key.skv, key.hkv, key.dqk, out_dt)
            output("dv", dv, key.skv, key.hkv, key.dv, out_dt)
            for name, t in (("amax_dq", amax_dq), ("amax_dk", amax_dk), ("amax_dv", amax_dv),
                            ("amax_dp", amax_dp)):
                scalar_out(name, t)
        workspace = build_graph(c, g, "FP8 " + key.phase, key)
        return _Built(g, tensors, workspace)

    def _run(self, built: _Built, buffers: dict[str, torch.Tensor], device: int) -> None:
        with _cd._on_device(device):
            state = self._device(device)
            stream = _cd._stream(device)
            state.bind(self.cudnn, stream)
            ws = state.workspace(stream, built.workspace, device)
            built.graph.execute({built.tensors[n]: buffers[n] for n in built.tensors}, ws, handle=state.handle)

    # --- the call ---------------------------------------------------------------------------------------
    def _key(self, phase: str, call: Any, cfg: AttnConfig, device: int, fp8: FP8Call) -> _Key:
        return _Key(phase, device, call.b, call.h, call.hkv, call.sq, call.skv, call.dqk, call.dv, call.fmt,
                    call.padding, "causal" in cfg.attn_mask_type, float(cfg.softmax_scale), cfg.deterministic,
                    fp8.state.dtypes["do"], call.fmt == "thd" and self.cudnn.backend_version() >= 90500)

    def _signature(self, call: Any, cfg: AttnConfig, dtype: torch.dtype, phase: str, fp8: FP8Call) -> tuple:
        """The table's rejection signature (constraints.cudnn_common.rejection_signature) of this call."""
        p = AttentionParams(dtype=dtype, qkv_format=call.fmt, batch_size=call.b, num_heads=call.h,
                            num_gqa_groups=call.hkv, head_dim_qk=call.dqk, head_dim_v=call.dv,
                            max_seqlen_q=call.max_q, max_seqlen_kv=call.max_kv, attn_mask_type=cfg.attn_mask_type,
                            window_size=tuple(cfg.window_size), fp8=True, fp8_recipe=fp8.state.recipe.kind)
        return rejection_signature(p, cfg.deterministic, "fp8_" + phase)

    @staticmethod
    def _scalars(names: tuple[str, ...], fwd: tuple[torch.Tensor, torch.Tensor],
                 bwd: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            slot, which = _SCALAR_SOURCE[name]
            scales, descales = fwd if which == "fwd" else bwd
            vector = descales if name.startswith("descale") else scales
            i = INDEX[slot]
            out[name] = vector[i:i + 1].view(1, 1, 1, 1)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return self._forward(q, k, v, aux, cfg, training)

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
                 training: bool) -> FwdResult:
        fp8 = _fp8_of(aux)
        # graphs first: a configuration cuDNN refuses is reported before anything is quantized or recorded
        plan = self.plan(q, k, v, aux, cfg, fp8, q.dtype, training)
        q8, k8, v8 = quantize(("q", "k", "v"), (q, k, v), fp8)
        o8, o_descale, saved = self.attend(plan, q8, k8, v8, fp8, q.dtype)
        out = Float8Output(o8, o_descale) if fp8.output_fp8 else fp8q.dequantize(o8, o_descale, q.dtype)
        call = saved.call
        lse = saved.stats.t() if call.fmt == "thd" else saved.stats.view(call.b, call.h, call.sq)  # thd: [h, t]
        if training and not fp8.fp8_backward():  # the FP8 copies are not needed by a bf16 backward
            return FwdResult(out, lse, _F16Saved(call, saved.stats, saved.key.device), None)
        return FwdResult(out, lse, saved, None)

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig, fp8: FP8Call,
             dtype: torch.dtype, training: bool) -> tuple:
        """(call, forward key, forward graph) of a call on q, k, v (`dtype` ones, or their FP8 data); with
        `training`, the backward graph is built (or found) too. Nothing is recorded in the scaling state."""
        call = _cd._prepare(q, k, v, aux, cfg, io_dtypes=(dtype, E4M3))
        f16_backward = training and not fp8.fp8_backward()
        if f16_backward and q.dtype == E4M3:
            raise ValueError("NVTE_FP8_DPA_BWD=0 with inputs quantized before the call (context parallelism): the "
                             "FP8 a2a path runs cuDNN's FP8 backward; unset NVTE_FP8_DPA_BWD or run in bf16")
        if call.fmt == "thd" and training and not f16_backward:
            raise ValueError("cudnn_fused:fp8 runs thd in inference only (cuDNN's FP8 backward takes no ragged "
                             "tensors on Hopper; its table says so); NVTE_FP8_DPA_BWD=0 trains it with a bf16 "
                             "backward")
        dev = q.device.index if q.device.index is not None else _cd._current_device()
        key = self._key("fwd", call, cfg, dev, fp8)
        built = self.graph(key, lambda: self._signature(call, cfg, dtype, "fwd", fp8))
        if f16_backward:
            self._prebuild_f16_backward(key, call, q, k, v, aux, cfg, dtype, dev)
        elif training:
            self.graph(self._key("bwd", call, cfg, dev, fp8), lambda: self._signature(call, cfg, dtype, "bwd", fp8))
        return call, key, built

    def _prebuild_f16_backward(self, key: _Key, call: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               aux: AttnAux, cfg: AttnConfig, dtype: torch.dtype, dev: int) -> None:
        """The bf16 backward graph this call's backward will ask for (dO laid out like O, which the dequantization
        writes contiguous in the call's layout), built now so that a refusal is reported before anything runs."""
        f16 = self.f16_engine()
        out_shape = (call.t_q, call.h, call.dv) if call.fmt == "thd" else (
            (call.b, call.sq, call.h, call.dv) if call.fmt == "bshd" else (call.sq, call.b, call.h, call.dv))
        out = torch.empty(out_shape, dtype=dtype, device="meta")
        f16._prebuild_backward(key, call, cfg, q, k, v, out, dev, None, False, False, None, aux,
                               lambda phase: f16._signature(call, cfg, dtype, phase, None))

    def attend(self, plan: tuple, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, fp8: FP8Call,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, _Saved]:
        """cuDNN's FP8 forward on quantized q, k, v: (O's FP8 data, O's descale [1], what backward needs). The
        kernel's S and O amaxes are recorded and the forward scales updated (reduced over fp8.group)."""
        call, key, built = plan
        st = fp8.state.to(q8.device)
        scales = st.scale.clone()
        descales = scales.reciprocal()
        o8 = _empty(call, call.h, call.dv, E4M3, q8.device)
        if call.fmt == "thd":  # ragged [t, h] stats; rows outside every sequence stay -inf
            stats = _cd._thd_buffer(None, (call.t_q, call.h), torch.float32, q8.device, call.end_q, call.gaps,
                                    float("-inf"))
        else:
            stats = torch.empty(call.b, call.h, call.sq, 1, dtype=torch.float32, device=q8.device)
        buffers = {"q": q8, "k": k8, "v": v8, "o": o8, "stats": stats,
                   "amax_s": st.amax_slot("s").view(1, 1, 1, 1), "amax_o": st.amax_slot("o").view(1, 1, 1, 1)}
        buffers.update(self._scalars(_FWD_SCALARS, (scales, descales)))
        if call.padding:
            buffers["seq_len_q"] = call.lens_q.view(-1, 1, 1, 1)
            buffers["seq_len_kv"] = call.lens_kv.view(-1, 1, 1, 1)
        if call.fmt == "thd":
            buffers.update(_ragged_offsets(call, key))
        self._run(built, buffers, key.device)
        st.update(FORWARD, fp8.group)
        saved = _Saved(key, call, q8, k8, v8, o8, stats, scales, descales, dtype, fp8)
        return o8, descales[INDEX["o"]:INDEX["o"] + 1], saved

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, state: Any, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        if isinstance(state, _F16Saved):
            return BwdResult(*self._backward_f16(state, dout, q, k, v, out, aux, cfg))
        if not isinstance(state, _Saved):
            raise ValueError("cudnn_fused:fp8 backward needs the state its forward returned (FP8 q, k, v, O)")
        return BwdResult(*self._backward(state, dout, cfg))

    def _backward_f16(self, saved: _F16Saved, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> tuple[torch.Tensor, ...]:
        """NVTE_FP8_DPA_BWD=0: the bf16 engine's backward on q, k, v, the dequantized O and the FP8 forward's
        stats. The scaling state is not read or written."""
        f16, call = self.f16_engine(), saved.call
        thd = call.fmt == "thd"
        lse = saved.stats.t() if thd else saved.stats.view(call.b, call.h, call.sq)
        dout = dout.reshape(out.shape)
        if not dout.is_contiguous():  # the graph was built for dO laid out like O
            dout = dout.contiguous()
        stats_stride = (call.h * call.sq, 1, call.h, 1) if thd else (call.h * call.sq, call.sq, 1, 1)
        key = f16._key("fwd", call, cfg, q.dtype, saved.device, {"q": q, "k": k, "v": v, "o": out}, None, False,
                       False, None, stats_stride, False)
        state = _cd._FwdState(key, call, None, False, None, None)
        grads = f16.backward(dout, q, k, v, out, lse, state, aux, cfg)
        return grads.dq, grads.dk, grads.dv

    def _backward(self, saved: _Saved, dout: torch.Tensor, cfg: AttnConfig):
        built = self.backward_graph(saved, cfg)
        do8 = quantize(("do",), (dout.reshape(saved.o8.shape),), saved.fp8)[0]
        grads, descales = self.attend_backward(built, saved, do8, cfg)
        return tuple(fp8q.dequantize(g, d, saved.dtype) for g, d in zip(grads, descales))

    def backward_graph(self, saved: _Saved, cfg: AttnConfig) -> _Built:
        return self.graph(self._key("bwd", saved.call, cfg, saved.key.device, saved.fp8),
                          lambda: self._signature(saved.call, cfg, saved.dtype, "bwd", saved.fp8))

    def attend_backward(self, built: _Built, saved: _Saved, do8: torch.Tensor, cfg: AttnConfig
                        ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """cuDNN's FP8 backward on quantized dO: ((dQ, dK, dV) FP8 data, their descales [1]). The kernel's amaxes
        are recorded and the backward scales updated (reduced over fp8.group)."""
        fp8, call, st = saved.fp8, saved.call, saved.fp8.state
        bwd_dtype = st.dtypes["do"]
        bscales = st.scale.clone()
        bdescales = bscales.reciprocal()
        device = saved.q8.device
        dq8 = torch.empty(saved.q8.shape, dtype=bwd_dtype, device=device)
        dk8 = torch.empty(saved.k8.shape, dtype=bwd_dtype, device=device)
        dv8 = torch.empty(saved.v8.shape, dtype=bwd_dtype, device=device)
        buffers = {"q": saved.q8, "k": saved.k8, "v": saved.v8, "o": saved.o8, "do": do8, "stats": saved.stats,
                   "dq": dq8, "dk": dk8, "dv": dv8}
        for name in ("dq", "dk", "dv", "dp"):
            buffers["amax_" + name] = st.amax_slot(name).view(1, 1, 1, 1)
        buffers.update(self._scalars(_BWD_SCALARS, (saved.scales, saved.descales), (bscales, bdescales)))
        if call.padding:
            buffers["seq_len_q"] = call.lens_q.view(-1, 1, 1, 1)
            buffers["seq_len_kv"] = call.lens_kv.view(-1, 1, 1, 1)
        self._run(built, buffers, saved.key.device)
        st.update(BACKWARD, fp8.group)
        descales = tuple(bdescales[INDEX[n]:INDEX[n] + 1] for n in ("dq", "dk", "dv"))
        return (dq8, dk8, dv8), descales

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig, *,
                 flatten_heads: bool = False) -> tuple[Any, torch.Tensor, None]:
        """(out, lse, None): gradients reach q, k, v through the FP8 backward; with an FP8 output none can."""
        fp8 = _fp8_of(aux)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            if fp8.output_fp8:
                raise ValueError("fp8_output=True cannot take gradients (the output is a Float8Output); run the "
                                 "call under torch.no_grad(), or use fp8_output=False for training")
            out, lse = _FP8Function.apply(self, aux, cfg, flatten_heads, q, k, v)
            return out, lse, None
        with torch.no_grad():
            out, lse, _, _ = self.forward(q, k, v, aux, cfg)
        return (out.flatten(-2) if flatten_heads else out), lse, None


class _FP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine: CudnnFP8Engine, aux: AttnAux, cfg: AttnConfig, flatten_heads: bool, q, k, v):
        out, lse, saved, _ = engine._forward(q, k, v, aux, cfg, training=True)  # grad mode is off in here
        ctx.engine, ctx.cfg, ctx.aux, ctx.saved = engine, cfg, aux, saved
        if isinstance(saved, _F16Saved):  # through autograd's saved tensors: O is an output (no reference cycle)
            ctx.save_for_backward(q, k, v, out)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return (out.flatten(-2) if flatten_heads else out), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved, ctx.saved = ctx.saved, None  # the FP8 tensors are freed once backward has used them
        if dout is None:
            return (None,) * 7
        if saved is None:
            raise RuntimeError("cudnn_fused:fp8 backward ran twice through the same graph; pass retain_graph=False "
                               "or run the forward again")
        if isinstance(saved, _F16Saved):
            q, k, v, out = ctx.saved_tensors
            dq, dk, dv = ctx.engine._backward_f16(saved, dout, q, k, v, out, ctx.aux, ctx.cfg)
        else:
            dq, dk, dv = ctx.engine._backward(saved, dout, ctx.cfg)
        return None, None, None, None, dq, dk, dv
